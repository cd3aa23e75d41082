"""NITP and MTP (docs/aux.md): losses and masks against NumPy, the tapped target, stop-gradient,
an unchanged LM loss, exports without the heads, ConceptLM (encoder target, training), FLOPs
and configs."""
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import ncp_ref
import numpy_ref as ref
from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import ConfigError, build_model, load_config
from latent_jax.config import nitp_layer, validate
from latent_jax.objectives import (auxiliary_terms, combine, lm_objective, model_kwargs, ncp_objective, ntp_terms,
                                   step_metrics)
from latent_jax.ops import auxiliary as A
from latent_jax.train import flops

TINY_NITP = os.path.join(ROOT, "configs", "tiny_nitp.py")
TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
rng = np.random.default_rng(0)
f32 = lambda x: jnp.asarray(x, jnp.float32)


def nitp_cfg(*extra, path=TINY_NITP):
  return load_config(path, TINY_OVERRIDES + list(extra))


def packed_batch(b=2, t=12, vocab=320, seed=0):
  """Row 0: two documents (the first ends with the input at position 4); row 1: one document
  whose last two positions are padding (segment 0, targets -1). Its own seed: the same batch
  whichever tests ran before (pytest-xdist orders them differently)."""
  tokens = np.random.default_rng(seed).integers(0, vocab, size=(b, t + 1))
  seg = np.array([[1] * 5 + [2] * (t - 5), [1] * (t - 2) + [0] * 2])
  pos = np.array([list(range(5)) + list(range(t - 5)), list(range(t - 2)) + [0, 0]])
  targets = tokens[:, 1:].copy()
  targets[1, -3:] = -1  # the last real token has no next token in its row; padding is never scored
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  return {"inputs": as_int(tokens[:, :-1]), "targets": as_int(targets), "segment_ids": as_int(seg),
          "positions": as_int(pos)}


# ------------------------------------------------------------------ NumPy references
def ref_nitp_pairs(targets, seg, alignment):
  """(row, position, target position) of every NITP pair: a scored token whose target state is
  in its own document and row (the t -> t ablation: the token's own position)."""
  b, t = targets.shape
  step = 1 if alignment == "next" else 0
  return [(i, j, j + step) for i in range(b) for j in range(t)
          if targets[i, j] >= 0 and j + step < t and seg[i, j + step] == seg[i, j]]


def ref_nitp(pred, shallow, targets, seg, loss, alignment):
  per = []
  for i, j, k in ref_nitp_pairs(targets, seg, alignment):
    p, z = pred[i, j].astype(np.float64), shallow[i, k].astype(np.float64)
    per.append(1 - p @ z / np.linalg.norm(p) / np.linalg.norm(z) if loss == "cosine" else np.mean((p - z) ** 2))
  return np.mean(per)


def ref_mtp_labels(targets, seg):
  """x_{t+2} (= targets[t+1]) where x_t, x_{t+1}, x_{t+2} are one document's tokens in the row, else -1."""
  b, t = targets.shape
  out = -np.ones((b, t), int)
  for i in range(b):
    for j in range(t - 2):
      if targets[i, j] >= 0 and targets[i, j + 1] >= 0 and seg[i, j] == seg[i, j + 1] == seg[i, j + 2]:
        out[i, j] = targets[i, j + 1]
  return out


def ref_ce(logits, labels):
  lp = ref.log_softmax(logits.astype(np.float64))
  rows = [(i, j) for i in range(labels.shape[0]) for j in range(labels.shape[1]) if labels[i, j] >= 0]
  return np.mean([-lp[i, j, labels[i, j]] for i, j in rows])


def ref_states(p, m, batch):
  """NumPy forward of the baseline's blocks: the state after every layer (the last is `pre_norm`)."""
  inputs, seg, pos = (np.asarray(batch[f]) for f in ("inputs", "segment_ids", "positions"))
  x, states = p["embed"][inputs], []
  for layer, window in enumerate(ncp_ref.windows(m.num_layers, m.window, m.full_attention_every)):
    x = ncp_ref.block(ncp_ref._index(p["blocks"]["blocks"], layer), m, x, pos, seg, window)
    states.append(x)
  return states


