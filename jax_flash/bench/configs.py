"""What is measured: attention cases, the grids of ../shared/BENCHMARK.md, and their counting."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

MODES = ("fwd", "fwdbwd", "decode")

# BENCHMARK.md: the GPU grid keeps B*T = 16384 tokens and N*H = 2048 model width.
GPU_GRID = dict(heads=(64, 128, 256), seqlens=(1024, 4096, 16384), causal=(False, True),
                tokens=16384, width=2048, dtype="bfloat16")
# The CPU bar of the issue, B=1 N=8 T=S=2048 H=64 f32, is this grid's non-causal case.
CPU_GRID = dict(heads=(64,), seqlens=(2048,), causal=(False, True), tokens=2048, width=512,
                dtype="float32")

# (B, N, K, S, H), query length 1.
GPU_DECODE_GRID = ((1, 32, 8, 32768, 128), (8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128),
                   (16, 32, 32, 8192, 128))
CPU_DECODE_GRID = ((1, 8, 2, 8192, 64), (4, 8, 8, 2048, 64))


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem in one mode: BTNH queries, BSKH keys/values, no bias/mask."""
  mode: str          # "fwd" | "fwdbwd" | "decode"
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  causal: bool
  dtype: str

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")

  @property
  def label(self) -> str:
    kind = "causal" if self.causal else "full"
    return (f"B{self.batch} T{self.q_len} S{self.kv_len} N{self.num_heads} K{self.num_kv_heads} "
            f"H{self.head_dim} {kind} {self.dtype}")

  @property
  def itemsize(self) -> int:
    return np.dtype(_numpy_dtype_name(self.dtype)).itemsize

  def forward_flops(self) -> float:
    """4·B·N·T·S·H, halved when causal (BENCHMARK.md)."""
    flops = 4.0 * self.batch * self.num_heads * self.q_len * self.kv_len * self.head_dim
    return flops / 2 if self.causal else flops

  def flops(self) -> float:
    """FLOPs of one timed call: forward, or forward + backward (3.5x forward)."""
    return self.forward_flops() * (3.5 if self.mode == "fwdbwd" else 1.0)

  def kv_bytes(self) -> float:
    """KV-cache bytes one call reads: 2·B·S·K·H·itemsize (the decode rate's numerator)."""
    return 2.0 * self.batch * self.kv_len * self.num_kv_heads * self.head_dim * self.itemsize

  def input_bytes(self) -> int:
    """Bytes of one input set (q, k, v, and dout in fwdbwd mode)."""
    q = self.batch * self.q_len * self.num_heads * self.head_dim
    kv = 2 * self.batch * self.kv_len * self.num_kv_heads * self.head_dim
    return (q * (2 if self.mode == "fwdbwd" else 1) + kv) * self.itemsize

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _numpy_dtype_name(name: str) -> str:
  # NumPy has no bfloat16; its itemsize is that of float16.
  return "float16" if name == "bfloat16" else name


def attention_grid(mode: str, heads, seqlens, causal, tokens: int, width: int,
                   dtype: str) -> list[Case]:
  """Cases with B = tokens // T and N = K = width // H, for every (H, T, causal)."""
  cases = []
  for h, t, c in itertools.product(heads, seqlens, causal):
    if tokens % t or width % h:
      raise ValueError(f"--seqlens {t} must divide --tokens {tokens} and --heads {h} must "
                       f"divide --width {width}")
    n = width // h
    cases.append(Case(mode, tokens // t, t, t, n, n, h, bool(c), dtype))
  return cases


def decode_grid(grid, dtype: str) -> list[Case]:
  return [Case("decode", b, 1, s, n, k, h, False, dtype) for b, n, k, s, h in grid]


# The CPU bar: jax_flash's CPU kernel must be no slower than XLA's attention here.
CPU_BAR = Case("fwd", 1, 2048, 2048, 8, 8, 64, False, "float32")


def quick_cases() -> list[Case]:
  """--quick on the CPU: the CPU bar (forward) and a tiny forward + backward."""
  return [CPU_BAR,
          Case("fwdbwd", 1, 256, 256, 2, 2, 32, False, "float32"),
          Case("fwdbwd", 1, 256, 256, 2, 2, 32, True, "float32")]
