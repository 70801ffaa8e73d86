"""Ring attention throughput: one GPU against a context-parallel ring over several, one run.

  python examples/ring_benchmark.py                      # T=65536, N=16, H=128, bf16, causal
  python examples/ring_benchmark.py --mode fwd,fwdbwd --devices 2 --iters 20
  python examples/ring_benchmark.py --host-devices 2 --seq 1024 --heads 2 --head-dim 32 \
      --dtype float32 --iters 2                          # CPU dry run of the whole script

For each mode (forward; forward + backward) it times, in one process:
  single    jax_flash.flash_attention on device 0, the whole sequence;
  ring      jax_flash.ring.ring_attention inside jax.shard_map over `--devices` devices, inputs
            already in the zigzag layout (the load-balanced layout a model would keep);
  ring_auto jax_flash.flash_attention under jit with the sequence axis of q/k/v sharded
            (NamedSharding, natural order): the custom partitioning runs the same ring and
            reorders to zigzag and back inside (two ppermutes per tensor each way).
TFLOP/s use the BENCHMARK.md counting (causal forward = 2·B·N·T²·H; fwd+bwd = 3.5 × forward)
and the host-timed loop (many asynchronous calls closed by one block_until_ready; median of
`--repeats`). Every output (and every gradient) is checked in the same run against a float64
reference on `--check-rows` query rows, and the ring outputs against the single-device output.
Then, per mode, one profiler trace of each path names the kernels that ran and their device time
per call, summed over the devices (jax_flash.bench.kernels): where a ring loses time against
twice the single-device rate shows there (attention kernels, merges, NCCL, copies).
The last line is a JSON summary; `speedup` = ring TFLOP/s / single TFLOP/s (goal >= 1.8 on 2 GPUs).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq", type=int, default=65536, help="global sequence length T (= S)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16, help="query heads N")
  p.add_argument("--kv-heads", type=int, default=None, help="kv heads K (default N)")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--non-causal", action="store_true")
  p.add_argument("--devices", type=int, default=2, help="devices in the ring")
  p.add_argument("--mode", default="fwd,fwdbwd")
  p.add_argument("--iters", type=int, default=10, help="calls per timed loop")
  p.add_argument("--repeats", type=int, default=5, help="timed loops; the median is reported")
  p.add_argument("--check-rows", type=int, default=8, help="rows checked against float64")
  p.add_argument("--schedule", default="auto")
  p.add_argument("--no-kernels", action="store_true", help="skip the profiler trace")
  p.add_argument("--host-devices", type=int, default=0,
                 help="CPU dry run: force this many host devices (sets XLA_FLAGS)")
  return p.parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  if args.host_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.host_devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # after XLA_FLAGS
  import jax.numpy as jnp
  import numpy as np

  import jax_flash
  from jax_flash import ring

  causal = not args.non_causal
  b, t, n, h = args.batch, args.seq, args.heads, args.head_dim
  k_heads = args.kv_heads or n
  devices = jax.devices()
  if len(devices) < args.devices:
    sys.exit(f"needs {args.devices} devices; found {len(devices)}: {devices}")
  print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; B={b} T={t} N={n} "
        f"K={k_heads} H={h} {args.dtype} causal={causal}; ring over {args.devices} devices")

  rng = np.random.default_rng(0)
  host = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
          (("q", (b, t, n, h)), ("k", (b, t, k_heads, h)), ("v", (b, t, k_heads, h)),
           ("dout", (b, t, n, h)))}
  dtype = jnp.dtype(args.dtype)
  rows = np.unique(np.linspace(0, t - 1, args.check_rows).astype(int))
  # The reference sees the values the kernels see (rounded to the input dtype); of q and dout
  # only the checked rows.
  as_f64 = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  rounded = {"k": as_f64(host["k"]), "v": as_f64(host["v"]),
             "q_rows": as_f64(host["q"][:, rows]), "dout_rows": as_f64(host["dout"][:, rows])}
  attention = functools.partial(jax_flash.flash_attention, is_causal=causal,
                                schedule=args.schedule)

  mesh = jax.make_mesh((args.devices,), ("ring",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices[:args.devices])
  seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "ring"))
  zigzag = functools.partial(ring.to_layout, num_shards=args.devices, layout="zigzag")
  natural = functools.partial(ring.from_layout, num_shards=args.devices, layout="zigzag")
  ring_map = jax.shard_map(
      functools.partial(ring.ring_attention, axis_name="ring", is_causal=causal,
                        layout="zigzag", schedule=args.schedule),
      mesh=mesh, in_specs=(seq.spec,) * 3, out_specs=seq.spec)

  def place(placement, layout=lambda x: x):
    return {name: jax.device_put(layout(jnp.asarray(x, dtype)), placement)
            for name, x in host.items()}

  paths = {  # name -> (attention on (q, k, v), inputs, output back to natural order)
      "single": (attention, place(devices[0]), lambda x: x),
      "ring": (ring_map, place(seq, zigzag), natural),
      "ring_auto": (attention, place(seq), lambda x: x),
  }
  forward_flops = 4 * b * n * t * t * h * (0.5 if causal else 1.0)
  summary = {"config": dict(vars(args), causal=causal), "results": {}}
  for mode in args.mode.split(","):
    flops = forward_flops * (1.0 if mode == "fwd" else 3.5)
    outputs, runs = {}, {}
    for name, (fn, x, back) in paths.items():
      step = _step(jax, jnp, fn, mode)
      runs[name] = functools.partial(lambda step, x: jax.block_until_ready(
          step(x["q"], x["k"], x["v"], x["dout"])), step, x)
      seconds = _time(jax, step, (x["q"], x["k"], x["v"], x["dout"]), args.iters, args.repeats)
      result = step(x["q"], x["k"], x["v"], x["dout"])
      outputs[name] = [np.asarray(back(r).astype(jnp.float32), np.float64)
                       for r in jax.tree.leaves(result)]
      errors = _reference_errors(outputs[name], rounded, rows, causal, mode)
      entry = dict(seconds=seconds, tflops=flops / seconds / 1e12, **errors)
      if name != "single":
        entry["vs_single_rel_l2"] = max(_rel_l2(o, s) for o, s in zip(outputs[name],
                                                                        outputs["single"]))
      summary["results"][f"{mode}/{name}"] = entry
      print(f"{mode:7s} {name:9s} {seconds * 1e3:9.2f} ms {entry['tflops']:8.1f} TFLOP/s  "
            + "  ".join(f"{k}={v:.2e}" for k, v in entry.items() if k not in ("seconds",
                                                                             "tflops")))
    for name in ("ring", "ring_auto"):
      speedup = (summary["results"][f"{mode}/{name}"]["tflops"]
                 / summary["results"][f"{mode}/single"]["tflops"])
      summary["results"][f"{mode}/{name}"]["speedup"] = speedup
      print(f"{mode:7s} {name:9s} speedup over one device: {speedup:.2f}x "
            f"({'meets' if speedup >= 1.8 else 'misses'} the 1.8x goal)")
    if not args.no_kernels:
      summary["kernels"] = summary.get("kernels", {})
      summary["kernels"][mode] = _kernel_times(jax, runs)
  print(json.dumps(summary))


def _kernel_times(jax, runs) -> dict:
  """Prints and returns, per path, the kernels of one call with their device time (ms, summed
  over the devices the call runs on), heaviest first."""
  from jax_flash.bench import kernels
  reports = kernels.trace_kernels(runs, jax.default_backend())
  result = {}
  for name, report in reports.items():
    if report.error:
      print(f"kernels {name}: {report.error}")
      continue
    per_call = [(k.name, k.time_us / kernels.RUNS_PER_IMPL / 1e3, k.share)
                for k in report.kernels]
    total = sum(ms for _, ms, _ in per_call)
    print(f"kernels {name}: {total:.2f} ms device time per call (all devices)")
    for kernel_name, ms, share in per_call[:8]:
      print(f"   {ms:8.3f} ms {100 * share:5.1f}%  {kernels.short_name(kernel_name, 90)}")
    result[name] = {"total_ms": total, "kernels": per_call[:16]}
  return result


def _step(jax, jnp, attention, mode):
  """The jitted unit of work: the output (fwd) or the gradients of <out, dout> (fwdbwd)."""
  if mode == "fwd":
    return jax.jit(lambda q, k, v, dout: attention(q, k, v))
  if mode != "fwdbwd":
    raise SystemExit(f"--mode takes fwd and/or fwdbwd; got {mode!r}")
  loss = lambda q, k, v, dout: jnp.sum(attention(q, k, v).astype(jnp.float32) * dout)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _time(jax, step, inputs, iters, repeats):
  jax.block_until_ready(step(*inputs))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    results = [step(*inputs) for _ in range(iters)]
    jax.block_until_ready(results)
    times.append((time.perf_counter() - start) / iters)
    del results
  return statistics.median(times)


def _reference_rows(x, rows, causal):
  """float64 attention output and dq for the query `rows` (natural positions)."""
  import numpy as np
  qr, dr, k, v = (x[name] for name in ("q_rows", "dout_rows", "k", "v"))  # rows: [B, R, N, H]
  group = qr.shape[2] // k.shape[2]
  kx, vx = (np.repeat(a, group, axis=2) for a in (k, v))           # [B, S, N, H]
  scale = 1 / np.sqrt(qr.shape[-1])
  scores = scale * np.einsum("brnh,bsnh->bnrs", qr, kx)
  if causal:
    scores = np.where(np.arange(k.shape[1])[None, :] <= rows[:, None], scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bnrs,bsnh->brnh", p, vx)
  dp = np.einsum("brnh,bsnh->bnrs", dr, vx)
  ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
  dq = scale * np.einsum("bnrs,bsnh->brnh", ds, kx)
  return out, dq


def _reference_errors(outputs, x, rows, causal, mode):
  """Max abs error of the output rows (fwd) or relative L2 error of the dq rows (fwdbwd). Only
  these rows are affordable in float64 at long T; dk / dv sum over every row, so they are
  checked against the single-device run instead (vs_single_rel_l2)."""
  out, dq = _reference_rows(x, rows, causal)
  if mode == "fwd":
    import numpy as np
    return {"ref_max_abs_err": float(np.max(np.abs(outputs[0][:, rows] - out)))}
  return {"ref_dq_rel_l2": _rel_l2(outputs[0][:, rows], dq)}


def _rel_l2(got, want) -> float:
  import numpy as np
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


if __name__ == "__main__":
  main()
