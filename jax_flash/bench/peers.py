"""The implementations compared: each a name, a framework, and an attention callable.

Every callable takes (q [B,T,N,H], k [B,S,K,H], v [B,S,K,H], case) in its framework's arrays and
returns the output [B,T,N,H]; `steps.py` wraps it into the timed forward / forward+backward call.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench.configs import MODES, Case


@dataclasses.dataclass(frozen=True)
class Peer:
  name: str
  framework: str            # "jax" or "torch"
  description: str
  attend: Callable
  modes: tuple = MODES
  ours: bool = False        # a jax_flash implementation (the others are the peers it is held to)


# -- jax ---------------------------------------------------------------------------------------

def _flash(schedule: str) -> Callable:
  def attend(q, k, v, case: Case):
    return jax_flash.flash_attention(q, k, v, is_causal=case.causal, schedule=schedule)
  return attend


def _jax_nn(implementation: str) -> Callable:
  def attend(q, k, v, case: Case):
    return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                        implementation=implementation)
  return attend


def _flash_decode(flash_decode: Callable) -> Callable:
  def attend(q, k, v, case: Case):
    cache_seqlens = jnp.full((case.batch,), case.kv_len, jnp.int32)
    out = flash_decode(q, k, v, cache_seqlens)
    return out.reshape(q.shape)  # [B, N, H] or [B, 1, N, H]: the same elements
  return attend


def jax_peers(backend: str) -> tuple[list[Peer], list[str]]:
  """(peers, notes): every available jax_flash schedule, 'auto', XLA, cuDNN on the GPU, and
  flash_decode in decode mode; the notes say what is left out and why."""
  peers, notes = [], []
  for status in jax_flash.schedules():
    if status.available:
      peers.append(Peer(status.name, "jax", f"jax_flash.flash_attention(schedule={status.name!r})",
                        _flash(status.name), ours=True))
    else:
      notes.append(f"schedule {status.name}: {status.reason}")
  peers.append(Peer("auto", "jax", "jax_flash.flash_attention(schedule='auto')", _flash("auto"),
                    ours=True))
  try:
    from jax_flash.decode import flash_decode  # pylint: disable=import-outside-toplevel
    peers.append(Peer("flash_decode", "jax", "jax_flash.decode.flash_decode",
                      _flash_decode(flash_decode), modes=("decode",), ours=True))
  except ImportError as e:
    notes.append(f"flash_decode: not importable ({e})")
  peers.append(Peer("xla", "jax", 'jax.nn.dot_product_attention(implementation="xla")',
                    _jax_nn("xla")))
  if backend == "gpu":
    peers.append(Peer("cudnn", "jax", 'jax.nn.dot_product_attention(implementation="cudnn")',
                      _jax_nn("cudnn")))
  return peers, notes


# -- torch -------------------------------------------------------------------------------------

def _torch_sdpa(backend_name: str) -> Callable:
  def attend(q, k, v, case: Case):
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
    from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel
    extra = {"enable_gqa": True} if case.num_heads != case.num_kv_heads else {}
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
      out = F.scaled_dot_product_attention(  # SDPA's layout is [B, N, T, H]: views, no copies
          q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=case.causal, **extra)
    return out.transpose(1, 2)
  return attend


_TORCH_BACKENDS = {"torch_flash": ("FLASH_ATTENTION", "FlashAttention-2"),
                   "torch_cudnn": ("CUDNN_ATTENTION", "cuDNN")}


def torch_peers(backend: str) -> tuple[list[Peer], list[str]]:
  """PyTorch SDPA's FlashAttention-2 and cuDNN backends, on the GPU when torch can use it."""
  if backend != "gpu":
    return [], []
  try:
    import torch  # pylint: disable=import-outside-toplevel
    from torch.nn.attention import SDPBackend  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return [], [f"torch peers: torch not importable ({e})"]
  if not torch.cuda.is_available():
    return [], ["torch peers: torch sees no CUDA device"]
  chosen, notes = [], []
  for name, (member, what) in _TORCH_BACKENDS.items():
    if hasattr(SDPBackend, member):
      chosen.append(Peer(name, "torch", f"torch {torch.__version__} SDPA, SDPBackend.{member} "
                         f"({what})", _torch_sdpa(member)))
    else:
      notes.append(f"{name}: torch {torch.__version__} has no SDPBackend.{member}")
  return chosen, notes


def all_peers(backend: str, include_torch: bool = True) -> tuple[list[Peer], list[str]]:
  peers, notes = jax_peers(backend)
  if include_torch:
    more, more_notes = torch_peers(backend)
    peers, notes = peers + more, notes + more_notes
  return peers, notes


def select(peers: list[Peer], names: list[str] | None) -> tuple[list[Peer], list[str]]:
  """(the peers named by --impl, in the order of `peers`; notes on names not available here).
  ValueError when none of the names is available."""
  if not names:
    return peers, []
  known = {p.name for p in peers}
  notes = [f"--impl {n}: not available here (available: {sorted(known)})"
           for n in names if n not in known]
  chosen = [p for p in peers if p.name in names]
  if not chosen:
    raise ValueError(f"--impl: none of {names} is available here; available: {sorted(known)}")
  return chosen, notes
