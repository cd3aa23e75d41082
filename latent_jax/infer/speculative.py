"""Greedy speculative decoding with a block drafter (latent_jax.nn.drafter), and its mean accepted length.

Each round is one drafter pass and one target pass (latent_jax.ops.drafting): the drafter
proposes K tokens after the last committed one, the target reads them in one pass, and the
round commits the agreeing prefix plus the target's own next token. The output is exactly the
target's greedy continuation, whatever the drafter proposes; a better drafter only commits more
tokens per round. The target pass reads the whole fixed-size buffer (causal attention ignores
what lies past the block), which keeps one compiled shape: the loop measures acceptance, not
latency.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.ops import drafting as D
from latent_jax.nn.drafter import draft, target_features


def write_rows(buf, values, starts, active):
  """buf [B, L] with values [B, J] written at per-row offsets starts [B], in the active rows only."""
  new = jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v, (s,)))(buf, values, starts)
  return jnp.where(active[:, None], new, buf)


def speculative_generate(target, drafter, prompt, max_new_tokens):
  """Continue prompt [B, P] greedily by max_new_tokens -> (tokens [B, P + max_new_tokens],
  committed [B] tokens committed, rounds [B] verification rounds); the MAL is their ratio (Eq. 27).

  The target passes give the drafter the concept signal it was built for (`drafter.concept`).
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  b, p = prompt.shape
  k, concept = drafter.block_size, drafter.concept
  if max_new_tokens < 1 or p < 1 or b < 1:
    raise ValueError(f"speculative decoding needs at least one prompt (got {b}) of at least one token (got {p}) and "
                     f"max_new_tokens >= 1 (got {max_new_tokens}).")
  buf = jnp.zeros((b, p + max_new_tokens + k), jnp.int32).at[:, :p].set(prompt)
  target_graph, target_params = nnx.split(target)
  drafter_graph, drafter_params = nnx.split(drafter)

  @jax.jit
  def verify(target_params, buf):  # the target's greedy token after every position, and its states
    logits, hidden, concepts = target_features(nnx.merge(target_graph, target_params), buf, concept=concept)
    return jnp.argmax(logits, -1).astype(jnp.int32), hidden, concepts

  @jax.jit
  def propose(drafter_params, target_params, hidden, concepts, buf, anchor):
    model, dr = nnx.merge(target_graph, target_params), nnx.merge(drafter_graph, drafter_params)
    logits = draft(dr, model, hidden, concepts, buf, jnp.zeros_like(buf), anchor[:, None])
    return jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

  @jax.jit
  def commit(buf, greedy, proposal, anchor, active):
    wanted, _ = D.gather_offsets(greedy, anchor[:, None], jnp.arange(k + 1))  # target's tokens a+1..a+K+1
    accepted = D.accepted_length(proposal, wanted[:, 0])
    correction = jnp.take_along_axis(wanted[:, 0], accepted[:, None], axis=1)
    buf = write_rows(buf, correction, anchor + 1 + accepted, active)
    return buf, jnp.where(active, anchor + 1 + accepted, anchor), jnp.where(active, accepted + 1, 0)

  greedy, hidden, concepts = verify(target_params, buf)
  anchor = jnp.full((b,), p, jnp.int32)  # x_p, the target's first greedy token, is committed by the prefill
  buf = buf.at[:, p].set(greedy[:, p - 1])
  committed, rounds = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)
  active = anchor - p + 1 < max_new_tokens
  while bool(jnp.any(active)):
    proposal = propose(drafter_params, target_params, hidden, concepts, buf, anchor)
    buf = write_rows(buf, proposal, anchor + 1, active)
    greedy, hidden, concepts = verify(target_params, buf)
    buf, anchor, count = commit(buf, greedy, proposal, anchor, active)
    committed, rounds = committed + count, rounds + active
    active = anchor - p + 1 < max_new_tokens
  return buf[:, :p + max_new_tokens], committed, rounds