def with_random(params, draw, *paths, scale=0.5):
  """A copy of `params` (an nnx.State) whose leaves at `paths` ("final_norm/scale") are drawn at
  random around their values: at init every norm scale is 1 and RMSNorm(x) has the direction and
  RMS of RMSNorm(RMSNorm(x)), so a state read before or after the final norm would pass unseen."""
  params = jax.tree.map(lambda x: x, params)
  p = nnx.to_pure_dict(params)
  for path in paths:
    *up, name = path.split("/")
    node = p
    for key in up:
      node = node[key]
    node[name] = np.asarray(node[name] + scale * draw.normal(size=node[name].shape), np.float32)
  nnx.replace_by_pure_dict(params, p)
  return params


# ------------------------------------------------------------------ the pure functions
@pytest.mark.parametrize("loss", ["cosine", "mse"])
@pytest.mark.parametrize("alignment", ["next", "same"])
def test_nitp_loss_matches_numpy(loss, alignment):
  batch = packed_batch()
  targets, seg = np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])
  pred, shallow = rng.normal(size=(2, 12, 8)), rng.normal(size=(2, 12, 8))
  mask = A.nitp_mask(batch["targets"], batch["segment_ids"], alignment)
  want_mask = np.zeros((2, 12), bool)
  for i, j, _ in ref_nitp_pairs(targets, seg, alignment):
    want_mask[i, j] = True
  np.testing.assert_array_equal(mask, want_mask)
  assert not want_mask[0, 4] or alignment == "same"  # the token before a document boundary
  got = A.nitp_loss(f32(pred), f32(shallow), mask, loss, alignment)
  np.testing.assert_allclose(got, ref_nitp(pred, shallow, targets, seg, loss, alignment), rtol=1e-5)


def test_mtp_labels_match_numpy():
  batch = packed_batch()
  labels = A.mtp_targets(batch["targets"], batch["segment_ids"])
  want = ref_mtp_labels(np.asarray(batch["targets"]), np.asarray(batch["segment_ids"]))
  np.testing.assert_array_equal(labels, want)
  assert (want[:, -2:] == -1).all() and (want[0, 3:5] == -1).all()  # row end; x_{t+1} or x_{t+2} in doc 2
  np.testing.assert_array_equal(A.next_tokens(batch["inputs"])[:, :-1], batch["inputs"][:, 1:])


# ------------------------------------------------------------------ the model's terms
@pytest.fixture(scope="module")
def aux_model():
  """tiny_nitp + MTP at the test size, random params, and one compiled (objective, aux outputs)."""
  cfg = nitp_cfg("mtp.enabled=True", "mtp.weight=0.5", "nitp.weight=0.7")
  graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))

  @jax.jit
  def run(params, batch):
    model = nnx.merge(graphdef, params)
    out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
    total, metrics = lm_objective(model, batch, cfg)
    return metrics, out, model.nitp_projector(out.hidden), model.mtp(
        out.aux["pre_norm"], model.embed_tokens(A.next_tokens(batch["inputs"])), batch["positions"],
        batch["segment_ids"])
  return cfg, graphdef, params, run


@pytest.fixture(scope="module")
def aux_ref(aux_model):
  """aux_model's params with a random final-norm scale and projector weights of about unit gain (at
  init P(h) is so small that MSE barely sees it), a packed batch, and the NumPy states after every
  layer on it."""
  cfg, _, params, _ = aux_model
  draw = np.random.default_rng(1)
  params = with_random(params, draw, "final_norm/scale")
  params = with_random(params, draw, *(f"nitp_projector/{w}" for w in ("gate", "up", "down")), scale=0.2)
  batch = packed_batch()
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  return params, batch, p, ref_states(p, cfg.model, batch)


