"""What a schedule is: an FFI forward/backward pair plus the envelope of calls it can serve.

A schedule module (cpu.py, v2.py, ...) builds one `Schedule` and registers it. The dispatch
(`jax_flash._dispatch`) asks `unsupported_reason` and `unavailable_reason`; the kernel call
(`jax_flash._kernel_call`) reads the target names and workspace shapes. Nothing else differs
between schedules on the Python side.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from jax_flash import _extension
from jax_flash._config import AttentionConfig, AttentionShape

# (shape, dtype) -> the extra outputs a target needs as device workspaces.
WorkspaceFn = Callable[[AttentionShape, np.dtype], Sequence[jax.ShapeDtypeStruct]]


def no_workspaces(shape: AttentionShape, dtype) -> Sequence[jax.ShapeDtypeStruct]:
  del shape, dtype
  return ()


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One way of executing attention. Frozen and hashable: it is a jit static argument."""
  name: str
  description: str
  platform: str                      # jax backend name: "cpu" or "gpu"
  forward_target: str
  backward_target: str
  dtypes: frozenset = frozenset({"float32", "bfloat16", "float16"})
  max_head_dim: int = 256
  # Kernels that tile the head dim need it padded (with zeros: they change no score).
  head_dim_multiple: int = 1
  supports_bias: bool = True
  supports_mask: bool = True
  supports_softcap: bool = True
  # The CUDA compute capabilities the schedule's machine code runs on (the extension embeds no
  # PTX, so no later architecture is covered); None on the CPU.
  compute_capabilities: frozenset[tuple[int, int]] | None = None
  forward_workspaces: WorkspaceFn = no_workspaces
  backward_workspaces: WorkspaceFn = no_workspaces
  # Extra predicate: returns a reason string when a call is outside the kernel's envelope.
  extra_check: Callable[[AttentionShape, AttentionConfig], str | None] | None = None
  # Whether the backward target's gradients are bitwise repeatable: "always", "on_request"
  # (when the call passes deterministic=True, at a cost) or "never" (dQ added with atomics).
  backward_determinism: str = "never"

  def __post_init__(self):
    if self.backward_determinism not in DETERMINISM:
      raise ValueError(f"backward_determinism must be one of {DETERMINISM}")

  def unavailable_reason(self) -> str | None:
    """Why this schedule cannot run in this process at all (None when it can)."""
    backend = jax.default_backend()
    if backend != self.platform:
      return f"needs the {self.platform} backend; the default backend is {backend}"
    missing = [t for t in (self.forward_target, self.backward_target)
               if t not in _extension.available_targets(self.platform)]
    if missing:
      return (f"the extension was built without {', '.join(missing)} "
              "(CUDA schedules need nvcc at build time)")
    if self.compute_capabilities is not None:
      have = _device_compute_capability()
      if have not in self.compute_capabilities:
        want = ", ".join(".".join(map(str, c)) for c in sorted(self.compute_capabilities))
        return f"runs on compute capability {want}; the device has {have}"
    return None

  def unsupported_reason(self, shape: AttentionShape, dtype, config: AttentionConfig) -> str | None:
    """Why this schedule cannot serve this particular call (None when it can)."""
    dtype_name = np.dtype(dtype).name
    if dtype_name not in self.dtypes:
      return f"dtype {dtype_name} is not one of {sorted(self.dtypes)}"
    if shape.head_dim > self.max_head_dim:
      return f"head dim {shape.head_dim} exceeds this schedule's maximum {self.max_head_dim}"
    if config.has_bias and not self.supports_bias:
      return "a bias tensor is not supported"
    if config.has_mask and not self.supports_mask:
      return "a mask tensor is not supported"
    if config.softcap and not self.supports_softcap:
      return "softcap is not supported"
    if self.extra_check is not None:
      reason = self.extra_check(shape, config)
      if reason:
        return reason
    if config.deterministic and self.backward_determinism == "never":
      return (f"deterministic=True: the {self.name} backward adds dQ with fp32 atomics, whose "
              "order varies between runs")
    return None


def _device_compute_capability() -> tuple[int, int] | None:
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return None
  major, minor = str(capability).split(".")
  return int(major), int(minor)


# sm_90 machine code (sm_90a for v3) runs on compute capability 9.0 alone; the sm_80-instruction
# kernels also need the 227 KB of shared memory per block that only 9.0 gives among the
# architectures they are compiled for.
HOPPER = frozenset({(9, 0)})

DETERMINISM = ("always", "on_request", "never")

_REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
  if schedule.name in _REGISTRY:
    raise RuntimeError(f"schedule {schedule.name!r} registered twice")
  _REGISTRY[schedule.name] = schedule
  return schedule


def registered() -> dict[str, Schedule]:
  return dict(_REGISTRY)
