"""Schedule selection: one place decides which kernel serves a call."""
from __future__ import annotations

from typing import NamedTuple

import jax

from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules.base import Schedule, registered

# Preference order of schedule="auto" per backend: the first schedule that is available in this
# process and supports the call serves it. Short-query calls reach "decode" first on the GPU
# because its envelope (extra_check) admits only them.
AUTO_ORDER = {"gpu": ("decode", "v3", "v2", "v1"), "cpu": ("cpu",)}


class ScheduleStatus(NamedTuple):
  name: str
  available: bool
  reason: str        # why not available ("" when available)
  description: str

  def __str__(self) -> str:
    state = "available" if self.available else f"unavailable: {self.reason}"
    return f"{self.name:8s} {state}  ({self.description})"


def schedules() -> list[ScheduleStatus]:
  """Every known schedule, whether it can run in this process, and why not when it cannot."""
  result = []
  for name, schedule in registered().items():
    reason = schedule.unavailable_reason()
    result.append(ScheduleStatus(name, reason is None, reason or "", schedule.description))
  return result


def select(name: str, shape: AttentionShape, dtype, config: AttentionConfig) -> Schedule:
  """The schedule that serves this call; ValueError naming `schedule` when none can."""
  known = registered()
  if not isinstance(name, str):
    raise ValueError(f"schedule must be a string; got {type(name).__name__}")
  if name == "auto":
    return _select_auto(known, shape, dtype, config)
  if name not in known:
    raise ValueError(f"schedule must be 'auto' or one of {sorted(known)}; got {name!r}")
  schedule = known[name]
  reason = schedule.unavailable_reason() or schedule.unsupported_reason(shape, dtype, config)
  if reason:
    raise ValueError(f"schedule={name!r} cannot serve this call: {reason}")
  return schedule


def _select_auto(known, shape, dtype, config) -> Schedule:
  backend = jax.default_backend()
  reasons = []
  for name in AUTO_ORDER.get(backend, ()):
    schedule = known.get(name)
    if schedule is None:
      continue
    reason = schedule.unavailable_reason() or schedule.unsupported_reason(shape, dtype, config)
    if reason is None:
      return schedule
    reasons.append(f"{name}: {reason}")
  detail = "; ".join(reasons) or f"no schedule exists for the {backend} backend"
  raise ValueError(f"schedule='auto' found no schedule for this call ({detail})")