def test_model_terms_match_numpy(aux_model, aux_ref):
  """The tapped target (layer k of 2), the projector, NITP and MTP (block, shared head) from NumPy.

  The losses come from the objective (`lm_objective` -> `auxiliary_terms`), so its wiring is under
  test: with a random final-norm scale, P reading the state after the norm and MTP reading the one
  before it are both pinned."""
  cfg, _, _, run = aux_model
  params, batch, p, states = aux_ref
  m, k = cfg.model, nitp_layer(cfg)
  assert k == 1  # max(1, round(0.2 * 2))
  metrics, out, pred, mtp_hidden = run(params, batch)
  inputs, seg, targets = (np.asarray(batch[f]) for f in ("inputs", "segment_ids", "targets"))
  pos, x = np.asarray(batch["positions"]), states[-1]
  np.testing.assert_allclose(out.aux["nitp_target_state"], states[k - 1], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out.aux["pre_norm"], x, rtol=1e-4, atol=1e-4)
  hidden = ref.rms_norm(x, p["final_norm"]["scale"], m.norm_eps)
  proj = p["nitp_projector"]
  want_pred = ref.swiglu(hidden, proj["gate"], proj["up"], proj["down"])
  np.testing.assert_allclose(pred, want_pred, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(metrics["nitp_loss"], ref_nitp(want_pred, states[k - 1], targets, seg, "cosine", "next"),
                             rtol=1e-4)
  # MTP: RMSNorm(Block(W [RMSNorm(h_t); RMSNorm(Emb(x_{t+1}))])) -> shared LM head -> CE on x_{t+2},
  # h_t the state before the final norm.
  q = p["mtp"]
  nxt = np.concatenate([inputs[:, 1:], np.zeros_like(inputs[:, :1])], 1)
  mtp_in = lambda h: np.concatenate([ref.rms_norm(h, q["h_norm"]["scale"], m.norm_eps),
                                     ref.rms_norm(p["embed"][nxt], q["e_norm"]["scale"], m.norm_eps)], -1) @ q["proj"]
  mtp_out = lambda h: ref.rms_norm(ncp_ref.block(q["block"], m, mtp_in(h), pos, seg, 2**30), q["norm"]["scale"],
                                   m.norm_eps)
  y = mtp_out(x)
  np.testing.assert_allclose(mtp_hidden, y, rtol=1e-4, atol=1e-4)  # the block alone (called by the test)
  labels = ref_mtp_labels(targets, seg)
  want_mtp = ref_ce(y @ p["lm_head"], labels)
  assert abs(ref_ce(mtp_out(hidden) @ p["lm_head"], labels) - want_mtp) > 1e-3  # the two readings differ
  np.testing.assert_allclose(metrics["mtp_loss"], want_mtp, rtol=1e-4)  # the objective's wiring
  m = {k: float(v) for k, v in step_metrics(metrics).items()}  # pytest.approx takes Python or NumPy numbers, never jax Arrays
  assert m["total_loss"] == pytest.approx(m["loss"] + 0.7 * m["nitp_loss"] + 0.5 * m["mtp_loss"], rel=1e-6)


def test_lm_loss_is_unchanged_by_the_aux_terms(aux_model):
  """Same seed, same base params: the heads init after the model, and `loss` is NTP alone."""
  cfg, _, params, run = aux_model
  plain = build_model(load_config(TINY, TINY_OVERRIDES), nnx.Rngs(0))
  base = nnx.to_pure_dict(nnx.state(plain))
  full = nnx.to_pure_dict(params)
  assert set(full) - set(base) == {"nitp_projector", "mtp"}
  jax.tree.map(np.testing.assert_array_equal, base, {k: full[k] for k in base})
  batch = packed_batch()
  metrics = run(params, batch)[0]
  want, _ = jax.jit(lambda b: lm_objective(plain, b, load_config(TINY, TINY_OVERRIDES)))(batch)
  assert float(metrics["loss"]) == float(want)
  assert float(metrics["total_loss"]) > float(want)


def test_stop_gradient_keeps_nitp_off_the_target_path():
  """sg on: the NITP gradient equals that of the loss against the target computed apart as a
  constant. sg off: it differs exactly in the params before the tap (embedding, layer 1 of 2).
  NTP reaches the shallow layer either way. Checked for the pure function's argument and for
  `nitp.stop_gradient` set in the config and read by the objective."""
  cfg = nitp_cfg()
  graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))
  batch = packed_batch()
  mask = A.nitp_mask(batch["targets"], batch["segment_ids"])
  configured = [nitp_cfg(f"nitp.stop_gradient={sg}") for sg in (True, False)]

  def forward(p):
    model = nnx.merge(graphdef, p)
    out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
    return model, out, model.nitp_projector(out.hidden)

  const = forward(params)[1].aux["nitp_target_state"]

  def losses(p):  # nitp: [sg, no sg, against the constant target]; ntp; the objective's nitp: [sg, no sg]
    model, out, pred = forward(p)
    z = out.aux["nitp_target_state"]
    return jnp.stack([A.nitp_loss(pred, z, mask), A.nitp_loss(pred, z, mask, stop_gradient=False),
                      A.nitp_loss(pred, const, mask, stop_gradient=False), combine(ntp_terms(model, out, batch, cfg))[0],
                      *(lm_objective(nnx.merge(graphdef, p), batch, c)[1]["nitp_loss"] for c in configured)])

  grad = jax.jit(jax.grad(lambda p, w: jnp.dot(w, losses(p))))
  sg, no_sg, constant, ntp, cfg_sg, cfg_no_sg = (nnx.to_pure_dict(grad(params, jnp.eye(6)[i])) for i in range(6))
  shallow = lambda tree: jax.tree.map(lambda a: a[0], tree["blocks"]["blocks"])  # layer 1 of 2 (k = 1)
  deep = lambda tree: jax.tree.map(lambda a: a[1], tree["blocks"]["blocks"])
  for on, off in [(sg, no_sg), (cfg_sg, cfg_no_sg)]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), on, constant)
    diff = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)), off, on)  # through the target
    assert np.max(diff["embed"]) > 1e-4  # the target path's gradient is far above that float noise
    assert np.any(diff["embed"]) and all(np.any(d) for d in jax.tree.leaves(shallow(diff)))
    assert not any(np.any(d) for d in jax.tree.leaves(deep(diff)))
    for name in ("final_norm", "nitp_projector", "lm_head"):
      assert not any(np.any(d) for d in jax.tree.leaves(diff[name]))
    assert all(np.any(g) for g in jax.tree.leaves(shallow(on)))  # the prediction path runs through layer 1
  assert all(np.any(g) for g in jax.tree.leaves(shallow(ntp)))


