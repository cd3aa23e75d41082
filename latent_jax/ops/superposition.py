"""Token-Superposition Training (TST), phase 1: bags of s tokens in, the next bag out.

Pure functions of arrays (docs/tst.md has the method and the choices). Shapes: B batch,
L bags per row, s tokens per bag, so a phase-1 row holds L*s tokens; d model width.

Bags and documents: a bag belongs to the document (segment) of its *last* token. A bag
that straddles a document boundary therefore opens the new document: it attends only to
itself and the bags after it, and the bags of the next document never see the old one.
Its next-bag labels are not masked across documents (they never are in NTP either: the
EOS input's target is the next document's first token).
"""
import jax.numpy as jnp

import pallas_kernels
from latent_jax.sharding import per_batch_shard

POSITION_MODES = ("bag", "token")


def _check_divisible(length, s, what):
  if s < 1 or length % s:
    raise ValueError(f"{what} has {length} tokens per row, not a multiple of the bag size tst.s={s}.")


def superpose_embeddings(embeddings, s):
  """TST input superposition e'_j = 1/s sum_{i=js+1}^{(j+1)s} e_i: [B, L*s, d] -> [B, L, d].

  The mean is taken in float32 and returned in the input dtype.
  """
  b, t, d = embeddings.shape
  _check_divisible(t, s, "superpose_embeddings: the input")
  bags = embeddings.astype(jnp.float32).reshape(b, t // s, s, d).mean(axis=2)
  return bags.astype(embeddings.dtype)


def bag_segments(segment_ids, s):
  """Segment (document) of each bag = that of its last token: [B, L*s] -> [B, L]."""
  _check_divisible(segment_ids.shape[1], s, "bag_segments: segment_ids")
  return segment_ids[:, s - 1::s]


def bag_positions(segment_ids, positions, s, mode="bag"):
  """RoPE positions of the bags, restarting at 0 in each bag segment: [B, L*s] x2 -> [B, L].

  mode "bag":   the bag's index within its segment (0, 1, 2, ...); the attention window
                then counts bags.
  mode "token": the in-document token position of the bag's first token of that document,
                i.e. `positions` at the bag start, or 0 for a bag that opens a document
                mid-bag; the window then counts tokens, as in phase 2.
  """
  if mode not in POSITION_MODES:
    raise ValueError(f"bag_positions: mode {mode!r} is not one of {POSITION_MODES}.")
  segments = bag_segments(segment_ids, s)
  if mode == "token":
    starts_inside = segment_ids[:, ::s] == segments  # the bag's first token is in its segment
    return jnp.where(starts_inside, positions[:, ::s], 0).astype(jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(segments.shape[1], dtype=jnp.int32), segments.shape)
  first = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
  return idx - jnp.maximum.accumulate(jnp.where(first, idx, 0), axis=1)


def next_token_bags(targets, s):
  """The next s tokens at every position: targets [B, T] -> labels [B, T, s].

  labels[b, t, k] = targets[b, t + k] (= token t+k+1 of the row's window); -1 (ignored)
  past the end of the row. Ignored targets (-1, padding) stay ignored.
  """
  b, t = targets.shape
  padded = jnp.concatenate([targets, jnp.full((b, s - 1), -1, targets.dtype)], axis=1)
  return jnp.stack([padded[:, k:k + t] for k in range(s)], axis=-1)


def next_bag_targets(targets, s):
  """Labels of the next bag: targets [B, L*s] -> [B, L, s] (TST: labels shifted by s-1, bagged).

  Bag j holds tokens js..js+s-1 of the row; its labels are tokens (j+1)s..(j+1)s+s-1,
  i.e. targets[js+s-1 : js+2s-1]. The last bag of a row has only its first label (the
  row's window ends there); the others are -1. Ignored targets stay ignored.
  """
  _check_divisible(targets.shape[1], s, "next_bag_targets: targets")
  return next_token_bags(targets, s)[:, s - 1::s]


def multihot_cross_entropy(hidden, head_weight, labels, impl="auto", return_lse=False):
  """TST multi-hot CE L = 1/|y| sum_{y in bag} CE(z, y) (the constant -log|y| dropped).

  hidden [B, L, d], head_weight [d, V], labels [B, L, s] int (negative = ignored; a label
  repeated in a bag counts each time) -> per-bag loss [B, L] (0 for a bag with no label),
  and the log-sum-exp [B, L] with return_lse. The logits z = hidden @ head_weight are
  never materialised (pallas_kernels.fused_cross_entropy); s=1 is plain CE.
  """
  b, length, d = hidden.shape
  s = labels.shape[-1]
  ce = lambda rows, w: pallas_kernels.fused_cross_entropy(rows[0], w, rows[1], impl=impl, return_lse=True)
  loss, lse = per_batch_shard(ce, (hidden.reshape(b * length, d), labels.reshape(b * length, s)), head_weight)
  loss, lse = loss.reshape(b, length), lse.reshape(b, length)
  return (loss, lse) if return_lse else loss
