"""The training objective: a weighted sum of loss terms, each a pure function, each logged.

`loss` in the metrics is always the per-token next-token cross-entropy (the LM loss), so runs
with and without auxiliary terms compare on the same number. (TST phase 1 trains on bags, so
its `loss` is the multi-hot bag CE; `val_loss` is per-token NTP in every phase.)
"""
import jax.numpy as jnp

import pallas_kernels
from latent_jax.config import mtp_enabled, nitp_enabled
from latent_jax.ops import auxiliary as A
from latent_jax.ops import concepts as C
from latent_jax.ops import superposition as sup
from latent_jax.train import sharding


def token_cross_entropy(hidden, head_weight, targets, impl):
  """Per-token CE and log-sum-exp of the LM head's logits without materialising them all.

  hidden [B, T, d], head_weight [d, V], targets [B, T] (negative = ignored) -> ([B, T], [B, T]).
  """
  b, t, d = hidden.shape
  ce = lambda rows, w: pallas_kernels.fused_cross_entropy(rows[0], w, rows[1], impl=impl, return_lse=True)
  loss, lse = sharding.per_batch_shard(ce, (hidden.reshape(b * t, d), targets.reshape(b * t, 1)), head_weight)
  return loss.reshape(b, t), lse.reshape(b, t)


def masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1)


def z_loss(lse, mask):
  """z-loss: mean of log(Z)^2 over scored tokens (keeps the softmax normaliser near 1)."""
  return masked_mean(jnp.square(lse), mask)


def ntp_terms(model, out, batch, cfg):
  """NTP (+ z-loss) of a forward pass `out`. Returns (loss so far, metrics dict)."""
  mask = (batch["targets"] >= 0).astype(jnp.float32)
  ce, lse = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                                batch["targets"], cfg.kernels.impl)
  loss = masked_mean(ce, mask)
  metrics = {"loss": loss}
  total = loss
  if cfg.train.z_loss:
    metrics["z_loss"] = z_loss(lse, mask)
    total = total + cfg.train.z_loss * metrics["z_loss"]
  return total, metrics


def auxiliary_terms(model, out, batch, cfg, mtp=True):
  """NITP and MTP terms of a forward pass `out` (docs/aux.md), for either model.

  Returns (their weighted sum, metrics with `nitp_loss` / `mtp_loss`); (0, {}) when both are off.
  `mtp=False` leaves MTP out (TST's bag phase, where it has no meaning).
  """
  total, metrics = 0.0, {}
  if nitp_enabled(cfg):  # L_NITP = 1 - cos(P(h_t), sg(z_{t+1})), z = state after layer k
    n = cfg.nitp
    h = out.hidden if n.source == "final_norm" else out.aux["pre_norm"]
    pred = model.nitp_projector(h) if n.projector else h
    mask = A.nitp_mask(batch["targets"], batch["segment_ids"], n.alignment)
    metrics["nitp_loss"] = A.nitp_loss(pred, out.aux["nitp_target_state"], mask, n.loss, n.alignment,
                                       n.stop_gradient)
    total = total + n.weight * metrics["nitp_loss"]
  if mtp and mtp_enabled(cfg):  # CE of x_{t+2} from MTPBlock(h_t, Emb(x_{t+1})) through the shared LM head
    hidden = model.mtp(out.aux["pre_norm"], model.embed_tokens(A.next_tokens(batch["inputs"])),
                       batch["positions"], batch["segment_ids"])
    labels = A.mtp_targets(batch["targets"], batch["segment_ids"])
    ce, _ = token_cross_entropy(hidden, model.head_weight().astype(hidden.dtype), labels, cfg.kernels.impl)
    metrics["mtp_loss"] = masked_mean(ce, (labels >= 0).astype(jnp.float32))
    total = total + cfg.mtp.weight * metrics["mtp_loss"]
  return total, metrics