def test_ablation_switches_reach_the_loss(aux_model, aux_ref):
  """Every combination of nitp.loss, alignment, projector and source, set in the config and read by
  `auxiliary_terms`, against NumPy: target layer 1 of 2, a random final-norm scale and projector, so
  flipping any one switch changes the loss (a switch that did nothing would show)."""
  cfg, graphdef, _, _ = aux_model
  params, batch, p, states = aux_ref
  assert nitp_layer(cfg) == 1
  off = nnx.eval_shape(lambda: build_model(nitp_cfg("nitp.projector=False"), nnx.Rngs(0)))
  assert "nitp_projector" not in nnx.to_pure_dict(nnx.state(off))
  variants = list(itertools.product(["cosine", "mse"], ["next", "same"], [True, False], ["final_norm", "pre_norm"]))
  cfgs = []
  for loss, alignment, projector, source in variants:
    c = cfg.copy_and_resolve_references()
    c.nitp.loss, c.nitp.alignment, c.nitp.projector, c.nitp.source = loss, alignment, projector, source
    cfgs.append(c)

  @jax.jit
  def run(params):
    model = nnx.merge(graphdef, params)
    out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
    return jnp.stack([combine(auxiliary_terms(model, out, batch, c, mtp=False))[1]["nitp_loss"] for c in cfgs])
  got = run(params)
  m, proj = cfg.model, p["nitp_projector"]
  targets, seg = np.asarray(batch["targets"]), np.asarray(batch["segment_ids"])
  h = {"pre_norm": states[-1], "final_norm": ref.rms_norm(states[-1], p["final_norm"]["scale"], m.norm_eps)}
  want = np.array([ref_nitp(ref.swiglu(h[source], proj["gate"], proj["up"], proj["down"]) if projector else h[source],
                            states[0], targets, seg, loss, alignment)
                   for loss, alignment, projector, source in variants])
  for v, g, w in zip(variants, got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, err_msg=str(v))
  # Flipping any one switch moves the loss by far more than the tolerance, whatever the others are
  # (variant i's bits, outer to inner: loss, alignment, projector, source).
  for bit, switch in [(8, "loss"), (4, "alignment"), (2, "projector"), (1, "source")]:
    flipped = want[np.arange(len(want)) ^ bit]
    assert np.all(np.abs(want - flipped) > 2e-3), switch


