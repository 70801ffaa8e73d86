"""jax_flash: FlashAttention for JAX.

  jax_flash.flash_attention(q, k, v, ...)   drop-in for jax.nn.dot_product_attention
  jax_flash.schedules()                     which kernels can run here, and why others cannot
  jax_flash.flash_decode(q, k_cache, v_cache, cache_seqlens, ...)   split-KV decoding
  jax_flash.ring_attention(q, k, v, axis_name=...)   context parallelism inside shard_map
  jax_flash.fuse(fn) / jax_flash.explain(fn, *args)  hand-written attention -> fused kernel
  jax_flash.flax                            linen / nnx attention_fn and modules
"""
import jax  # noqa: F401  (must be imported before the compiled extension; see _extension.py)

from jax_flash import schedules as _schedule_modules  # noqa: F401  (registers the schedules)
from jax_flash._dispatch import ScheduleStatus, schedules
from jax_flash.api import flash_attention
from jax_flash.decode import flash_decode
from jax_flash.ring import ring_attention
from jax_flash.rewrite import explain, fuse

__version__ = "0.1.0"

__all__ = ["flash_attention", "flash_decode", "ring_attention", "fuse", "explain", "schedules",
           "ScheduleStatus", "__version__"]