def lm_objective(model, batch, cfg):
  """NTP (+ z-loss, NITP, MTP) for the baseline. Returns (total loss, metrics dict)."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
  total, metrics = ntp_terms(model, out, batch, cfg)
  aux_total, aux_metrics = auxiliary_terms(model, out, batch, cfg)
  metrics.update(aux_metrics)
  metrics["total_loss"] = total + aux_total
  return metrics["total_loss"], metrics


def ncp_objective(model, batch, cfg):
  """NCP-ArchPreview Eq. 24: L_NTP + alpha L_NCP + beta L_VQ (+ z-loss, NITP, MTP), each term logged on its own."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False, **model_kwargs(cfg))
  total, metrics = ntp_terms(model, out, batch, cfg)
  a, m, n = out.aux, cfg.model, cfg.ncp
  metrics["ncp_loss"] = C.ncp_loss(a["predicted"], a["concepts"], m.num_segments, n.reduction, a["ncp_mask"])
  metrics["vq_loss"] = C.vq_loss(a["concepts"], a["quantized"], m.num_segments, n.reduction)
  metrics.update(C.codebook_usage(a["codes"], m.codebook_size))
  aux_total, aux_metrics = auxiliary_terms(model, out, batch, cfg)
  metrics.update(aux_metrics)
  total = total + n.alpha * metrics["ncp_loss"] + n.beta * metrics["vq_loss"] + aux_total
  metrics["total_loss"] = total
  return total, metrics


def model_kwargs(cfg):
  """Extra call arguments of the configured model: ConceptLM's codebook-mixing kernel."""
  return {"impl": cfg.kernels.impl} if cfg.model.name == "concept" else {}


def tst_objective(model, batch, cfg):
  """TST phase 1: superposed bags in, multi-hot CE on the next bag out (docs/tst.md).

  The batch holds rows of L*s tokens (L bags). `cfg.tst.superpose` picks the ablation:
  "both" bags in and the next bag out; "input" bags in, the next token out; "output"
  plain tokens in, the next s tokens out at every position. `loss` is this phase's LM loss.
  """
  t, s = cfg.tst, cfg.tst.s
  if t.superpose in ("both", "input"):
    bags = sup.superpose_embeddings(model.embed_tokens(batch["inputs"]), s)
    out = model(None, sup.bag_segments(batch["segment_ids"], s),
                sup.bag_positions(batch["segment_ids"], batch["positions"], s, t.positions),
                logits=False, embeddings=bags)
    labels = sup.next_bag_targets(batch["targets"], s)
    labels = labels if t.superpose == "both" else labels[..., :1]
    # NITP over bags: bag j predicts the shallow state of bag j+1. MTP has no bag form.
    aux_batch = {"targets": labels[..., 0], "segment_ids": sup.bag_segments(batch["segment_ids"], s)}
  else:
    out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
    labels = sup.next_token_bags(batch["targets"], s)
    aux_batch = batch
  ce, lse = sup.multihot_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype), labels,
                                       cfg.kernels.impl, return_lse=True)
  mask = jnp.any(labels >= 0, axis=-1).astype(jnp.float32)
  metrics = {"loss": masked_mean(ce, mask)}
  total = metrics["loss"]
  if cfg.train.z_loss:
    metrics["z_loss"] = z_loss(lse, mask)
    total = total + cfg.train.z_loss * metrics["z_loss"]
  aux_total, aux_metrics = auxiliary_terms(model, out, aux_batch, cfg, mtp=aux_batch is batch)
  metrics.update(aux_metrics)
  metrics["total_loss"] = total + aux_total
  return metrics["total_loss"], metrics


def eval_sums(model, batch, cfg):
  """Summed NLL and count of scored tokens for one validation batch (for loss and bits/byte)."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False, **model_kwargs(cfg))
  ce, _ = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                              batch["targets"], cfg.kernels.impl)
  mask = batch["targets"] >= 0
  return jnp.sum(jnp.where(mask, ce, 0.0)), jnp.sum(mask)


def objective_for(cfg):
  """The training objective for the configured model: (model, batch, cfg) -> (total, metrics)."""
  if cfg.model.name == "concept":
    return ncp_objective
  return lm_objective
