"""Auxiliary objectives as pure functions (docs/aux.md): NITP's latent target and loss, MTP's labels.

Rows are packed documents (latent_jax/data/pipeline.py): a position whose next token lies in
another document (a segment change, or a target < 0) has no next-token target in its document,
so neither NITP (t -> t+1) nor MTP (t -> t+2) scores it; nor do the positions past a row's end.
"""
import jax
import jax.numpy as jnp


def shift_left(x, fill):
  """x[:, t+1] at position t, `fill` at the last position: [B, T, ...] -> [B, T, ...]."""
  return jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], fill)], axis=1)


def nitp_mask(targets, segment_ids, alignment="next"):
  """Positions NITP scores [B, T] bool: scored tokens whose target z_{t+1} is in their document.

  With the t -> t ablation (alignment "same") every scored token has its own target z_t.
  """
  scored = targets >= 0
  if alignment == "same":
    return scored
  return scored & (shift_left(segment_ids, -1) == segment_ids)  # false at the last position


def nitp_target(shallow, alignment="next", stop_gradient=True):
  """NITP target: z_{t+1} = sg(shallow state at t+1) at position t (z_t with alignment "same"); [B, T, d]."""
  z = jax.lax.stop_gradient(shallow) if stop_gradient else shallow
  return z if alignment == "same" else shift_left(z, 0)


def cosine(a, b, eps=1e-8):
  """cos(a, b) over the last axis; 0 where either vector is (near) zero."""
  return jnp.sum(a * b, -1) * jax.lax.rsqrt(jnp.maximum(jnp.sum(a * a, -1) * jnp.sum(b * b, -1), eps * eps))


def nitp_error(pred, shallow, loss="cosine", alignment="next", stop_gradient=True):
  """NITP at every position: 1 - cos(P(h_t), sg(z_{t+1})), or the per-dim squared error; [B, T].

  pred [B, T, d] = P(h_t); shallow [B, T, d] the state after layer k at every position.
  """
  p = pred.astype(jnp.float32)
  z = nitp_target(shallow, alignment, stop_gradient).astype(jnp.float32)
  return 1 - cosine(p, z) if loss == "cosine" else jnp.mean(jnp.square(p - z), -1)


def nitp_loss(pred, shallow, mask, loss="cosine", alignment="next", stop_gradient=True):
  """NITP: the mean of `nitp_error` over the masked positions."""
  mask = mask.astype(jnp.float32)
  per_position = nitp_error(pred, shallow, loss, alignment, stop_gradient)
  return jnp.sum(per_position * mask) / jnp.maximum(jnp.sum(mask), 1)


def next_tokens(inputs):
  """x_{t+1} at position t, the MTP block's extra input: inputs[:, t+1] (0 past the row's end)."""
  return shift_left(inputs, 0)


def mtp_targets(targets, segment_ids):
  """MTP labels [B, T]: x_{t+2} = targets[:, t+1] at position t, -1 (ignored) where it is not
  in t's document: the last two positions, and where x_{t+1} or x_{t+2} starts another document."""
  seg1 = shift_left(segment_ids, -1)   # document of x_{t+1}
  seg2 = shift_left(seg1, -1)          # document of x_{t+2}, unknown (-1) for the last two positions
  ok = (targets >= 0) & (seg1 == segment_ids) & (seg2 == seg1)
  return jnp.where(ok, shift_left(targets, -1), -1)