# ------------------------------------------------------------------ training, export, ConceptLM
@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_export_drops_the_heads_and_generates_the_same(tmp_path, corpus_dir):
  from latent_jax.export import export
  from latent_jax.infer import load
  from latent_jax.infer.sample import generate
  from latent_jax.train.loop import train
  cfg = nitp_cfg("mtp.enabled=True", "train.steps=2", "optim.warmup_steps=1", "train.eval_every=0",
                 f"data.source={corpus_dir}")
  run, out = str(tmp_path / "run"), str(tmp_path / "export")
  rows = train(cfg, run)
  assert np.isfinite(rows["nitp_loss"]) and np.isfinite(rows["mtp_loss"])
  assert rows["flops"] == 2 * 8 * 32 * flops.flops_per_token(cfg, 32)  # the heads' FLOPs are counted
  export(run, out)
  saved = lambda d: set(ocp.StandardCheckpointer().restore(os.path.abspath(d)))
  assert {"nitp_projector", "mtp"} <= saved(os.path.join(run, "checkpoints", "2", "params"))
  assert not {"nitp_projector", "mtp"} & saved(os.path.join(out, "params"))
  exported = json.load(open(os.path.join(out, "config.json")))
  assert not exported["nitp"]["enabled"] and not exported["mtp"]["enabled"]
  prompt = jnp.asarray([[5, 17, 42]], jnp.int32)
  texts = [np.asarray(generate(load.load_model(d)[0], prompt, 6, jax.random.key(0), temperature=0.0))
           for d in (run, out)]
  np.testing.assert_array_equal(texts[0], texts[1])


CONCEPT_MODEL = ["model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=2",
                 "model.concept_layers=1", "model.decoder_layers=1", "model.remat=full"]  # remat: faster compile


