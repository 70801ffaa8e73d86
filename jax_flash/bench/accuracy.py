"""Every timed output checked against the float64 reference (jax_flash.reference) in the same run.

The reference materializes scores, so on large cases it runs on a slice that keeps CPU time sane:
batch element 0, the first query heads (one whole GQA group, or 2 heads), and `rows` query rows
with ALL keys (the first rows, or for causal cases the last rows, which see every key). In fwdbwd
mode the checked call gets a dout that is zero outside those rows: then dq of those rows and dk,
dv of every key are exactly the reference's gradients of the slice (see inputs.with_rows_of_dout).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax_flash import reference
from jax_flash.bench.configs import Case
from jax_flash.bench.steps import jax_to_numpy

# Relative L2 error allowed (the test suite's gradient tolerances): a row above it is garbage.
REL_L2_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 6e-3}


@dataclasses.dataclass(frozen=True)
class CheckSlice:
  rows: tuple[int, int]   # query rows [start, stop) of batch element 0
  heads: int              # query heads [0, heads)
  kv_heads: int           # kv heads [0, kv_heads)

  def describe(self, case: Case) -> str:
    whole = (self.rows == (0, case.q_len) and self.heads == case.num_heads and case.batch == 1)
    if whole:
      return "whole output"
    return (f"batch 0, query heads 0..{self.heads - 1}, query rows {self.rows[0]}..{self.rows[1] - 1}"
            f" of {case.q_len}, all {case.kv_len} keys"
            + ("; dq of those rows, dk/dv of every key (dout zero elsewhere)"
               if case.mode == "fwdbwd" else ""))

  def to_json(self, case: Case) -> dict:
    return {"batch": 0, "rows": list(self.rows), "heads": self.heads, "kv_heads": self.kv_heads,
            "description": self.describe(case)}


def check_slice(case: Case, rows: int) -> CheckSlice:
  count = min(rows, case.q_len)
  start = case.q_len - count if case.causal else 0
  group = case.num_heads // case.num_kv_heads
  if case.q_len == 1:                       # decode: every head is cheap
    heads, kv_heads = case.num_heads, case.num_kv_heads
  elif group > 1:                           # one whole group: its kv head's dk/dv are complete
    heads, kv_heads = group, 1
  else:
    heads = kv_heads = min(2, case.num_heads)
  return CheckSlice((start, start + count), heads, kv_heads)


def output_indices(case: Case, where: CheckSlice) -> dict[str, tuple]:
  """Where each output of the timed call holds the checked slice."""
  rows = slice(*where.rows)
  q_index = (0, rows, slice(0, where.heads))
  if case.mode != "fwdbwd":
    return {"out": q_index}
  kv_index = (0, slice(None), slice(0, where.kv_heads))
  return {"dq": q_index, "dk": kv_index, "dv": kv_index}


def reference_inputs(case: Case, check_set: tuple, where: CheckSlice) -> tuple[np.ndarray, ...]:
  """Host float32 copies of the slice's q, k, v (and dout in fwdbwd mode), each [1, rows|S,
  heads, H]. Taken on the calling thread: the copies run device work (the slice, the cast), and
  issued from the reference's worker thread they landed in XLA's cuDNN graph capture on the main
  thread, which then failed ("capturing stream has unjoined work") and left the copies garbage
  (every implementation of the row "failed" the check, rel. L2 ~1e300)."""
  start, stop = where.rows
  q_index = (slice(0, 1), slice(start, stop), slice(0, where.heads))
  kv_index = (slice(0, 1), slice(None), slice(0, where.kv_heads))
  host = (jax_to_numpy(check_set[0], q_index), jax_to_numpy(check_set[1], kv_index),
          jax_to_numpy(check_set[2], kv_index))
  if case.mode == "fwdbwd":
    host += (jax_to_numpy(check_set[3], q_index),)
  return host


def reference_outputs(case: Case, host: tuple[np.ndarray, ...],
                      where: CheckSlice) -> dict[str, np.ndarray]:
  """The float64 reference of the slice from reference_inputs' copies (host work only, so it can
  run beside device work): {"out"} or {"dq", "dk", "dv"}, each [rows|S, heads, H]."""
  q, k, v = host[:3]
  # top-left causal with the slice's row offset: key s kept when s <= start + t
  rule = dict(scale=1.0 / math.sqrt(case.head_dim), is_causal=case.causal,
              q_offset=where.rows[0])
  if case.mode != "fwdbwd":
    out, _ = reference.attention_forward_f64(q, k, v, **rule)
    return {"out": out[0]}
  dq, dk, dv, _ = reference.attention_backward_f64(q, k, v, host[3], **rule)
  return {"dq": dq[0], "dk": dk[0], "dv": dv[0]}


def compare(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray], dtype: str) -> dict:
  """Max abs and relative L2 error per tensor, the worst of each, and whether they pass."""
  per_tensor = {}
  for name, want in expected.items():
    got = np.asarray(outputs[name], np.float64)
    if got.shape != want.shape:
      raise ValueError(f"output {name} has shape {got.shape}; the reference slice is {want.shape}")
    err = got - want
    finite = bool(np.all(np.isfinite(got)))
    per_tensor[name] = {
        "max_abs": float(np.max(np.abs(err))) if finite else math.inf,
        "rel_l2": float(np.linalg.norm(err) / max(np.linalg.norm(want), 1e-300)) if finite
                  else math.inf}
  max_abs = max(t["max_abs"] for t in per_tensor.values())
  rel_l2 = max(t["rel_l2"] for t in per_tensor.values())
  tolerance = REL_L2_TOLERANCE[dtype]
  return {"max_abs": max_abs, "rel_l2": rel_l2, "tolerance_rel_l2": tolerance,
          "passed": bool(rel_l2 <= tolerance), "per_tensor": per_tensor}
