"""One attention call (forward, or forward + backward by vjp) through jax, for ncu to profile.

  ncu --clock-control none --kernel-name regex:bprop --launch-count 1 --section LaunchStats \
      python3 tests/gpu/ncu_probe.py cudnn bwd 4 4096 16 2 128 1

Arguments: implementation (v3: jax_flash.flash_attention(schedule="v3"); cudnn:
jax.nn.dot_product_attention(implementation="cudnn")), mode (fwd | bwd), then B T N K H causal.
bf16 random inputs; two calls, so that ncu's --launch-count 1 after a --launch-skip can take the
warm one. Session 8's launch facts of cuDNN's kernels (docs/perf-notes-v3.md) came from this.
"""
import sys

import jax
import jax.numpy as jnp


def main() -> int:
  impl, mode = sys.argv[1], sys.argv[2]
  batch, seq, heads, kv_heads, head_dim, causal = (int(a) for a in sys.argv[3:9])
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
  dout = jax.random.normal(keys[3], (batch, seq, heads, head_dim), jnp.bfloat16)

  def attention(q, k, v):
    if impl == "v3":
      import jax_flash  # after jax (docs: importing the extension first segfaulted with jax 0.11)
      return jax_flash.flash_attention(q, k, v, is_causal=bool(causal), schedule="v3")
    return jax.nn.dot_product_attention(q, k, v, is_causal=bool(causal), implementation="cudnn")

  @jax.jit
  def run(q, k, v, dout):
    if mode == "fwd":
      return attention(q, k, v)
    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(dout)

  for _ in range(2):
    jax.block_until_ready(run(q, k, v, dout))
  return 0


if __name__ == "__main__":
  sys.exit(main())
