"""Train a small transformer LM with jax_flash (the README's main job).

By default the model's attention is written by hand and `jax_flash.fuse` replaces it with the
fused kernel; the explain report printed first says what was fused. Runs on the CPU by default.

  python examples/train.py                      # fuse the hand-written attention (default)
  python examples/train.py --attention direct   # call jax_flash.flash_attention directly
  python examples/train.py --attention xla      # hand-written attention, unfused (baseline)

On a GPU the kernels take 16-bit inputs; a training-step comparison against cuDNN at a size
where attention matters (prints tokens/s and ms per step, compilation excluded; the numbers
measured on the H200 are in docs/perf-notes.md, tests/gpu/train_profile.py splits a step by kernel):
  python examples/train.py --dtype bfloat16 --attention direct --schedule v3 --steps 40 \
      --batch 4 --seq-len 4096 --d-model 2048 --heads 16 --layers 1 --lr 3e-4
  python examples/train.py ... --attention cudnn
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_flash
import tiny_lm


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
  """The model's and the batch's sizes (tests/gpu/train_profile.py takes them too)."""
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--attention", choices=("fuse", "direct", "xla", "cudnn"), default="fuse")
  parser.add_argument("--schedule", default="auto", help="jax_flash schedule (fuse, direct)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="compute dtype (GPU schedules: bfloat16 or float16)")
  parser.add_argument("--steps", type=int, default=300)
  add_shape_arguments(parser)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--log-every", type=int, default=25)
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args()


def make_loss(config, attention: str, schedule: str = "auto"):
  if attention == "direct":
    direct = functools.partial(tiny_lm.direct_attention, schedule=schedule)
    return functools.partial(tiny_lm.loss_fn, config=config, attention=direct)
  if attention == "cudnn":
    return functools.partial(tiny_lm.loss_fn, config=config, attention=tiny_lm.cudnn_attention)
  plain = functools.partial(tiny_lm.loss_fn, config=config)
  return jax_flash.fuse(plain, schedule=schedule) if attention == "fuse" else plain


def make_train_step(loss, params, lr: float):
  """(jitted step(params, opt_state, tokens) -> (params, opt_state, loss), initial opt_state)."""
  optimizer = optax.adamw(lr, weight_decay=0.01)

  @jax.jit
  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, optimizer.init(params)


def batches(corpus: np.ndarray, batch: int, length: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(corpus) - length - 1, batch)
    yield jnp.asarray(np.stack([corpus[s:s + length + 1] for s in starts]))


def main():
  args = parse_args()
  config = tiny_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers,
                               seq_len=args.seq_len, num_heads=args.heads,
                               num_kv_heads=args.kv_heads, dtype=args.dtype)
  corpus = tiny_lm.load_corpus()
  print(f"jax {jax.__version__} on {jax.default_backend()}; corpus {len(corpus):,} bytes; "
        f"schedules available: {[s.name for s in jax_flash.schedules() if s.available]}")
  params = tiny_lm.init_params(config, jax.random.PRNGKey(args.seed))
  loss = make_loss(config, args.attention, args.schedule)
  data = batches(corpus, args.batch, args.seq_len, np.random.default_rng(args.seed))
  if args.attention == "fuse":
    print(jax_flash.explain(loss, params, next(data)))

  step, opt_state = make_train_step(loss, params, args.lr)

  first = last = None
  tokens_seen, start = 0, None
  for i in range(1, args.steps + 1):
    params, opt_state, value = step(params, opt_state, next(data))
    if i == 1:
      value.block_until_ready()
      start = time.perf_counter()   # exclude compilation from the speed report
      first = float(value)
    else:
      tokens_seen += args.batch * args.seq_len
    if i % args.log_every == 0 or i == args.steps:
      last = float(value)
      elapsed = time.perf_counter() - start
      print(f"step {i:5d}  loss {last:.4f}  {tokens_seen / max(elapsed, 1e-9):,.0f} tokens/s",
            flush=True)
  elapsed = time.perf_counter() - start
  print(f"done: {args.steps} steps, loss {first:.4f} -> {last:.4f} "
        f"({'decreased' if last < first else 'DID NOT DECREASE'}), "
        f"{tokens_seen / elapsed:,.0f} tokens/s, {1e3 * elapsed / (args.steps - 1):.2f} ms/step, "
        f"attention={args.attention} schedule={args.schedule} dtype={args.dtype}")


if __name__ == "__main__":
  main()
