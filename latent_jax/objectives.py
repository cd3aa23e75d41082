"""The training objective: a weighted sum of loss terms, each a pure function, each logged.

`loss` in the metrics is always the per-token next-token cross-entropy (the LM loss), so runs
with and without auxiliary terms compare on the same number.
"""
import jax.numpy as jnp

import pallas_kernels


def token_cross_entropy(hidden, head_weight, targets, impl):
  """Per-token CE and log-sum-exp of the LM head's logits without materialising them all.

  hidden [B, T, d], head_weight [d, V], targets [B, T] (negative = ignored) -> ([B, T], [B, T]).
  """
  b, t, d = hidden.shape
  loss, lse = pallas_kernels.fused_cross_entropy(
      hidden.reshape(b * t, d), head_weight, targets.reshape(b * t, 1), impl=impl, return_lse=True)
  return loss.reshape(b, t), lse.reshape(b, t)


def masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1)


def z_loss(lse, mask):
  """z-loss: mean of log(Z)^2 over scored tokens (keeps the softmax normaliser near 1)."""
  return masked_mean(jnp.square(lse), mask)


def lm_objective(model, batch, cfg):
  """NTP (+ z-loss) for the baseline. Returns (total loss, metrics dict)."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
  mask = (batch["targets"] >= 0).astype(jnp.float32)
  ce, lse = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                                batch["targets"], cfg.kernels.impl)
  loss = masked_mean(ce, mask)
  metrics = {"loss": loss}
  total = loss
  if cfg.train.z_loss:
    metrics["z_loss"] = z_loss(lse, mask)
    total = total + cfg.train.z_loss * metrics["z_loss"]
  metrics["total_loss"] = total
  return total, metrics


def eval_sums(model, batch, cfg):
  """Summed NLL and count of scored tokens for one validation batch (for loss and bits/byte)."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
  ce, _ = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                              batch["targets"], cfg.kernels.impl)
  mask = batch["targets"] >= 0
  return jnp.sum(jnp.where(mask, ce, 0.0)), jnp.sum(mask)


def objective_for(cfg):
  """The training objective for the configured model: (model, batch, cfg) -> (total, metrics)."""
  return lm_objective
