"""cuDNN forward timings on the 18 grid configs of /work/shared/BENCHMARK.md, run in the same
device session as tests/gpu/harness_v3.cu so that v3 is compared with the peer measured there.

jax.nn.dot_product_attention(implementation="cudnn"), bf16, BTNH, random normal inputs. Timing:
a host loop of asynchronous calls of the jitted function closed by one block_until_ready (the
protocol of BENCHMARK.md), best of 3 repeats. The output of every config is checked against a
float64 NumPy reference on sampled rows, and the compiled HLO is searched for the cuDNN custom
call so the row names the kernel that ran.

  python3 tests/gpu/peer_cudnn_fwd.py [--configs H:T:causal,...]
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np


def grid():
  for h in (64, 128, 256):
    for t in (1024, 4096, 16384):
      for causal in (False, True):
        yield h, t, causal


def reference_row(q, k, v, scale):
  """float64 attention of one query row q [H] over keys k [S, H] and values v [S, H]."""
  x = scale * (k @ q)
  p = np.exp(x - x.max())
  return (p @ v) / p.sum()


def check(q, k, v, out, causal, rows, rng):
  """Max abs and relative L2 error of `rows` random output rows against float64."""
  b_, t_, n_, h = q.shape
  as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  max_abs, sq_err, sq_ref = 0.0, 0.0, 0.0
  for _ in range(rows):
    b, t, n = (int(rng.integers(d)) for d in (b_, t_, n_))
    keys = t + 1 if causal else k.shape[1]
    ref = reference_row(as64(q[b, t, n]), as64(k[b, :keys, n]), as64(v[b, :keys, n]),
                        1.0 / np.sqrt(h))
    err = np.abs(as64(out[b, t, n]) - ref)
    max_abs = max(max_abs, float(np.nan_to_num(err, nan=np.inf).max()))
    sq_err += float((err ** 2).sum())
    sq_ref += float((ref ** 2).sum())
  return max_abs, (sq_err / sq_ref) ** 0.5


def time_calls(f, args, seconds=0.25, repeats=3):
  """Best per-call seconds of a host loop of async calls closed by one block_until_ready."""
  f(*args).block_until_ready()
  start = time.perf_counter()
  f(*args).block_until_ready()
  iters = max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - start) / iters)
  return best


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--configs", default="", help="H:T:causal,... (default: the 18 of the grid)")
  parser.add_argument("--implementation", default="cudnn", help="of dot_product_attention")
  opts = parser.parse_args()
  configs = list(grid())
  if opts.configs:
    configs = [(int(h), int(t), c == "1") for h, t, c in (x.split(":") for x in opts.configs.split(","))]
  print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
  rng = np.random.default_rng(0)
  rows = []
  for h, t, causal in configs:
    n, b = 2048 // h, 16384 // t
    keys = jax.random.split(jax.random.key(h * 100003 + t * 7 + causal), 3)
    q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
    f = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation=opts.implementation))
    hlo = f.lower(q, k, v).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]*cudnn[^"]*)"', hlo)))
    kernel = ",".join(targets) or "no cudnn custom call"
    out = f(q, k, v).block_until_ready()
    max_abs, rel_l2 = check(q, k, v, out, causal, 12, rng)
    seconds = time_calls(f, (q, k, v))
    flops = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
    tflops = flops / seconds / 1e12
    rows.append((h, t, causal, tflops))
    print(f"{opts.implementation} H={h} T={t} causal={int(causal)} {seconds * 1e3:.4f} ms {tflops:.1f} TFLOP/s "
          f"max_abs={max_abs:.2e} rel_l2={rel_l2:.2e} kernel={kernel}", flush=True)
  print(f"\n{opts.implementation} forward TFLOP/s (host-timed loop, best of 3)")
  print(f"   H      T c {opts.implementation:>8s}")
  for h, t, causal, tflops in rows:
    print(f"{h:4d} {t:6d} {int(causal)} {tflops:8.1f}")


if __name__ == "__main__":
  main()
