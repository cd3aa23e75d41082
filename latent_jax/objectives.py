"""The training objective: a weighted sum of loss terms, each a pure function, each logged.

`loss` in the metrics is always the per-token next-token cross-entropy (the LM loss), so runs
with and without auxiliary terms compare on the same number. (TST phase 1 trains on bags, so
its `loss` is the multi-hot bag CE; `val_loss` is per-token NTP in every phase. A drafter run's
`loss` and `val_loss` are its CE per scored block slot.)

Every term is a mean over what it scores (tokens, positions, concept pairs, concepts, bags), kept
as a sum and a count until `combine` divides. Each count depends on the batch only, so a train
step over microbatches divides every microbatch's sums by the whole batch's counts: the loss and
gradients of k microbatches are those of the batch (train/step.py). No term is a statistic of the
batch as a whole; the codebook usage metrics come from a code histogram, which adds up too.
"""
import jax
import jax.numpy as jnp
import optax

import pallas_kernels
from latent_jax.config import moe_enabled, mtp_enabled, nitp_enabled
from latent_jax import sharding
from latent_jax.ops import auxiliary as A
from latent_jax.ops import concepts as C
from latent_jax.ops import drafting as D
from latent_jax.ops import superposition as sup
from latent_jax.nn.drafter import draft, target_features


def token_cross_entropy(hidden, head_weight, targets, impl):
  """Per-token CE and log-sum-exp of the LM head's logits without materialising them all.

  hidden [B, T, d], head_weight [d, V], targets [B, T] (negative = ignored) -> ([B, T], [B, T]).
  """
  b, t, d = hidden.shape
  ce = lambda rows, w: pallas_kernels.fused_cross_entropy(rows[0], w, rows[1], impl=impl, return_lse=True)
  loss, lse = sharding.per_batch_shard(ce, (hidden.reshape(b * t, d), targets.reshape(b * t, 1)), head_weight)
  return loss.reshape(b, t), lse.reshape(b, t)


def term(values, mask, weight=1.0):
  """A loss term, the mean of `values` over the positions `mask` marks: (their sum, their count, weight)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(values.astype(jnp.float32) * mask), jnp.sum(mask), weight


def combine(terms, counts=None):
  """(total loss, metrics) of terms {name: (sum, count, weight)}: each term is its sum over its count,
  the total their weighted sum. `counts` ({name: count}) divides instead: under microbatching the
  whole batch's, so that the microbatches' terms, total and gradients add up to the batch's.
  metrics["counts"] holds the terms' own counts."""
  own = {name: count for name, (_, count, _) in terms.items()}
  counts = own if counts is None else counts
  metrics = {name: total / jnp.maximum(counts[name], 1) for name, (total, _, _) in terms.items()}
  metrics["total_loss"] = sum(weight * metrics[name] for name, (_, _, weight) in terms.items())
  return metrics["total_loss"], {**metrics, "counts": own}


def step_metrics(metrics):
  """What a train step logs of an objective's metrics (summed over microbatches): the counts dropped,
  the code histogram turned into codebook usage."""
  metrics = {k: v for k, v in metrics.items() if k not in ("counts", "moe_bias_probe")}
  if "code_histogram" in metrics:
    metrics.update(C.codebook_usage(metrics.pop("code_histogram")))
  if "moe_load" in metrics:  # tokens per expert [sparse layers, E] -> each layer's max over mean
    load = metrics.pop("moe_load")
    imbalance = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    metrics.update({f"moe_load_max/{i}": imbalance[i] for i in range(load.shape[0])})
  return metrics


def ntp_terms(model, out, batch, cfg):
  """NTP (+ z-loss: log(Z)^2, which keeps the softmax normaliser near 1) of a forward pass `out`, as terms."""
  mask = batch["targets"] >= 0
  ce, lse = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                                batch["targets"], cfg.kernels.impl)
  terms = {"loss": term(ce, mask)}
  if cfg.train.z_loss:
    terms["z_loss"] = term(jnp.square(lse), mask, cfg.train.z_loss)
  return terms