@pytest.fixture(scope="module")
def concept_aux():
  """ConceptLM (E = 2) with NITP (target encoder layer k = 2) and MTP, and the same model without
  them (checked to init alike); params with a random final-norm scale and encoder IRC weights (at
  init IRC is the plain residual: a layer's output and the mixture after it agree). One compiled
  function: the objective's value and gradient; the forward's hidden state and NITP target with k = 2
  and with k = 1 (and the objective's NITP loss of that forward); the plain model's objective."""
  cfg = load_config(TINY_NCP, TINY_OVERRIDES + CONCEPT_MODEL + ["nitp.enabled=True", "mtp.enabled=True",
                                                                "nitp.layer=2"])
  plain_cfg = load_config(TINY_NCP, TINY_OVERRIDES + CONCEPT_MODEL)
  graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))
  plain_graphdef, plain_params = nnx.split(build_model(plain_cfg, nnx.Rngs(0)))
  full, base = nnx.to_pure_dict(params), nnx.to_pure_dict(plain_params)
  assert set(full) - set(base) == {"nitp_projector", "mtp"}
  jax.tree.map(np.testing.assert_array_equal, base, {k: full[k] for k in base})
  params = with_random(params, np.random.default_rng(3), "final_norm/scale", "encoder/irc_w2")
  full = nnx.to_pure_dict(params)
  nnx.replace_by_pure_dict(plain_params, {k: full[k] for k in base})  # equal params

  @jax.jit
  def run(params, plain_params, batch):
    objective = lambda p: ncp_objective(nnx.merge(graphdef, p), batch, cfg)
    (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
    model = nnx.merge(graphdef, params)
    forward = lambda: model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False,
                            **model_kwargs(cfg))
    out = forward()
    model.nitp_layer = 1
    out1 = forward()
    nitp1 = combine(auxiliary_terms(model, out1, batch, cfg, mtp=False))[1]["nitp_loss"]
    plain = ncp_objective(nnx.merge(plain_graphdef, plain_params), batch, plain_cfg)[1]
    return (metrics, grads), {"hidden": out.hidden, "z2": out.aux["nitp_target_state"],
                              "z1": out1.aux["nitp_target_state"], "nitp1": nitp1}, plain
  batch = packed_batch()
  return cfg, params, batch, run(params, plain_params, batch)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_concept_lm_train_step_with_nitp_and_mtp(concept_aux):
  """One gradient step of ncp_objective with both terms: every term logged, the total their
  weighted sum, gradients finite and reaching both heads."""
  cfg, _, _, ((r, grads), _, _) = concept_aux
  n, r = cfg.ncp, {k: float(v) for k, v in step_metrics(r).items()}  # pytest.approx takes no jax Arrays
  assert r["total_loss"] == pytest.approx(r["loss"] + n.alpha * r["ncp_loss"] + n.beta * r["vq_loss"]
                                          + r["nitp_loss"] + 0.3 * r["mtp_loss"], rel=1e-5)
  assert 0 < r["nitp_loss"] < 2 and 0 < r["mtp_loss"] < 10
  grads = nnx.to_pure_dict(grads)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert all(np.any(g) for g in jax.tree.leaves({k: grads[k] for k in ("nitp_projector", "mtp")}))


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_concept_lm_nitp_target_is_encoder_layer_k(concept_aux):
  """The target is the output of encoder layer k (k = 2 and k = 1 of E = 2; with IRC the block's
  output, before the mixture), re-derived in NumPy from the embeddings; the objective's NITP loss is
  1 - cos(P(decoder's last hidden state), that target at t+1) over the masked positions."""
  cfg, params, batch, ((metrics, _), got, _) = concept_aux
  m, p = cfg.model, jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  inputs, seg, pos, targets = (np.asarray(batch[f]) for f in ("inputs", "segment_ids", "positions", "targets"))
  _, enc = ncp_ref.stack(p["encoder"], m, p["embed"][inputs], pos, seg,
                         ncp_ref.windows(m.encoder_layers, m.window, m.full_attention_every), [], m.irc)
  assert np.max(np.abs(enc[1] - enc[0])) > 0.1
  proj = p["nitp_projector"]
  pred = ref.swiglu(np.asarray(got["hidden"]), proj["gate"], proj["up"], proj["down"])
  for k, z, loss in [(2, got["z2"], metrics["nitp_loss"]), (1, got["z1"], got["nitp1"])]:
    np.testing.assert_allclose(z, enc[k - 1], rtol=1e-4, atol=1e-4, err_msg=f"k={k}")
    np.testing.assert_allclose(loss, ref_nitp(pred, enc[k - 1], targets, seg, "cosine", "next"), rtol=1e-4,
                               err_msg=f"k={k}")
  assert abs(float(metrics["nitp_loss"]) - float(got["nitp1"])) > 1e-3


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_concept_lm_loss_is_unchanged_by_the_aux_terms(concept_aux):
  """ConceptLM at equal params (the fixture checks the init too): `loss` is NTP alone."""
  _, _, _, ((metrics, _), _, plain) = concept_aux
  assert float(metrics["loss"]) == float(plain["loss"])
  assert float(metrics["total_loss"]) > float(plain["total_loss"])


