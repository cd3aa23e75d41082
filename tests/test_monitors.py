"""train.monitors: the probe's per-layer attention statistics and the step's per-group norms, against NumPy.

Both models are recomputed in NumPy from their weights alone (tests/numpy_ref.py, tests/ncp_ref.py),
each layer's q and k from its input there, with layer-wise and per-head QK-norm.
"""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import ncp_ref
import numpy_ref as ref
from conftest import ROOT, TINY_OVERRIDES, ragged_batch
from latent_jax import load_config, sharding
from latent_jax.nn import abstract_model, axes_tree, build_model
from latent_jax.ops import monitors as M
from latent_jax.train import monitors
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer

NO_WINDOW = 2**30


def config(name, qk_norm):
  path = os.path.join(ROOT, "configs", "tiny.py" if name == "baseline" else "tiny_ncp.py")
  return load_config(path, [*TINY_OVERRIDES, f"model.qk_norm={qk_norm}"])


def setup(cfg):
  """(graphdef, state shardings, params: the init with every entry scaled by its own factor in [0.5, 1.5], so
  that heads and norm scales differ), on one device's mesh."""
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  params = nnx.to_pure_dict(nnx.state(build_model(cfg, nnx.Rngs(0))))
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(1)
  params = jax.tree.unflatten(tree, [np.asarray(p) * rng.uniform(0.5, 1.5, p.shape).astype(np.float32) for p in leaves])
  return graphdef, shardings, mesh, params


