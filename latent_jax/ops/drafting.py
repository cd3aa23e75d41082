"""Block-parallel speculative drafting with a concept signal (NCP Sec. 5.3, Eq. 26-27), as pure functions.

A round: the target has committed x_0..x_a and knows its hidden states at positions < a (x_a,
its own last greedy token, it has not read yet). The drafter reads those states and x_a and
proposes x_{a+1..a+K} in one parallel pass; the target reads the block in one pass, keeps the
longest prefix that equals its own greedy tokens and adds its next token (the correction, or
the bonus token when all K agree). The committed tokens are exactly the target's greedy ones.
"""
import jax
import jax.numpy as jnp

from latent_jax.ops import transformer as T


def gather_offsets(x, anchors, offsets):
  """x [B, T, ...] at positions anchors[b, i] + offsets[j] -> ([B, A, J, ...], in-range mask [B, A, J])."""
  idx = anchors[..., None] + offsets
  inside = (idx >= 0) & (idx < x.shape[1])
  return jax.vmap(lambda row, i: row[i])(x, jnp.clip(idx, 0, x.shape[1] - 1)), inside


def in_document(segment_ids, anchors, offsets):
  """[B, A, J]: position anchor + offset lies in the row and in the anchor's document."""
  segs, inside = gather_offsets(segment_ids, anchors, offsets)
  anchor_seg, _ = gather_offsets(segment_ids, anchors, jnp.zeros((1,), jnp.int32))
  return inside & (segs == anchor_seg)


def draft_context(hidden, segment_ids, anchors, window):
  """The target states a drafter reads at anchor a: positions a-window .. a-1 of the anchor's document.

  hidden [B, T, d], segment_ids [B, T], anchors [B, A] -> (context [B, A, W, d], valid [B, A, W]).
  """
  offsets = jnp.arange(-window, 0)
  return gather_offsets(hidden, anchors, offsets)[0], in_document(segment_ids, anchors, offsets)


def draft_labels(tokens, segment_ids, anchors, block_size):
  """What the drafter should propose at anchor a: x_{a+1..a+K} [B, A, K], -1 past the row or the document."""
  offsets = jnp.arange(1, block_size + 1)
  return jnp.where(in_document(segment_ids, anchors, offsets), gather_offsets(tokens, anchors, offsets)[0], -1)


def row_anchors(tokens, count, seed):
  """`count` anchors a row [B, count], uniform in [1, T), from a key of `seed` and the row's own tokens
  [B, T]: a row gets the same anchors whichever batch, microbatch or host holds it."""
  t = tokens.shape[1]
  odd = jnp.arange(1, 2 * t, 2, dtype=jnp.uint32)  # position-weighted, so that reordered tokens differ
  digest = jnp.sum(tokens.astype(jnp.uint32) * odd, axis=1)  # wraps modulo 2^32
  draw = lambda d: jax.random.randint(jax.random.fold_in(jax.random.key(seed), d), (count,), 1, t)
  return jax.vmap(draw)(digest)


def strided_anchors(batch, seq_len, count):
  """About `count` anchors a row at a fixed stride from position 1 [batch, ~count]: evaluation's."""
  positions = jnp.arange(1, seq_len, max(1, (seq_len - 1) // count))
  return jnp.broadcast_to(positions, (batch, len(positions)))


def concept_gate(states, concept, gate, scale, eps):
  """Eq. 26: s~_j = s_j + tanh(g) * RMSNorm(c) for every draft position j; states [N, K, d], concept [N, d].

  A zero concept (no complete chunk yet) adds nothing; a zero gate g (the init) is the baseline drafter.
  """
  return states + (jnp.tanh(gate) * T.rms_norm(concept, scale, eps)).astype(states.dtype)[:, None, :]


def accepted_length(draft, greedy):
  """Draft tokens the target accepts under exact-match verification: the length of the longest
  prefix of draft [N, K] equal to the target's greedy tokens greedy [N, >= K]."""
  agree = draft == greedy[:, :draft.shape[1]]
  return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)


def mean_accepted_length(committed, rounds):
  """Eq. 27: MAL = (1/R) sum_r c_r, c_r the tokens round r commits (accepted drafts + the target's
  correction or bonus token); committed and rounds summed per sequence, then pooled over sequences."""
  return jnp.sum(committed) / jnp.maximum(jnp.sum(rounds), 1)
