"""The v3 backward's workspace sizes, which the Python side computes without a device and the FFI
handler checks against V3BackwardWorkspaceSizes (cuda/v3_bwd_sm90.cu): a mismatch fails every
v3 gradient on the GPU, so the rule is pinned here on the CPU."""
import numpy as np
import pytest

from jax_flash._config import AttentionShape
from jax_flash.schedules import v3


# The most CTAs the backward may give a GQA group's query heads (max_kv_split) and a key block of
# its default grid (max_block_parts); each sizes the dK / dV partial slots.
@pytest.mark.parametrize("shape, split, parts", [
    # MHA: no group to split; 32 key blocks x 16 x 4 = 2048 CTAs fill the SMs: no parts.
    (AttentionShape(4, 4096, 4096, 16, 16, 128), 1, 1),
    # The example model's training step: 32 key blocks x 2 kv heads x 4 = 256 < 4 x 132 CTAs.
    (AttentionShape(4, 4096, 4096, 16, 2, 128), 4, 1),
    # A group of 6 splits over 2 CTAs at most; of 3, not at all; 3 key blocks x 2 < 132 CTAs.
    (AttentionShape(1, 300, 300, 12, 2, 128), 2, 4),
    (AttentionShape(1, 300, 300, 6, 2, 128), 1, 4),
    # Enough default CTAs (128 key blocks x 8 kv heads x 2 = 2048) to fill the SMs already.
    (AttentionShape(2, 16384, 16384, 32, 8, 128), 1, 1),
    # Head dim 256 counts 64-key blocks: 256 x 2 = 512 < 528, then 260 x 2 = 520, 264 x 2 = 528.
    (AttentionShape(1, 16384, 16384, 16, 2, 256), 4, 1),
    (AttentionShape(1, 16640, 16640, 16, 2, 256), 4, 1),
    (AttentionShape(1, 16896, 16896, 16, 2, 256), 1, 1),
    (AttentionShape(1, 1000, 1000, 8, 2, 256), 4, 4),
    # MQA: 8 key blocks.
    (AttentionShape(1, 1024, 1024, 8, 1, 64), 4, 4),
    # Parts below 132 default CTAs only: 16 x 8 = 128 and 131 CTAs, not 11 x 4 x 3 = 132.
    (AttentionShape(1, 2048, 2048, 8, 8, 128), 1, 4),
    (AttentionShape(1, 128, 128, 131, 131, 64), 1, 4),
    (AttentionShape(3, 1408, 1408, 4, 4, 128), 1, 1),
])
def test_partial_slots(shape, split, parts):
  assert v3.max_kv_split(shape) == split
  assert v3.max_block_parts(shape) == parts


@pytest.mark.parametrize("shape", [
    AttentionShape(4, 4096, 4096, 16, 2, 128),
    AttentionShape(3, 97, 1000, 8, 8, 64),
    AttentionShape(1, 1, 17, 4, 1, 256),
])
def test_backward_workspace_sizes(shape):
  dq_accum, dsum, lse_log2, semaphore, partial = v3.backward_workspaces(shape, np.float16)
  b, t, s, n, k, h = shape
  t_pad = -(-t // 128) * 128
  assert dq_accum.shape == (b, n, t_pad, h) and dq_accum.dtype == np.float32
  assert dsum.shape == lse_log2.shape == (b, n, t_pad)
  assert semaphore.shape == (b * n * t_pad // 64,) and semaphore.dtype == np.int32
  slots = max(v3.max_kv_split(shape), v3.max_block_parts(shape))
  assert partial.shape == ((2 * slots * b * s * k * h,) if slots > 1 else (1,))
