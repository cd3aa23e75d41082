"""model.moe's monitors (issue 37.5, docs/watching.md): per sparse layer i, moe_load_max/i, router_entropy/i,
moe_dropped/i (with a capacity) and router_bias_spread/i (sigmoid router), against a NumPy recomputation of a
tiny MoE from its weights alone (tests/numpy_ref.py's attention, the sparse MLP written out here), through
the train step with two microbatches; and the train loop's rows and progress line."""
import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

import ncp_ref
import numpy_ref as ref
from conftest import ROOT, TINY_OVERRIDES, ragged_batch
from latent_jax import load_config, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import monitors
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer
from latent_jax.train.progress import describe

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=16"]


def moe_cfg(*overrides):
  return load_config(os.path.join(ROOT, "configs", "tiny_moe.py"), [*TINY_OVERRIDES, *MOE, *overrides])


# ------------------------------------------------------------------------------------------ NumPy
def numpy_sparse_mlp(p, m, x, record):
  """The sparse MLP on x [B, T, d] from its definition (docs/moe.md), token by token; appends the layer's
  (tokens per expert [E], mean routing entropy, dropped (token, expert) pairs / all pairs) to `record`."""
  e, k, cf = m.moe.num_experts, m.moe.top_k, m.moe.capacity_factor
  rows = x.reshape(-1, x.shape[-1])
  logits = rows @ p["router"]
  if m.moe.router == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(scores, chosen, -1)
  else:
    scores = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-(scores + p["router_bias"]), axis=-1, kind="stable")[:, :k]  # the bias selects only
    gates = np.take_along_axis(scores, chosen, -1)
    gates = gates / gates.sum(-1, keepdims=True)
  capacity = math.ceil(cf * len(rows) * k / e) if cf > 0 else len(rows) * k
  taken, kept, y = np.zeros(e, int), 0, np.zeros_like(rows)
  for n in range(len(rows)):  # earlier tokens (and a token's earlier choices) first
    for j in range(k):
      ex = chosen[n, j]
      taken[ex] += 1
      if taken[ex] <= capacity:
        kept += 1
        y[n] += gates[n, j] * ref.swiglu(rows[n], p["gate"][ex], p["up"][ex], p["down"][ex])
  dist = scores / scores.sum(-1, keepdims=True)
  entropy = np.mean(-np.sum(dist * np.log(dist), -1))
  record.append((np.bincount(chosen.reshape(-1), minlength=e), entropy, 1 - kept / chosen.size))
  return y.reshape(x.shape)


