"""A small character-level transformer LM whose attention is written out by hand.

`attention="fuse"` leaves the hand-written softmax(QKᵀ)V in the model and lets
`jax_flash.fuse` swap in the fused kernel; "direct" calls `jax_flash.flash_attention`;
"xla" runs the hand-written attention unfused; "cudnn" calls jax.nn.dot_product_attention's
cuDNN kernel (GPU). The corpus is the docstrings of Python's standard library, so the example
needs no download. Parameters are float32; `ModelConfig.dtype` is the compute dtype (bfloat16
for the GPU schedules, which take 16-bit inputs like cuDNN).
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab: int = 128          # bytes < 128 (ASCII); others map to '?'
  d_model: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2     # grouped-query attention
  num_layers: int = 2
  seq_len: int = 128
  dtype: str = "float32"    # compute dtype of the activations (parameters stay float32)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def load_corpus(max_bytes: int = 2_000_000) -> np.ndarray:
  """ASCII bytes of the docstrings of the standard library's top-level modules."""
  texts, size = [], 0
  skip = {"this", "antigravity", "idlelib", "tkinter", "turtle", "turtledemo"}
  for name in sorted(sys.stdlib_module_names):
    if name.startswith("_") or name in skip:
      continue
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = importlib.import_module(name).__doc__ or ""
    except Exception:  # a module that cannot be imported here contributes nothing
      continue
    texts.append(doc)
    size += len(doc)
    if size >= max_bytes:
      break
  data = np.frombuffer("\n".join(texts).encode("ascii", "replace"), np.uint8)
  return np.minimum(data, 127).astype(np.int32)


def init_params(config: ModelConfig, key) -> dict:
  d, h = config.d_model, config.head_dim
  keys = iter(jax.random.split(key, 2 + 5 * config.num_layers))  # embed, pos; 5 per layer

  def dense(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

  layers = [dict(
      ln1=jnp.ones(d), ln2=jnp.ones(d),
      wq=dense((d, config.num_heads * h), d),
      wkv=dense((d, 2 * config.num_kv_heads * h), d),
      wo=dense((config.num_heads * h, d), d),
      w1=dense((d, 4 * d), d), w2=dense((4 * d, d), 4 * d),
  ) for _ in range(config.num_layers)]
  return dict(embed=dense((config.vocab, d), d), pos=dense((config.seq_len, d), 1.0) * 0.1,
              layers=layers, ln_f=jnp.ones(d))


def hand_written_attention(q, k, v):
  """softmax(QKᵀ/√H + causal mask) V, as a model author would write it (BTNH, GQA by repeat)."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  t = q.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def direct_attention(q, k, v, schedule: str = "auto"):
  return jax_flash.flash_attention(q, k, v, is_causal=True, schedule=schedule)


def cudnn_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _rms_norm(x, weight):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight


def forward(params, tokens, config: ModelConfig, attention=hand_written_attention):
  """Logits [B, T, vocab] for tokens [B, T]."""
  b, t = tokens.shape
  h = config.head_dim
  params = jax.tree.map(lambda w: w.astype(config.dtype), params)
  # A one-hot product rather than a gather: the gather's gradient is a scatter-add of B x T rows
  # into vocab (256) rows, which XLA runs on the GPU as contended atomics (3.1 ms of a 11.7 ms
  # step at B=4, T=4096, d_model=2048); the product's gradient is one small matmul.
  x = jax.nn.one_hot(tokens, config.vocab, dtype=config.dtype) @ params["embed"]
  x = x + params["pos"][:t]
  for layer in params["layers"]:
    y = _rms_norm(x, layer["ln1"])
    q = (y @ layer["wq"]).reshape(b, t, config.num_heads, h)
    k, v = jnp.split((y @ layer["wkv"]).reshape(b, t, 2 * config.num_kv_heads, h), 2, axis=2)
    x = x + attention(q, k, v).reshape(b, t, -1) @ layer["wo"]
    y = _rms_norm(x, layer["ln2"])
    x = x + jax.nn.gelu(y @ layer["w1"]) @ layer["w2"]
  return _rms_norm(x, params["ln_f"]) @ params["embed"].T


def loss_fn(params, tokens, config: ModelConfig, attention=hand_written_attention):
  logits = forward(params, tokens[:, :-1], config, attention).astype(jnp.float32)
  targets = tokens[:, 1:]
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
