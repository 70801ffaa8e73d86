"""The jaxpr rewrite pass: find hand-written attention in a function and run it fused.

  fused = jax_flash.fuse(fn)                 # same signature; attention -> flash_attention
  print(jax_flash.explain(fn, *args))        # what was found, what was fused, and why not

See docs/rewrite.md for what is recognized and the safety rules.
"""
from jax_flash.rewrite.api import explain, fuse
from jax_flash.rewrite.report import Report, SiteReport

__all__ = ["fuse", "explain", "Report", "SiteReport"]
