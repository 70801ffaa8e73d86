"""The static description of one attention call, shared by every schedule."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Everything about an attention call that is not an array (hashable: a jit static).

  Field meanings follow docs/architecture.md: `softcap == 0` is off, a window side of -1 is
  unbounded, `is_causal` is top-left aligned (key s kept when s <= t).
  """
  scale: float
  softcap: float = 0.0
  is_causal: bool = False
  window_left: int = -1
  window_right: int = -1
  has_bias: bool = False
  has_mask: bool = False
  # The backward must give bitwise-repeatable gradients (forwards always do).
  deterministic: bool = False

  @property
  def has_window(self) -> bool:
    return self.window_left >= 0 or self.window_right >= 0


class AttentionShape(NamedTuple):
  """Sizes of a call in the BTNH / BSKH layout."""
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  @classmethod
  def of(cls, query, key) -> "AttentionShape":
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    return cls(b, t, s, n, k, h)