def numpy_moe(params, m, batch, record):
  """The all-sparse post-norm baseline's layers (as tests/test_monitors.py's numpy_block, the MLP sparse)."""
  inputs, pos, seg = (np.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids"))
  x = params["embed"][inputs].astype(np.float64)
  for i, window in enumerate(ncp_ref.windows(m.num_layers, m.window, m.full_attention_every)):
    p = ncp_ref._index(params["blocks"]["sparse_blocks"], i)
    q, k, v = ref.qkv(x, p["attn"], m, pos)
    att = ref.attention(q, k, v, pos, seg, window).reshape(*x.shape[:2], -1) @ p["attn"]["o"]
    x = x + ref.rms_norm(att, p["attn_norm"]["scale"], m.norm_eps)
    x = x + ref.rms_norm(numpy_sparse_mlp(p["mlp"], m, x, record), p["mlp_norm"]["scale"], m.norm_eps)


def setup(cfg):
  """(graphdef, optimiser, state shardings, mesh, state): the init, each entry scaled by its own factor in [0.5, 1.5]
  and the router biases random, so that experts and layers differ."""
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  rng = np.random.default_rng(1)
  scale = lambda path, p: (rng.normal(0, 0.05, p.shape) if steps.is_router_bias(path) else
                           np.asarray(p) * rng.uniform(0.5, 1.5, p.shape)).astype(np.float32)
  state["params"] = jax.tree_util.tree_map_with_path(scale, jax.device_get(state["params"]))
  return graphdef, tx, shardings, mesh, state


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("router,capacity", [("sigmoid", 0.75), pytest.param("softmax", 0.0, marks=pytest.mark.slow)])
def test_moe_monitors_against_numpy(router, capacity):
  """Two sparse layers, two microbatches (each routed, and with a capacity dropped, on its own): the step's
  per-layer load max, entropy and dropped fraction, and the bias spread read from the params."""
  cfg = moe_cfg(f"model.moe.router={router}", f"model.moe.capacity_factor={capacity}", "train.microbatches=2",
                "data.batch_size=4", "data.seq_len=16")
  m = cfg.model
  graphdef, tx, shardings, mesh, state = setup(cfg)
  params = state["params"]
  batch = ragged_batch(cfg.data.batch_size, cfg.data.seq_len, m.vocab_size)
  _, got = steps.make_train_step(graphdef, tx, cfg, shardings, mesh)(state, batch)
  got = {k: float(v) for k, v in jax.device_get(got).items()}
  halves = []
  for i in range(2):  # train/step.py's split_microbatches: rows i, i + 2, ...
    record = []
    numpy_moe(params, m, {k: np.asarray(v)[i::2] for k, v in batch.items()}, record)
    halves.append(record)
  layers = m.num_layers
  for i in range(layers):
    load = halves[0][i][0] + halves[1][i][0]  # tokens per expert add up over microbatches
    np.testing.assert_allclose(got[f"moe_load_max/{i}"], load.max() / load.mean(), rtol=1e-5, err_msg=i)
    np.testing.assert_allclose(got[f"router_entropy/{i}"], (halves[0][i][1] + halves[1][i][1]) / 2, rtol=1e-4)
    if capacity:
      dropped = (halves[0][i][2] + halves[1][i][2]) / 2
      assert dropped > 0, "the test's capacity should drop pairs"
      np.testing.assert_allclose(got[f"moe_dropped/{i}"], dropped, rtol=1e-4, atol=1e-7, err_msg=i)
  mean = lambda name: np.mean([got[f"{name}/{i}"] for i in range(layers)])  # the means over layers stay
  np.testing.assert_allclose(got["router_entropy"], mean("router_entropy"), rtol=1e-5)
  assert ("moe_dropped/0" in got) == ("moe_dropped" in got) == bool(capacity)
  assert f"moe_load_max/{layers}" not in got and f"router_entropy/{layers}" not in got
  bias = monitors.make_router_bias_metrics(shardings["params"], mesh)(params)
  if router == "sigmoid":
    want = np.ptp(np.asarray(params["blocks"]["sparse_blocks"]["mlp"]["router_bias"]), axis=-1)
    assert set(bias) == {f"router_bias_spread/{i}" for i in range(layers)}
    np.testing.assert_allclose([bias[f"router_bias_spread/{i}"] for i in range(layers)], want, rtol=1e-6)
  else:
    assert bias == {}


def test_router_bias_spread_follows_the_forward_order_in_concept_lm():
  """ConceptLM: the encoder's, concept module's and decoder's layers in the forward's order (as moe_load_max/i)."""
  cfg = load_config(os.path.join(ROOT, "configs", "tiny_ncp.py"),
                    [*TINY_OVERRIDES, "model.moe.enabled=True", *MOE, "model.moe.router=sigmoid"])
  params = nnx.to_pure_dict(abstract_model(cfg)[1])  # shapes only: the biases are set below
  rng, want = np.random.default_rng(0), []
  for module in ("encoder", "concept", "decoder"):
    mlp = params[module]["blocks"]["mlp"]
    mlp["router_bias"] = rng.normal(size=mlp["router_bias"].shape).astype(np.float32) * (1 + len(want))
    want += list(np.ptp(mlp["router_bias"], axis=-1))
  got = monitors.router_bias_metrics(params)
  np.testing.assert_allclose([float(got[f"router_bias_spread/{i}"]) for i in range(len(want))], want, rtol=1e-6)
  assert len(got) == len(want)


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_run_logs_the_moe_monitors_at_each_logged_step(tmp_path, corpus_dir, capsys):
  """Through the train loop (sigmoid router, a capacity, a dense first layer): each logged row has every sparse
  layer's monitors, finite; the last row's bias spread is the saved model's; the plain progress line shows the
  worst layer's load and the dropped pairs."""
  from latent_jax.infer import load
  from latent_jax.train.loop import train
  cfg = moe_cfg("model.num_layers=3", "model.moe.first_dense=1", "model.moe.router=sigmoid",
                "model.moe.capacity_factor=1.0", "train.steps=3", "train.log_every=2", "train.eval_every=0",
                "train.checkpoint_every=100", "train.monitors=False", f"data.source={corpus_dir}")
  train(cfg, str(tmp_path / "run"))
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [2, 3]
  names = ("moe_load_max", "router_entropy", "moe_dropped", "router_bias_spread")
  for r in rows:
    assert {k for k in r if k.startswith(tuple(f"{n}/" for n in names))} == {f"{n}/{i}" for n in names for i in (0, 1)}
    assert all(np.isfinite(r[k]) for k in r if k.startswith(names))
    assert all(r[f"moe_load_max/{i}"] >= 1 and 0 < r[f"router_entropy/{i}"] <= math.log(4) + 1e-6 for i in (0, 1))
  bias = np.asarray(load.load_model(str(tmp_path / "run"))[0].blocks.sparse_blocks.mlp.router_bias[...])
  np.testing.assert_allclose([rows[-1][f"router_bias_spread/{i}"] for i in (0, 1)], np.ptp(bias, axis=-1), rtol=1e-6)
  assert np.ptp(bias) > 0
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2/3:")]
  worst = max((0, 1), key=lambda i: rows[0][f"moe_load_max/{i}"])
  assert len(lines) == 1 and f"load max {rows[0][f'moe_load_max/{worst}']:.3g} (layer {worst})" in lines[0], lines
  assert "dropped " in lines[0]


def test_progress_shows_the_worst_layer():
  row = {"loss": 3.0, "tokens_per_s": 10.0, "mfu": 0.1, "moe_load_max/0": 1.5, "moe_load_max/1": 2.25,
         "moe_dropped": 0.031}
  shown = describe(row, None)
  assert shown["load max"] == "2.25 (layer 1)" and shown["dropped"] == "3.1%"
  assert "load max" not in describe({"loss": 3.0, "tokens_per_s": 10.0, "mfu": 0.1}, None)