# ------------------------------------------------------------------------------------------ NumPy
def numpy_stats(q, k, pos, seg, window):
  """(largest logit per head [H], largest q norm per head, largest k norm per KV head), a head at a time."""
  h, kh, d = q.shape[2], k.shape[2], q.shape[3]
  qp, kp = pos[:, :, None], pos[:, None, :]
  mask = (kp <= qp) & (qp - kp < window) & (seg[:, :, None] == seg[:, None, :])
  logits = [np.where(mask, np.einsum("btd,bsd->bts", q[:, :, i], k[:, :, i // (h // kh)]) / np.sqrt(d), -np.inf).max()
            for i in range(h)]
  return np.array(logits), np.linalg.norm(q, axis=-1).max((0, 1)), np.linalg.norm(k, axis=-1).max((0, 1))


def numpy_block(p, m, x, pos, seg, window, record):
  """A post-norm block (tests/ncp_ref.py's, with either QK-norm) that appends its numpy_stats to `record`."""
  q, k, v = ref.qkv(x, p["attn"], m, pos)
  record.append(numpy_stats(q, k, pos, seg, window))
  att = ref.attention(q, k, v, pos, seg, window).reshape(*x.shape[:2], -1) @ p["attn"]["o"]
  x = x + ref.rms_norm(att, p["attn_norm"]["scale"], m.norm_eps)
  mlp = ref.swiglu(x, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])
  return x + ref.rms_norm(mlp, p["mlp_norm"]["scale"], m.norm_eps)


# ------------------------------------------------------------------------------------------ tests
def test_qk_stats_against_numpy():
  """Per-head maxima over the visible pairs, GQA, a window and documents; whole and in query blocks."""
  rng = np.random.default_rng(0)
  b, t, h, kh, d = 2, 20, 4, 2, 8
  q, k = rng.normal(size=(b, t, h, d)).astype(np.float32), rng.normal(size=(b, t, kh, d)).astype(np.float32)
  batch = ragged_batch(b, t, 50, seed=3)
  pos, seg = np.asarray(batch["positions"]), np.asarray(batch["segment_ids"])
  want = numpy_stats(q, k, pos, seg, 5)
  for block in (512, 8):  # 8: three blocks of queries, the last padded
    got = M.qk_stats(q, k, pos, pos, seg, seg, 5, block=block)
    for name, w in zip(("logit_max", "q_norm_max", "k_norm_max"), want):
      np.testing.assert_allclose(got[name], w, rtol=1e-5, err_msg=f"{name}, block {block}")


@pytest.mark.parametrize("qk_norm", ["layer", "head"])
def test_probe_baseline_against_numpy(qk_norm):
  """Every layer, documents packed in rows and padding (tests/conftest.py's ragged_batch), every row probed."""
  cfg = config("baseline", qk_norm)
  m = cfg.model
  graphdef, shardings, mesh, params = setup(cfg)
  batch = ragged_batch(cfg.data.batch_size, cfg.data.seq_len, m.vocab_size)
  got = monitors.make_probe(graphdef, cfg, shardings, mesh, rows=cfg.data.batch_size)(params, batch)
  inputs, pos, seg = (np.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids"))
  x, want = params["embed"][inputs], []
  for i, window in enumerate(ncp_ref.windows(m.num_layers, m.window, m.full_attention_every)):
    x = numpy_block(ncp_ref._index(params["blocks"]["blocks"], i), m, x, pos, seg, window, want)
  check(got, want, [f"layer{i}" for i in range(m.num_layers)])


@pytest.mark.parametrize("qk_norm", ["layer", "head"])
def test_probe_concept_against_numpy(qk_norm, monkeypatch):
  """Every layer of ConceptLM's encoder, concept module and decoder, named after its module (one document
  a row, as tests/ncp_ref.py's concept_lm takes it), on the probe's own choice of rows."""
  cfg = config("concept", qk_norm)
  m = cfg.model
  graphdef, shardings, mesh, params = setup(cfg)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(2).integers(0, m.vocab_size, size=(b, t)).astype(np.int32)
  batch = {"inputs": tokens, "targets": tokens, "segment_ids": np.zeros((b, t), np.int32),
           "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}
  got = monitors.make_probe(graphdef, cfg, shardings, mesh)(params, batch)
  n = monitors.probe_rows(b, mesh)
  want = []
  monkeypatch.setattr(ncp_ref, "block", lambda p, m, x, pos, seg, window: numpy_block(p, m, x, pos, seg, window, want))
  ncp_ref.concept_lm(params, m, tokens[::b // n][:n])  # the probe's rows: evenly spaced
  modules = [("encoder", m.encoder_layers), ("concept", m.concept_layers), ("decoder", m.decoder_layers)]
  check(got, want, [f"{module}/layer{i}" for module, depth in modules for i in range(depth)])  # in the forward's order


def check(got, want, layers):
  """The probe's metrics `got` are those of the NumPy statistics `want` of `layers`, and no others."""
  assert len(got) == 4 * len(layers)
  for name, (logits, q_norms, k_norms) in zip(layers, want, strict=True):
    np.testing.assert_allclose(got[f"attn_logit_max/{name}"], logits.max(), rtol=1e-4, err_msg=name)
    assert got[f"attn_logit_head/{name}"] == np.argmax(logits), name
    np.testing.assert_allclose(got[f"q_norm_max/{name}"], q_norms.max(), rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(got[f"k_norm_max/{name}"], k_norms.max(), rtol=1e-4, err_msg=name)


def test_step_group_norms():
  """grad_norm/{group} partition grad_norm; update_norm/{group} are the norms of each group's change of params."""
  cfg = config("baseline", "layer")
  cfg.optim.warmup_steps = 0  # the first step's learning rate is not 0
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  before = jax.tree_util.tree_flatten_with_path(jax.device_get(state["params"]))[0]
  batch = ragged_batch(cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size)
  state, metrics = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, monitors=True)(state, batch)
  metrics = jax.device_get(metrics)
  groups = {"attn", "mlp", "norms", "embed", "lm_head"}
  assert {k.split("/", 1)[1] for k in metrics if k.startswith("grad_norm/")} == groups
  assert {k.split("/", 1)[1] for k in metrics if k.startswith("update_norm/")} == groups
  np.testing.assert_allclose(sum(v ** 2 for k, v in metrics.items() if k.startswith("grad_norm/")),
                             metrics["grad_norm"] ** 2, rtol=1e-4)
  after = jax.tree.leaves(jax.device_get(state["params"]))
  squares = {}
  for (path, old), new in zip(before, after):
    group = M.param_group(jax.tree_util.keystr(path, simple=True, separator="/"))
    squares[group] = squares.get(group, 0.0) + np.sum((np.float64(new) - old) ** 2)
  for group, s in squares.items():
    np.testing.assert_allclose(metrics[f"update_norm/{group}"], np.sqrt(s), rtol=1e-3, atol=1e-7, err_msg=group)


def test_run_logs_every_monitor_at_each_logged_step(tmp_path, corpus_dir):
  """Through the train loop: each logged row (the cadence's and the last step's) has every group norm and
  the probe's per-layer statistics, finite, and the group norms square-sum to grad_norm."""
  from latent_jax.train.loop import train
  extra = ["train.steps=3", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=100",
           f"data.source={corpus_dir}"]
  train(load_config(os.path.join(ROOT, "configs", "tiny.py"), TINY_OVERRIDES + extra), str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [2, 3]
  for r in rows:
    names = {k for k in r if k.startswith(("grad_norm/", "update_norm/"))}
    assert names == {f"{n}/{g}" for n in ("grad_norm", "update_norm") for g in ("attn", "mlp", "norms", "embed", "lm_head")}
    assert {f"{n}/layer{i}" for n in ("attn_logit_max", "attn_logit_head", "q_norm_max", "k_norm_max")
            for i in range(2)} <= set(r)
    assert all(np.isfinite(r[k]) for k in r if "/" in k)
    assert sum(r[f"grad_norm/{g}"] ** 2 for g in ("attn", "mlp", "norms", "embed", "lm_head")) == pytest.approx(
        r["grad_norm"] ** 2, rel=1e-4)


def test_concept_groups():
  """ConceptLM's groups: each module's attn, mlp, norms and IRC/CRC weights, its concept heads and codebook."""
  _, abstract = abstract_model(config("concept", "layer"))
  names = jax.eval_shape(lambda p: M.monitor_metrics(p, p), nnx.to_pure_dict(abstract))
  want = {f"{module}/{kind}" for module in ("encoder", "concept", "decoder") for kind in ("attn", "mlp", "norms", "residual")}
  want |= {"embed", "lm_head", "norms", "heads", "codebook"}
  assert set(names) == {f"{kind}/{group}" for kind in ("grad_norm", "update_norm") for group in want}


def test_param_group():
  assert M.param_group("blocks/blocks/attn/q") == "attn"
  assert M.param_group("blocks/blocks/attn/q_norm/scale") == "norms"
  assert M.param_group("blocks/blocks/attn/q_lora_a") == "attn"
  assert M.param_group("final_norm/scale") == "norms"
  assert M.param_group("encoder/routes/0/w1") == "encoder/residual"
  assert M.param_group("decoder/blocks/mlp/up") == "decoder/mlp"
  assert M.param_group("mtp/block/attn/q") == "mtp"
  assert M.param_group("codebook") == "codebook"
