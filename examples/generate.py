"""Greedy generation from the example model (examples/tiny_lm.py) with a KV cache.

The model is trained briefly with train.py's loss, then generates: the prompt goes through the
model once (prefill: flash_decode appending T = prompt length rows to empty caches), and every
new token is one jitted step in which each layer appends its K/V to its cache in place (the caches
are donated) and attends over it with jax_flash.flash_decode. The model code is tiny_lm.forward,
unchanged: its `attention` argument is the cache-backed attention below, and its position table is
shifted to the step's position. At the end the cached logits are checked against an uncached
forward pass, and decode speed is reported in tokens/s.

  python examples/generate.py [--steps 200] [--batch 8] [--new-tokens 64] [--paged]

On a GPU the model runs in bfloat16 and flash_decode takes its CUDA kernels (head dim 64); on the
CPU it runs in float32 through flash_decode's gather fallback.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash.decode
import tiny_lm
import train


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200, help="training steps before generating")
  parser.add_argument("--batch", type=int, default=8, help="sequences generated at once")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--paged", action="store_true", help="a paged cache (16-row pages, shuffled)")
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args()


class CachedAttention:
  """tiny_lm.forward's `attention`: call i (layer i) appends k, v at the end of layer i's cache
  and attends to the whole cache with the new tokens aligned to its end."""

  def __init__(self, caches, lengths, block_table):
    self.caches = list(caches)
    self.lengths = lengths
    self.block_table = block_table
    self.layer = 0

  def __call__(self, q, k, v):
    k_cache, v_cache = self.caches[self.layer]
    out, k_cache, v_cache = jax_flash.decode.flash_decode(
        q, k_cache, v_cache, self.lengths, block_table=self.block_table, k_new=k, v_new=v)
    self.caches[self.layer] = (k_cache, v_cache)
    self.layer += 1
    return out


def run_cached(params, tokens, caches, lengths, block_table, config):
  """Logits of tokens [B, T] placed after `lengths` cached tokens (equal for every sequence), and
  the caches with their K/V appended."""
  position = lengths[0]
  shifted = dict(params, pos=jax.lax.dynamic_slice_in_dim(params["pos"], position, tokens.shape[1]))
  attention = CachedAttention(caches, lengths, block_table)
  logits = tiny_lm.forward(shifted, tokens, config, attention)
  return logits, tuple(attention.caches)


def empty_caches(config, batch: int, dtype, paged: bool, rng: np.random.Generator):
  """Per layer (k_cache, v_cache), and the block table (None when contiguous)."""
  kv_heads, h, length = config.num_kv_heads, config.head_dim, config.seq_len
  if paged:
    page = 16
    pages_per_sequence = length // page
    table = rng.permutation(batch * pages_per_sequence).reshape(batch, pages_per_sequence)
    shape, table = (batch * pages_per_sequence, page, kv_heads, h), jnp.asarray(table, jnp.int32)
  else:
    shape, table = (batch, length, kv_heads, h), None
  caches = tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(config.num_layers))
  return caches, table


def train_briefly(config, steps: int, seed: int):
  params = tiny_lm.init_params(config, jax.random.PRNGKey(seed))
  if steps == 0:
    return params, None
  corpus = tiny_lm.load_corpus()
  loss = train.make_loss(config, "direct")
  step, opt_state = train.make_train_step(loss, params, lr=3e-3)

  data = train.batches(corpus, 16, config.seq_len, np.random.default_rng(seed))
  for i in range(steps):
    params, opt_state, value = step(params, opt_state, next(data))
  print(f"trained {steps} steps, loss {float(value):.3f}")
  return params, corpus


def main():
  args = parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  config = tiny_lm.ModelConfig(d_model=256, num_heads=4, num_kv_heads=2, seq_len=128)
  if args.prompt_len + args.new_tokens > config.seq_len:
    raise SystemExit(f"--prompt-len + --new-tokens must be at most {config.seq_len}")
  params, corpus = train_briefly(config, args.steps, args.seed)
  params = jax.tree.map(lambda x: x.astype(dtype), params)

  rng = np.random.default_rng(args.seed)
  if corpus is None:
    prompts = rng.integers(32, 127, (args.batch, args.prompt_len))
  else:
    starts = rng.integers(0, len(corpus) - args.prompt_len, args.batch)
    prompts = np.stack([corpus[s:s + args.prompt_len] for s in starts])
  prompts = jnp.asarray(prompts, jnp.int32)
  caches, table = empty_caches(config, args.batch, dtype, args.paged, rng)
  lengths = jnp.zeros((args.batch,), jnp.int32)

  cached = functools.partial(run_cached, block_table=table, config=config)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def prefill(params, prompts, caches, lengths):
    logits, caches = cached(params, prompts, caches, lengths)
    return jnp.argmax(logits[:, -1], -1), logits[:, -1], caches, lengths + prompts.shape[1]

  @functools.partial(jax.jit, donate_argnums=(2,))
  def decode_step(params, token, caches, lengths):
    logits, caches = cached(params, token[:, None], caches, lengths)
    return jnp.argmax(logits[:, -1], -1), logits[:, -1], caches, lengths + 1

  token, logits, caches, lengths = prefill(params, prompts, caches, lengths)
  generated, step_logits = [token], [logits]
  token, logits, caches, lengths = decode_step(params, token, caches, lengths)  # compiles
  generated.append(token)
  step_logits.append(logits)
  token.block_until_ready()
  start = time.perf_counter()
  for _ in range(args.new_tokens - 2):
    token, logits, caches, lengths = decode_step(params, token, caches, lengths)
    generated.append(token)
    step_logits.append(logits)
  token.block_until_ready()
  elapsed = time.perf_counter() - start
  timed_tokens = args.batch * (args.new_tokens - 2)

  # Check: the logits of every step against one uncached forward pass over the whole text.
  text = jnp.concatenate([prompts, jnp.stack(generated[:-1], axis=1)], axis=1)
  full = tiny_lm.forward(params, text, config, tiny_lm.hand_written_attention)
  want = full[:, args.prompt_len - 1:].astype(jnp.float32)
  got = jnp.stack(step_logits, axis=1).astype(jnp.float32)
  diff = float(jnp.max(jnp.abs(got - want)))
  agree = float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(want, -1)))
  impl = jax_flash.decode.default_implementation(dtype, config.head_dim)
  print(f"jax {jax.__version__} on {jax.default_backend()}, {jnp.dtype(dtype).name}, "
        f"{'paged' if args.paged else 'contiguous'} cache, flash_decode implementation={impl}")
  print(f"cached vs uncached logits: max |diff| {diff:.3g}, greedy tokens agree on "
        f"{100 * agree:.1f}% of {got.shape[0] * got.shape[1]} positions")
  print(f"decode: {timed_tokens / elapsed:,.0f} tokens/s ({args.batch} sequences, "
        f"{elapsed / (args.new_tokens - 2) * 1e3:.2f} ms per step)")
  sample = bytes(np.asarray(text[0]).astype(np.uint8)).decode("ascii", "replace")
  print(f"sample: {sample!r}")


if __name__ == "__main__":
  main()