# ------------------------------------------------------------------ FLOPs and configs
def test_flops_count_the_heads_by_hand():
  cfg = nitp_cfg("mtp.enabled=True")
  m, seq = cfg.model, cfg.data.seq_len
  d, h, kv, hd, f, v = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
  projector = 2 * (d * 4 * d + d * 4 * d + 4 * d * d)
  block = 2 * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f) + 4 * h * hd * (seq + 1) / 2  # full causal
  mtp = 2 * 2 * d * d + block + 2 * d * v
  assert flops.flops_per_token(cfg, seq) - flops.flops_per_token(m, seq) == pytest.approx(3 * (projector + mtp))
  cfg.nitp.projector = False
  assert flops.flops_per_token(cfg, seq) - flops.flops_per_token(m, seq) == pytest.approx(3 * mtp)


@pytest.mark.parametrize("depth,k", [(16, 3), (24, 5), (28, 6), (4, 1), (2, 1)])
def test_default_target_layer_is_a_fifth_of_depth(depth, k):
  assert nitp_layer(load_config(TINY_NITP, [f"model.num_layers={depth}"])) == k


@pytest.mark.parametrize("path,field,value,words", [
    (TINY_NITP, "nitp.loss", "l1", "not one of"),
    (TINY_NITP, "nitp.alignment", "previous", "not one of"),
    (TINY_NITP, "nitp.source", "embedding", "not one of"),
    (TINY_NITP, "nitp.layer", 3, "model.num_layers=2"),
    (TINY_NITP, "nitp.layer", -1, "not a layer"),
    (TINY_NITP, "nitp.weight", -0.5, "must be >= 0"),
    (TINY_NITP, "mtp.weight", -1.0, "must be >= 0"),
    (TINY_NCP, "nitp.layer", 3, "model.encoder_layers=2"),
])
def test_bad_settings_name_the_field(path, field, value, words):
  cfg = load_config(path, TINY_OVERRIDES + ["nitp.enabled=True", "mtp.enabled=True"])
  section, name = field.split(".")
  cfg[section][name] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
    validate(cfg)
  assert words in str(e.value)


def test_tst_with_nitp_and_mtp():
  """TST phase 1 scores NITP over bags (bag j predicts the shallow state of bag j+1) and has no MTP;
  phase 2 is the plain objective with both; phase-1 FLOPs count the projector but not the MTP block."""
  from latent_jax.objectives import tst_objective
  from latent_jax.ops import superposition as sup
  from latent_jax.train import phases
  cfg = load_config(os.path.join(ROOT, "configs", "tiny_tst.py"),
                    TINY_OVERRIDES + ["nitp.enabled=True", "mtp.enabled=True", "tst.s=2"])
  model = build_model(cfg, nnx.Rngs(0))
  batch = packed_batch(t=12)
  total, metrics = tst_objective(model, batch, cfg)
  assert "mtp_loss" not in metrics and "nitp_loss" in metrics
  np.testing.assert_allclose(total, metrics["loss"] + cfg.nitp.weight * metrics["nitp_loss"], rtol=1e-6)
  s = cfg.tst.s
  bags = sup.superpose_embeddings(model.embed_tokens(batch["inputs"]), s)
  bag_seg = sup.bag_segments(batch["segment_ids"], s)
  out = model(None, bag_seg, sup.bag_positions(batch["segment_ids"], batch["positions"], s, "bag"),
              logits=False, embeddings=bags)
  bag_targets = np.asarray(sup.next_bag_targets(batch["targets"], s)[..., 0])
  want = ref_nitp(np.asarray(model.nitp_projector(out.hidden)), np.asarray(out.aux["nitp_target_state"]),
                  bag_targets, np.asarray(bag_seg), "cosine", "next")
  np.testing.assert_allclose(metrics["nitp_loss"], want, rtol=1e-5)

  phase1, phase2 = phases.plan(cfg)
  _, metrics2 = phase2.objective(model, batch, cfg)
  assert {"nitp_loss", "mtp_loss"} <= set(metrics2)
  no_mtp = cfg.copy_and_resolve_references()
  no_mtp.mtp.enabled = False
  rows, positions = cfg.data.batch_size, cfg.data.seq_len
  assert phase1.flops_per_step == rows * positions * flops.flops_per_token(no_mtp, positions)
  assert phase2.flops_per_step > phase1.flops_per_step
