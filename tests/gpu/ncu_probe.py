"""One attention call (forward, or forward + backward by vjp) through jax, for ncu to profile.

  ncu --clock-control none --kernel-name regex:bprop --launch-count 1 --section LaunchStats \
      python3 tests/gpu/ncu_probe.py cudnn bwd 4 4096 16 2 128 1

Arguments: an implementation the bench knows (v2, v3, cudnn, torch_flash, ...: python -m
jax_flash.bench --help), mode (fwd | bwd: the bench's fwdbwd), then B T N K H causal. The call,
its inputs (bf16 standard normal) and its jit are the bench's own (jax_flash.bench: peers,
inputs, steps), so ncu profiles what the bench times. Two calls, so that ncu's --launch-count 1
after a --launch-skip can take the warm one. Session 8's launch facts of cuDNN's kernels
(docs/perf-notes-v3.md) came from this script's first version.
"""
import sys

import jax  # before jax_flash: importing the extension first segfaulted with jax 0.11

from jax_flash.bench import configs, inputs, peers, steps

_BENCH_MODE = {"fwd": "fwd", "bwd": "fwdbwd"}


def main() -> int:
  impl, mode = sys.argv[1], sys.argv[2]
  batch, seq, heads, kv_heads, head_dim, causal = (int(a) for a in sys.argv[3:9])
  case = configs.Case(_BENCH_MODE[mode], batch, seq, seq, heads, kv_heads, head_dim,
                      bool(causal), "bfloat16")
  available = {p.name: p for p in peers.all_peers(jax.default_backend())[0]}
  if impl not in available:
    raise SystemExit(f"{impl!r} is not available here; available: {sorted(available)}")
  args = inputs.make_set(case, jax.random.key(0))
  prepared = steps.prepare(available[impl], case, [args], args)  # the first call
  prepared.run_once()  # the second, warm one
  return 0


if __name__ == "__main__":
  sys.exit(main())
