"""PyTorch SDPA's FlashAttention-2 backend on the benchmark grid's H=128 rows, timed the way
harness_v1v2 times the v1 / v2 kernels (median of CUDA-event-bracketed calls), so the two tables
come from one run on one card. BTNH inputs (the transposed views are what SDPA's flash backend
reads without a copy). Prints the kernels that ran, from the profiler.

  python3 tests/gpu/bench_torch_flash.py
  python3 tests/gpu/bench_torch_flash.py --once H   one forward and backward at the grid's
                                                   T=4096 row of head dim H, nothing printed
                                                   (for ncu: -k regex:flash_fwd / flash_bwd)
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def median_ms(fn, warmup=5, reps=20):
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    times.append(start.elapsed_time(stop))
  return sorted(times)[reps // 2]


def kernels_of(fn):
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    fn()
    torch.cuda.synchronize()
  return sorted({e.name for e in prof.events() if "flash" in e.name.lower()})


def forward_backward_once(h):
  n = 2048 // h
  q, k, v, dout = (torch.randn(4, 4096, n, h, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(4))
  q, k, v = (x.requires_grad_() for x in (q, k, v))
  with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    torch.autograd.grad(sdpa(q, k, v), (q, k, v), dout)
  torch.cuda.synchronize()


def main():
  torch.manual_seed(0)
  h, n = 128, 16
  print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
  print(f"{'config':28s} {'flash fwd':>10s} {'flash fwd+bwd':>14s}   max_abs vs f64 (out)")
  named = False
  for t in (1024, 4096, 16384):
    for causal in (False, True):
      b = 16384 // t
      q, k, v, dout = (torch.randn(b, t, n, h, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
      q, k, v = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
      dout = dout.transpose(1, 2)
      flops = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
      with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        forward = lambda: sdpa(q, k, v, is_causal=causal)
        def both():
          out = sdpa(q, k, v, is_causal=causal)
          torch.autograd.grad(out, (q, k, v), dout)
        fwd_ms = median_ms(forward)
        both_ms = median_ms(both)
        if not named:
          print("kernels:", kernels_of(both))
          named = True
        out = forward()
      # Check a few rows of one head in float64.
      q64, k64, v64 = (x[0, 0].double() for x in (q, k, v))
      rows = torch.randint(0, t, (8,), device="cuda")
      scores = q64[rows] @ k64.T / h ** 0.5
      if causal:
        scores = scores.masked_fill(torch.arange(t, device="cuda")[None] > rows[:, None],
                                    float("-inf"))
      ref = torch.softmax(scores, -1) @ v64
      err = (out[0, 0, rows].double() - ref).abs().max().item()
      print(f"T={t:<5d} B={b:<2d} causal={int(causal)}        {flops / fwd_ms * 1e-9:10.1f} "
            f"{3.5 * flops / both_ms * 1e-9:14.1f}   {err:.1e}", flush=True)
      del q, k, v, dout, out


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--once":
    forward_backward_once(int(sys.argv[2]))
  elif len(sys.argv) == 1:
    main()
  else:
    sys.exit(f"usage: {sys.argv[0]} [--once HEAD_DIM]")