def auxiliary_terms(model, out, batch, cfg, mtp=True):
  """NITP and MTP terms of a forward pass `out` (docs/aux.md), for either model: `nitp_loss`, `mtp_loss`.

  {} when both are off; `mtp=False` leaves MTP out (TST's bag phase, where it has no meaning).
  """
  terms = {}
  if nitp_enabled(cfg):  # L_NITP = 1 - cos(P(h_t), sg(z_{t+1})), z = state after layer k
    n = cfg.nitp
    h = out.hidden if n.source == "final_norm" else out.aux["pre_norm"]
    pred = model.nitp_projector(h) if n.projector else h
    error = A.nitp_error(pred, out.aux["nitp_target_state"], n.loss, n.alignment, n.stop_gradient)
    terms["nitp_loss"] = term(error, A.nitp_mask(batch["targets"], batch["segment_ids"], n.alignment), n.weight)
  if mtp and mtp_enabled(cfg):  # CE of x_{t+2} from MTPBlock(h_t, Emb(x_{t+1})) through the shared LM head
    hidden = model.mtp(out.aux["pre_norm"], model.embed_tokens(A.next_tokens(batch["inputs"])),
                       batch["positions"], batch["segment_ids"])
    labels = A.mtp_targets(batch["targets"], batch["segment_ids"])
    ce, _ = token_cross_entropy(hidden, model.head_weight().astype(hidden.dtype), labels, cfg.kernels.impl)
    terms["mtp_loss"] = term(ce, labels >= 0, cfg.mtp.weight)
  return {**terms, **moe_terms(out, cfg)}


def expert_load(out):
  """{"moe_load": tokens per expert [sparse layers, E]} of a forward pass with model.moe (it adds up over
  microbatches; `step_metrics` logs each layer's max over mean as moe_load_max/i), else {}."""
  return {"moe_load": out.aux["moe"]["load"]} if "moe" in out.aux else {}


def moe_terms(out, cfg):
  """The router's terms of a forward pass (model.moe, docs/moe.md), each the mean over the sparse layers of a
  per-call figure, weighted by the tokens of the call: `moe_lb_loss`, `router_z_loss`; `router_entropy` and,
  with a capacity, `moe_dropped` (weight 0, watched only), and each also per sparse layer i (`router_entropy/i`,
  `moe_dropped/i`); and `moe_bias_probe` (sigmoid router: value 0, its gradient on each layer's
  router_bias is that layer's expert load, which the train step turns into the bias update)."""
  if not moe_enabled(cfg.model) or "moe" not in out.aux:
    return {}
  e, stats = cfg.model.moe, out.aux["moe"]
  n = jnp.float32(out.hidden.shape[0] * out.hidden.shape[1])
  mean = lambda name: (jnp.mean(stats[name]) * n, n)
  terms = {"moe_lb_loss": (*mean("lb_loss"), e.lb_loss_weight), "router_z_loss": (*mean("z_loss"), e.z_loss_weight),
           "router_entropy": (*mean("entropy"), 0.0)}
  if e.capacity_factor > 0:
    terms["moe_dropped"] = (*mean("dropped"), 0.0)
  # Per sparse layer i (watched only; scalars that cost nothing beside the forward pass): router_entropy/i and,
  # with a capacity, moe_dropped/i, weighted by the call's tokens as the means are (they add up over microbatches).
  names = ("entropy", "router_entropy"), *((("dropped", "moe_dropped"),) if e.capacity_factor > 0 else ())
  for stat, name in names:
    terms.update({f"{name}/{i}": (stats[stat][i] * n, n, 0.0) for i in range(stats[stat].shape[0])})
  if e.router == "sigmoid":
    terms["moe_bias_probe"] = (*mean("bias_probe"), 1.0)
  return terms


def lm_objective(model, batch, cfg, counts=None):
  """NTP (+ z-loss, NITP, MTP) for the baseline. Returns (total loss, metrics dict); `counts`: see `combine`."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
  total, metrics = combine({**ntp_terms(model, out, batch, cfg), **auxiliary_terms(model, out, batch, cfg)}, counts)
  return total, {**metrics, **expert_load(out)}


def ncp_objective(model, batch, cfg, counts=None):
  """NCP-ArchPreview Eq. 24: L_NTP + alpha L_NCP + beta L_VQ (+ z-loss, NITP, MTP), each term logged on its own."""
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False, **model_kwargs(cfg))
  a, m, n = out.aux, cfg.model, cfg.ncp
  terms = ntp_terms(model, out, batch, cfg)
  terms["ncp_loss"] = term(C.ncp_errors(a["predicted"], a["concepts"], m.num_segments, n.reduction),
                           a["ncp_mask"], n.alpha)
  terms["vq_loss"] = term(C.vq_errors(a["concepts"], a["quantized"], m.num_segments, n.reduction),
                          jnp.ones(a["codes"].shape[:-1]), n.beta)
  total, metrics = combine({**terms, **auxiliary_terms(model, out, batch, cfg)}, counts)
  metrics["code_histogram"] = C.code_histogram(a["codes"], m.codebook_size)  # `step_metrics` logs its usage
  return total, {**metrics, **expert_load(out)}


def model_kwargs(cfg):
  """Extra call arguments of the configured model: ConceptLM's codebook-mixing kernel."""
  return {"impl": cfg.kernels.impl} if cfg.model.name == "concept" else {}


