"""One peer on one case, ready to time: the compiled call, how to wait for it, and its check run.

Mode fwd (and decode): the attention output. Mode fwdbwd: forward and backward in one call,
(dq, dk, dv) = vjp(attention)(dout) in JAX, torch.autograd.grad(out, (q, k, v), dout) in torch.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.bench.configs import Case
from jax_flash.bench.peers import Peer


@dataclasses.dataclass
class Prepared:
  peer: Peer
  call: Callable[[int], Any]            # launch the call on input set i (asynchronously)
  wait: Callable[[Any], None]           # block until that call, and all before it, finished
  check: Callable[[], tuple]            # the outputs on the check set
  to_numpy: Callable[[Any, tuple], np.ndarray]  # float32 copy of output[index]
  hlo_text: Callable[[], str] | None    # the compiled HLO (JAX only)

  def run_once(self) -> None:
    self.wait(self.call(0))


def _as_tuple(outputs) -> tuple:
  return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def prepare(peer: Peer, case: Case, sets: list[tuple], check_set: tuple) -> Prepared:
  """Build, compile and run the peer once (raising if it cannot serve the case)."""
  build = _prepare_torch if peer.framework == "torch" else _prepare_jax
  prepared = build(peer, case, sets, check_set)
  prepared.run_once()
  return prepared


# -- jax ---------------------------------------------------------------------------------------

def jax_step(peer: Peer, case: Case) -> Callable:
  attend = functools.partial(peer.attend, case=case)
  if case.mode != "fwdbwd":
    return jax.jit(attend)

  def forward_backward(q, k, v, dout):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(dout)
  return jax.jit(forward_backward)


def jax_to_numpy(x, index: tuple) -> np.ndarray:
  """float32 host copy of x[index]."""
  return np.asarray(jnp.asarray(x[index], jnp.float32))


def _prepare_jax(peer: Peer, case: Case, sets: list[tuple], check_set: tuple) -> Prepared:
  step = jax_step(peer, case)
  return Prepared(
      peer=peer,
      call=lambda i: step(*sets[i % len(sets)]),
      wait=jax.block_until_ready,
      check=lambda: _as_tuple(jax.block_until_ready(step(*check_set))),
      to_numpy=jax_to_numpy,
      hlo_text=lambda: step.lower(*sets[0]).compile().as_text())


# -- torch -------------------------------------------------------------------------------------

def _torch_inputs(arrays: tuple, case: Case) -> tuple:
  """The same device buffers seen by torch (DLPack, no copy); q, k, v require grad in fwdbwd."""
  import torch  # pylint: disable=import-outside-toplevel
  tensors = [torch.from_dlpack(x) for x in arrays]
  if case.mode == "fwdbwd":
    tensors[:3] = [t.detach().requires_grad_(True) for t in tensors[:3]]
  return tuple(tensors)


def torch_step(peer: Peer, case: Case) -> Callable:
  import torch  # pylint: disable=import-outside-toplevel
  if case.mode == "fwdbwd":
    def forward_backward(q, k, v, dout):
      out = peer.attend(q, k, v, case)
      return torch.autograd.grad(out, (q, k, v), dout)
    return forward_backward

  def forward(q, k, v):
    with torch.no_grad():
      return peer.attend(q, k, v, case)
  return forward


def _torch_to_numpy(x, index: tuple) -> np.ndarray:
  return x[index].detach().float().cpu().numpy()


def _prepare_torch(peer: Peer, case: Case, sets: list[tuple], check_set: tuple) -> Prepared:
  import torch  # pylint: disable=import-outside-toplevel
  step = torch_step(peer, case)
  torch_sets = [_torch_inputs(s, case) for s in sets]
  torch_check = _torch_inputs(check_set, case)

  def check():
    outputs = _as_tuple(step(*torch_check))
    torch.cuda.synchronize()
    return outputs

  return Prepared(
      peer=peer,
      call=lambda i: step(*torch_sets[i % len(torch_sets)]),
      wait=lambda _: torch.cuda.synchronize(),
      check=check,
      to_numpy=_torch_to_numpy,
      hlo_text=None)


def failure_status(error: BaseException) -> str:
  """'unsupported' when the implementation declined the case, 'failed' when it broke."""
  if isinstance(error, (ValueError, NotImplementedError)):
    return "unsupported"
  if "No available kernel" in str(error):  # torch SDPA with no backend for the inputs
    return "unsupported"
  return "failed"
