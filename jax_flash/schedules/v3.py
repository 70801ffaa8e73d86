"""The v3 schedule: the Hopper (sm_90a) forward kernel of cuda/v3_fwd_sm90.cu.

TMA loads into a multi-stage shared-memory ring, wgmma for QK^T and PV, a producer warpgroup
and register-reallocated consumer warpgroups (pingpong between them), a persistent grid.

Envelope: bfloat16 / float16, head dims 64, 128 and 256 (others go to v2 through the dispatch
order), causal, sliding window, GQA / MQA, q / kv sequence lengths, softcap. Bias and mask
tensors are declared unsupported here, so the dispatch sends those calls to v2.

Backward: v3 has no backward kernel of its own yet. Its backward target is the v2 backward,
`jax_flash_v2_bwd`, which follows the same convention and recomputes from q, k, v and the
forward's out and lse, so gradients of a v3 forward are computed by the v2 kernel.
"""
from __future__ import annotations

from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules import v2
from jax_flash.schedules.base import HOPPER, Schedule, register

HEAD_DIMS = (64, 128, 256)


def _envelope(shape: AttentionShape, config: AttentionConfig) -> str | None:
  if shape.head_dim not in HEAD_DIMS:
    return f"head dim {shape.head_dim} is not one of {HEAD_DIMS}"
  if not config.scale > 0:
    return "scale must be > 0"
  if shape.kv_len < 1:
    return "needs at least one key"
  return None


V3 = register(Schedule(
    name="v3",
    description="Hopper forward: TMA + wgmma, warp-specialized pingpong, persistent grid "
                "(backward: v2)",
    platform="gpu",
    forward_target="jax_flash_v3_fwd",
    backward_target=v2.V2.backward_target,
    backward_workspaces=v2.backward_workspaces,
    dtypes=frozenset({"bfloat16", "float16"}),
    max_head_dim=256,
    supports_bias=False,
    supports_mask=False,
    supports_softcap=True,
    compute_capabilities=HOPPER,
    extra_check=_envelope,
))
