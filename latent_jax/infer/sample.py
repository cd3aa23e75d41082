"""Autoregressive sampling with a KV cache: greedy, temperature, top-k and top-p (nucleus)."""
import jax
import jax.numpy as jnp
from flax import nnx


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
  `init_cache(batch, length)` and `model(tokens, cache=, cache_index=)`.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, length = prompt.shape
  graphdef, params = nnx.split(model)
  cache = model.init_cache(batch, length + max_new_tokens)

  @jax.jit
  def step(params, tokens, cache, index, key):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, cache_index=index)
    return sample_token(out.logits[:, -1], key, temperature, top_k, top_p), out.cache

  tokens = [prompt]
  next_token, cache = step(params, prompt, cache, 0, key)
  for i in range(max_new_tokens - 1):
    tokens.append(next_token[:, None])
    key = jax.random.fold_in(key, i)
    next_token, cache = step(params, next_token[:, None], cache, length + i, key)
  tokens.append(next_token[:, None])
  return jnp.concatenate(tokens, axis=1)