def tst_objective(model, batch, cfg, counts=None):
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
  mask = jnp.any(labels >= 0, axis=-1)
  terms = {"loss": term(ce, mask)}
  if cfg.train.z_loss:
    terms["z_loss"] = term(jnp.square(lse), mask, cfg.train.z_loss)
  total, metrics = combine({**terms, **auxiliary_terms(model, out, aux_batch, cfg, mtp=aux_batch is batch)}, counts)
  return total, {**metrics, **expert_load(out)}


def drafter_scores(model, batch, anchors, labels_from):
  """The block drafter `model.drafter` on its frozen target `model` (NCP Sec. 5.3): at anchors [B, A], the CE
  of its K proposals -> (ce [B, A, K], labels [B, A, K] (-1: not scored), proposals [B, A, K]).

  The labels are the row's next K tokens ('data'), or the target's greedy token at each of those
  positions after the data before it ('target', teacher-forced); never past the row, the anchor's
  document or the padding."""
  drafter, tokens = model.drafter, batch["inputs"]
  target_logits, hidden, concepts = target_features(model, tokens, batch["segment_ids"], batch["positions"],
                                                    drafter.concept, logits=labels_from == "target")
  hidden, concepts = jax.lax.stop_gradient((hidden, concepts))
  logits = draft(drafter, model, hidden, concepts, tokens, batch["segment_ids"], anchors)
  if labels_from == "target":
    tokens = jnp.concatenate([tokens[:, :1], jnp.argmax(target_logits[:, :-1], -1).astype(tokens.dtype)], axis=1)
  labels = D.draft_labels(tokens, batch["segment_ids"], anchors, drafter.block_size)
  real, _ = D.gather_offsets(batch["targets"] >= 0, anchors, jnp.arange(drafter.block_size))  # not padding
  labels = jnp.where(real, labels, -1)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.maximum(labels, 0))
  return ce, labels, jnp.argmax(logits, -1)


def drafter_objective(model, batch, cfg, counts=None):
  """The drafter's mean CE over its scored block slots, at `drafter.anchors` random anchors a row (D.row_anchors)."""
  anchors = D.row_anchors(batch["inputs"], cfg.drafter.anchors, cfg.train.seed)
  ce, labels, _ = drafter_scores(model, batch, anchors, cfg.drafter.labels)
  return combine({"loss": term(ce, labels >= 0)}, counts)


def eval_sums(model, batch, cfg):
  """Summed NLL of one validation batch and what it scored (labels, -1 = not), for loss and bits/byte:
  the next tokens; for a drafter run, its block slots at strided anchors."""
  if "drafter" in cfg:
    anchors = D.strided_anchors(batch["inputs"].shape[0], batch["inputs"].shape[1], cfg.drafter.anchors)
    ce, labels, _ = drafter_scores(model, batch, anchors, cfg.drafter.labels)
    return jnp.sum(jnp.where(labels >= 0, ce, 0.0)), labels
  out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False, **model_kwargs(cfg))
  ce, _ = token_cross_entropy(out.hidden, model.head_weight().astype(out.hidden.dtype),
                              batch["targets"], cfg.kernels.impl)
  return jnp.sum(jnp.where(batch["targets"] >= 0, ce, 0.0)), batch["targets"]


def objective_for(cfg):
  """The training objective for the configured model: (model, batch, cfg) -> (total, metrics)."""
  if "drafter" in cfg:  # a drafter run (python -m latent_jax.draft): the target is frozen
    return drafter_objective
  if cfg.model.name == "concept":
    return ncp_objective
  return lm_objective
