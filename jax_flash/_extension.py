"""Loads the compiled extension `jax_flash._jax_flash_ext` and registers its XLA FFI targets.

  register_targets()              register every target with XLA (idempotent; done on import)
  available_targets(platform)     names of the registered targets for a platform
  has_cuda()                      whether the extension was built with the CUDA kernels

Platform spelling: `available_targets` takes a JAX backend name as `jax.default_backend()`
returns it ("cpu", "gpu") or the XLA platform name ("cuda", "CUDA"); "gpu" and "cuda" both mean
the CUDA targets. The extension itself labels targets "cpu" or "CUDA", which is what
`jax.ffi.register_ffi_target(..., platform=...)` expects.
"""
from __future__ import annotations

import glob
import os
import sys
import threading

import jax  # noqa: F401  (must be imported before the extension: it loads the XLA runtime)

_BUILD_HINT = (
    "Build it with `pip install .` (or `pip install --no-build-isolation -e .`) from the "
    "jax_flash source tree; a C++17 compiler and CMake >= 3.24 are needed, and nvcc on PATH "
    "for the CUDA kernels.")


def _load_extension():
  try:
    from jax_flash import _jax_flash_ext
    return _jax_flash_ext
  except ImportError as error:
    first_error = error
  # A source checkout first on sys.path (`python -m pytest` from the repository root) shadows
  # the installed package, and only the installed copy holds the compiled module: let the
  # package also search installed jax_flash directories for it.
  package = sys.modules["jax_flash"]
  here = os.path.dirname(os.path.abspath(__file__))
  for entry in sys.path:
    candidate = os.path.abspath(os.path.join(entry or os.getcwd(), "jax_flash"))
    if candidate == here or not glob.glob(os.path.join(candidate, "_jax_flash_ext*")):
      continue
    package.__path__.append(candidate)
    try:
      from jax_flash import _jax_flash_ext
      return _jax_flash_ext
    except ImportError:
      package.__path__.remove(candidate)
  raise ImportError(
      "jax_flash's compiled extension (jax_flash._jax_flash_ext) is missing or failed to load: "
      f"{first_error}. {_BUILD_HINT}") from first_error


_ext = _load_extension()

# XLA platform names of the extension -> the spellings callers may use for them.
_PLATFORM_ALIASES = {
    "cpu": "cpu", "host": "cpu",
    "gpu": "CUDA", "cuda": "CUDA",
}

_lock = threading.Lock()
_registered: dict[str, frozenset[str]] | None = None


def _xla_platform(platform: str) -> str:
  try:
    return _PLATFORM_ALIASES[platform.lower()]
  except KeyError:
    raise ValueError(f"platform must be one of {sorted(_PLATFORM_ALIASES)}, got {platform!r}") from None


def register_targets() -> None:
  """Registers every FFI target of the extension with XLA (api_version 1, typed FFI).

  Safe to call any number of times: the registration happens once per process.
  """
  global _registered
  with _lock:
    if _registered is not None:
      return
    by_platform: dict[str, set[str]] = {}
    for name, (platform, capsule) in _ext.targets().items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform, api_version=1)
      by_platform.setdefault(platform, set()).add(name)
    _registered = {p: frozenset(names) for p, names in by_platform.items()}


def available_targets(platform: str) -> frozenset[str]:
  """Names of the FFI targets registered for `platform` ("cpu", "gpu" or "cuda")."""
  register_targets()
  assert _registered is not None
  return _registered.get(_xla_platform(platform), frozenset())


def has_cuda() -> bool:
  """Whether the extension was built with the CUDA kernels (nvcc was found at build time)."""
  return bool(_ext.has_cuda())


register_targets()
