"""Autoregressive sampling with a KV cache: greedy, temperature, top-k and top-p (nucleus)."""
import contextlib
import math

import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax import sharding


def sample_token(logits, key, temperature=1.0, top_k=0, top_p=1.0):
  """Next token from logits [B, V]: greedy when temperature == 0."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, prompt, max_new_tokens, key, temperature=1.0, top_k=0, top_p=1.0):
  """Continue prompt [B, P] by max_new_tokens; returns [B, P + max_new_tokens] int32.

  The prompt is prefilled into the cache by one call (a parallel pass for the baseline, a scan
  over its tokens for ConceptLM); each later step feeds one token. Works for any model with
  `init_cache(batch, length)` and `model(tokens, cache=, cache_index=)`. Parameters placed on a
  mesh (infer.load) keep their layout; the rows and the cache then split over its batch axes.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, length = prompt.shape
  graphdef, params = nnx.split(model)
  mesh = params_mesh(params)
  cache = jax.jit(lambda: model.init_cache(batch, length + max_new_tokens),
                  out_shardings=cache_shardings(model, batch, length + max_new_tokens, mesh))()
  step = make_decode_step(graphdef, mesh, temperature, top_k, top_p)
  tokens = [prompt]
  next_token, cache = step(params, prompt, cache, 0, key)
  for i in range(max_new_tokens - 1):
    tokens.append(next_token[:, None])
    key = jax.random.fold_in(key, i)
    next_token, cache = step(params, next_token[:, None], cache, length + i, key)
  tokens.append(next_token[:, None])
  return jnp.concatenate(tokens, axis=1)


def make_decode_step(graphdef, mesh=None, temperature=1.0, top_k=0, top_p=1.0):
  """The jitted sampling step: tokens [B, n] at cache_index -> (the next token [B], the cache)."""
  def step(params, tokens, cache, index, key):
    with sharding.use_mesh(mesh) if mesh else contextlib.nullcontext():  # activations split like the rows
      out = nnx.merge(graphdef, params)(tokens, cache=cache, cache_index=index)
    return sample_token(out.logits[:, -1], key, temperature, top_k, top_p), out.cache
  return jax.jit(step)


def params_mesh(params):
  """The mesh the parameters are placed on, or None (uncommitted or single-device arrays)."""
  shardings = {getattr(x, "sharding", None) for x in jax.tree.leaves(params)}
  meshes = {s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)}
  return meshes.pop() if len(meshes) == 1 else None


def cache_shardings(model, batch, length, mesh):
  """The decoding cache's shardings on `mesh`: each array split over the batch axes along its batch
  dim (the dim that grows with the batch; ConceptLM's caches put it first or second) where the
  rows divide, else whole. None without a mesh."""
  if mesh is None:
    return None
  shapes = jax.eval_shape(lambda: model.init_cache(batch, length))
  wider = jax.eval_shape(lambda: model.init_cache(batch + 1, length))
  rows = sharding.batch_sharding(mesh).spec[0]
  splits = math.prod(mesh.shape[a] for a in rows)

  def one(x, y):
    spec = [None] * len(x.shape)
    grows = [i for i, (a, b) in enumerate(zip(x.shape, y.shape)) if a != b]
    if grows and batch % splits == 0:
      spec[grows[0]] = rows
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return jax.tree.map(one, shapes, wider)
