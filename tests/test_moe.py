"""Mixture of experts (model.moe, docs/moe.md): the pure functions of ops/moe.py against NumPy, the sparse MLP
against the all-experts computation, the models and the train loop with it, and its config errors."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import ConfigError, build_model, load_config
from latent_jax.nn.layers import BlockStack, layer_segments
from latent_jax.ops import moe

TINY_MOE = f"{ROOT}/configs/tiny_moe.py"
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=16"]


def moe_cfg(*overrides):
  return load_config(TINY_MOE, [*TINY_OVERRIDES, *MOE, *overrides])


def np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_silu(x):
  return x / (1 + np.exp(-x))


def random_routing(n=24, e=6, k=2, seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, e)).astype(np.float32)
  return logits, np.argsort(-rng.normal(size=(n, e)), axis=-1)[:, :k].astype(np.int32)


# ------------------------------------------------------------------------------------------ pure functions
def test_router_scores_top_k_and_combine_weights_match_numpy():
  logits, _ = random_routing()
  bias = np.linspace(-1, 1, 6).astype(np.float32)
  soft, sig = np_softmax(logits), 1 / (1 + np.exp(-logits))
  np.testing.assert_allclose(moe.router_scores(jnp.asarray(logits), "softmax"), soft, rtol=1e-5)
  np.testing.assert_allclose(moe.router_scores(jnp.asarray(logits), "sigmoid"), sig, rtol=1e-5)
  for scores, b in ((soft, None), (sig, bias)):
    chosen = np.argsort(-(scores + (0 if b is None else b)), axis=-1)[:, :3]
    got = np.asarray(moe.top_k_experts(jnp.asarray(scores), 3, None if b is None else jnp.asarray(b)))
    np.testing.assert_array_equal(got, chosen)  # the bias selects (DeepSeek-V3 Eq. 16)
  experts = np.argsort(-soft, axis=-1)[:, :2]
  picked = np.take_along_axis(soft, experts, -1)
  np.testing.assert_allclose(moe.combine_weights(jnp.asarray(soft), jnp.asarray(experts), "softmax", False),
                             picked, rtol=1e-6)  # OLMoE: no renormalisation
  np.testing.assert_allclose(moe.combine_weights(jnp.asarray(soft), jnp.asarray(experts), "softmax", True),
                             picked / picked.sum(-1, keepdims=True), rtol=1e-6)
  picked = np.take_along_axis(sig, experts, -1)  # sigmoid: the chosen scores (not the biased ones), normalised
  np.testing.assert_allclose(moe.combine_weights(jnp.asarray(sig), jnp.asarray(experts), "sigmoid", False),
                             picked / picked.sum(-1, keepdims=True), rtol=1e-6)


def test_balance_losses_match_numpy():
  logits, experts = random_routing()
  n, e = logits.shape
  scores = np_softmax(logits)
  f = np.array([(experts == i).sum() for i in range(e)]) / n           # fraction of tokens choosing i (sums to k)
  np.testing.assert_allclose(moe.load_balance_loss(jnp.asarray(scores), jnp.asarray(experts), e),
                             e * np.sum(f * scores.mean(0)), rtol=1e-5)
  np.testing.assert_allclose(moe.expert_load(jnp.asarray(experts), e), f * n)
  sig = 1 / (1 + np.exp(-logits))  # sigmoid scores: P_e from each token's scores normalised (DeepSeek-V3 Eq. 19)
  np.testing.assert_allclose(moe.load_balance_loss(jnp.asarray(sig), jnp.asarray(experts), e),
                             e * np.sum(f * (sig / sig.sum(-1, keepdims=True)).mean(0)), rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(moe.router_z_loss(jnp.asarray(logits)), lse ** 2, rtol=1e-5)
  # Uniform scores and perfectly balanced choices give k (transformers' OLMoE form).
  balanced = np.stack([np.arange(n) % e, (np.arange(n) + 1) % e], -1)
  assert float(moe.load_balance_loss(jnp.full((n, e), 1 / e), jnp.asarray(balanced), e)) == pytest.approx(2.0)


def test_bias_update_capacity_and_sparse_layers():
  load = np.array([[3.0, 1.0, 2.0, 2.0], [0.0, 4.0, 4.0, 0.0]], np.float32)
  bias = np.full((2, 4), 0.5, np.float32)
  np.testing.assert_allclose(moe.bias_update(jnp.asarray(bias), jnp.asarray(load), 0.1),
                             bias + 0.1 * np.sign(load.mean(-1, keepdims=True) - load))
  assert moe.expert_capacity(100, 2, 8, 1.25) == math.ceil(1.25 * 100 * 2 / 8)
  assert moe.expert_capacity(100, 2, 8, 0.0) == 0
  assert moe.sparse_layers(6, 1, 0) == (True,) * 6
  assert moe.sparse_layers(6, 2, 1) == (False, True, False, True, False, True)
  assert moe.sparse_layers(5, 2, 0) == (True, False, True, False, True)
  # How the stacks are scanned: runs of one kind, split at the NITP tap; groups of `every` layers repeated.
  assert layer_segments((False, True, True, True), 2) == [(0, (False,), 1), (1, (True,), 1), (2, (True,), 2)]
  assert layer_segments(moe.sparse_layers(8, 2, 1), 0, 2) == [(0, (False, True), 4)]
  assert layer_segments(moe.sparse_layers(7, 2, 0), 0, 2) == [(0, (True, False), 3), (6, (True,), 1)]
  assert layer_segments(moe.sparse_layers(9, 3, 0), 0, 3) == [(0, (True, False, False), 3)]
  assert layer_segments(moe.sparse_layers(9, 3, 0), 4, 3) == [(0, (True, False, False), 1), (3, (True,), 1),
                                                              (4, (False, False, True), 1), (7, (False,), 2)]


def test_tile_layout_puts_one_expert_in_each_tile():
  _, experts = random_routing(n=40, e=5, k=2, seed=3)
  order, sizes = moe.sort_by_expert(jnp.asarray(experts), 5)
  slot, tile_expert = moe.tile_layout(sizes, 80, 8)
  slot, tile_expert = np.asarray(slot), np.asarray(tile_expert)
  sorted_experts = experts.reshape(-1)[np.asarray(order)]
  assert len(set(slot)) == 80 and slot.max() < len(tile_expert) * 8
  np.testing.assert_array_equal(tile_expert[slot // 8], sorted_experts)


# ------------------------------------------------------------------------------------------ the sparse MLP
def expert_weights(e=6, d=8, f=12, seed=1):
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.3)
  return w(24, d), w(e, d, f), w(e, d, f), w(e, f, d)


def all_experts(x, experts, weights, w_gate, w_up, w_down):
  """The reference: every expert on every token ([E, N, d]), weighted by a dense [N, E] gate (0 off the top k)."""
  gates = jnp.zeros((x.shape[0], w_gate.shape[0])).at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
  outs = jnp.einsum("enf,efd->end", jax.nn.silu(jnp.einsum("nd,edf->enf", x, w_gate)) *
                    jnp.einsum("nd,edf->enf", x, w_up), w_down)
  return jnp.einsum("end,ne->nd", outs, gates)


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
def test_sparse_mlp_equals_all_experts_values_and_gradients(impl):
  logits, experts = random_routing()
  x, *w = expert_weights()
  weights = jnp.asarray(np_softmax(logits)[np.arange(24)[:, None], experts])
  experts = jnp.asarray(experts)
  y, dropped = moe.sparse_swiglu(x, experts, weights, *w, impl=impl)
  np.testing.assert_allclose(y, all_experts(x, experts, weights, *w), rtol=1e-5, atol=1e-6)
  assert float(dropped) == 0.0
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(a[0], experts, a[1], *a[2:]) if fn is all_experts
                                               else fn(a[0], experts, a[1], *a[2:], impl=impl)[0]))
  grads = jax.grad(loss(moe.sparse_swiglu), argnums=range(5))(x, weights, *w)
  ref = jax.grad(loss(all_experts), argnums=range(5))(x, weights, *w)
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_auto_picks_for_the_backend_traced_for():
  """impl=auto: the tiled layout on CPU, ragged_dot for the devices a plan compiles for (a TPU slice)."""
  import pallas_kernels
  logits, experts = random_routing()
  x, *w = expert_weights()
  trace = lambda: str(jax.make_jaxpr(lambda x: moe.sparse_swiglu(x, jnp.asarray(experts), jnp.ones(experts.shape),
                                                                 *w)[0])(x))
  assert ("ragged_dot" in trace()) == (jax.default_backend() != "cpu")
  with pallas_kernels.target_backend("tpu"):
    assert "ragged_dot" in trace()
  with pallas_kernels.target_backend("cpu"):
    assert "ragged_dot" not in trace()


def test_all_experts_chosen_is_the_softmax_mixture():
  """top_k = E with the softmax router and no renormalisation: the softmax-weighted sum of all experts."""
  logits, _ = random_routing()
  x, *w = expert_weights()
  scores = moe.router_scores(jnp.asarray(logits), "softmax")
  experts = moe.top_k_experts(scores, 6)
  y, _ = moe.sparse_swiglu(x, experts, moe.combine_weights(scores, experts, "softmax", False), *w)
  xn, (g, u, dn), p = np.asarray(x), map(np.asarray, w), np.asarray(scores)
  ref = sum(p[:, e:e + 1] * ((np_silu(xn @ g[e]) * (xn @ u[e])) @ dn[e]) for e in range(6))
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_capacity_drops_the_late_pairs_and_counts_them():
  x, *w = expert_weights(e=3)
  rng = np.random.default_rng(2)
  experts = np.stack([np.zeros(24, int), rng.integers(1, 3, 24)], -1).astype(np.int32)  # expert 0 on every token
  weights = jnp.asarray(rng.uniform(0.2, 1, (24, 2)).astype(np.float32))
  capacity = moe.expert_capacity(24, 2, 3, 1.0)  # 16 rows per expert
  y, dropped = moe.sparse_swiglu(x, jnp.asarray(experts), weights, *w, capacity=capacity)
  keep = np.zeros((24, 2), bool)  # first come first served in (token, slot) order, per expert
  for e in range(3):
    pairs = np.argwhere(experts == e)
    keep[tuple(pairs[:capacity].T)] = True
  assert float(dropped) == pytest.approx(1 - keep.mean()) and keep.mean() < 1
  np.testing.assert_allclose(y, all_experts(x, jnp.asarray(experts), weights * keep, *w), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ models
def test_dense_models_keep_their_parameters():
  params = nnx.to_pure_dict(nnx.state(build_model(load_config(TINY, TINY_OVERRIDES).model, nnx.Rngs(0))))
  assert set(params["blocks"]) == {"blocks"} and "gate" in params["blocks"]["blocks"]["mlp"]


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_moe_baseline_stacks_and_statistics():
  cfg = moe_cfg("model.num_layers=4", "model.moe.first_dense=1", "model.moe.shared_experts=1")
  model = build_model(cfg.model, nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model))["blocks"]
  assert params["blocks"]["mlp"]["gate"].shape == (1, 32, 64)                 # the dense first layer
  assert params["sparse_blocks"]["mlp"]["gate"].shape == (3, 4, 32, 16)       # 3 sparse layers of 4 experts
  assert params["sparse_blocks"]["mlp"]["shared_gate"].shape == (3, 32, 16)
  axes = nnx.to_pure_dict(nnx.map_state(lambda _, v: v.get_metadata().get("axes"), nnx.state(model, nnx.Param)))
  assert axes["blocks"]["sparse_blocks"]["mlp"]["gate"] == ("expert", "embed", "mlp")
  assert axes["blocks"]["sparse_blocks"]["mlp"]["router"] == ("embed", "expert")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 16)), jnp.int32)
  forward = nnx.jit(lambda m, t: m(t))
  out = forward(model, tokens)
  assert out.aux["moe"]["load"].shape == (3, 4) and np.all(np.asarray(out.aux["moe"]["load"]).sum(-1) == 2 * 16 * 2)
  assert not hasattr(model.blocks, "moe_stats")  # popped: nothing traced stays on the module
  # The NITP tap splits a run; the result is the same.
  model.nitp_layer = 2
  tapped = forward(model, tokens)
  np.testing.assert_allclose(tapped.logits, out.logits, rtol=1e-5, atol=1e-5)
  assert tapped.aux["nitp_target_state"].shape == (2, 16, 32)


@pytest.mark.parametrize("every,first_dense,tap", [(2, 1, 0), (2, 0, 3), pytest.param(1, 2, 0, marks=pytest.mark.slow)])
def test_scanned_segments_equal_the_layers_one_by_one(every, first_dense, tap):
  from latent_jax.ops.transformer import window_list
  cfg = moe_cfg("model.num_layers=6", f"model.moe.every={every}", f"model.moe.first_dense={first_dense}")
  model = build_model(cfg.model, nnx.Rngs(0))
  model.nitp_layer = tap
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 16)), jnp.int32)
  positions, segments = jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.zeros((2, 16), jnp.int32)
  out = model(tokens, segments, positions)
  stack, x, seen = model.blocks, model.embed_tokens(tokens), {False: 0, True: 0}
  for i, (kind, window) in enumerate(zip(stack.sparse, window_list(6, cfg.model.window, cfg.model.full_attention_every))):
    graphdef, state = nnx.split(stack.sparse_blocks if kind else stack.blocks)
    block = nnx.merge(graphdef, jax.tree.map(lambda v: v[seen[kind]], state))
    seen[kind] += 1
    x, _ = block(x, positions, segments, window)
    if i + 1 == tap:
      np.testing.assert_allclose(out.aux["nitp_target_state"], x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.aux["pre_norm"], x, rtol=1e-5, atol=1e-5)
  assert out.aux["moe"]["load"].shape == (sum(stack.sparse), 4)


def test_kv_cache_decoding_through_the_sparse_layers():
  cfg = moe_cfg("model.moe.first_dense=1", "model.moe.router=sigmoid")
  model = build_model(cfg.model, nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 320, (1, 10)), jnp.int32)
  full = nnx.jit(lambda m, t: m(t).logits)(model, tokens)
  decode = nnx.jit(lambda m, t, c, i: m(t, cache=c, cache_index=i))
  cache, steps = model.init_cache(1, 10), []
  for i in range(10):
    out = decode(model, tokens[:, i:i + 1], cache, jnp.int32(i))
    cache = out.cache
    steps.append(out.logits[:, 0])
  np.testing.assert_allclose(jnp.stack(steps, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_concept_lm_with_moe_builds_and_runs():
  cfg = load_config(f"{ROOT}/configs/tiny_ncp.py", [*TINY_OVERRIDES, "model.moe.enabled=True", *MOE,
                    "model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=2",
                    "model.concept_layers=1", "model.decoder_layers=1"])
  from latent_jax.objectives import ncp_objective
  model = build_model(cfg.model, nnx.Rngs(0))
  batch = {k: jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 32)), jnp.int32)
           for k in ("inputs", "targets")}
  batch.update(segment_ids=jnp.zeros((2, 32), jnp.int32), positions=jnp.broadcast_to(jnp.arange(32), (2, 32)))
  total, metrics = nnx.jit(lambda m, b: ncp_objective(m, b, cfg))(model, batch)
  assert np.isfinite(float(total)) and np.isfinite(float(metrics["moe_lb_loss"]))
  assert float(metrics["router_z_loss"]) > 0


def random_batch(rows=2, length=32, vocab=320):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (rows, length + 1)), jnp.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.zeros((rows, length), jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))}


@pytest.mark.parametrize("config,objective", [("tiny_nitp.py", "lm_objective"), ("tiny_tst.py", "tst_objective")])
def test_moe_composes_with_nitp_mtp_and_tst_bags(config, objective):
  from latent_jax import objectives
  cfg = load_config(f"{ROOT}/configs/{config}", [*TINY_OVERRIDES, "model.moe.enabled=True", *MOE,
                                                  "model.moe.first_dense=1", "mtp.enabled=True"])
  total, metrics = nnx.jit(lambda m, b: getattr(objectives, objective)(m, b, cfg))(build_model(cfg, nnx.Rngs(0)),
                                                                                   random_batch())
  assert np.isfinite(float(total))
  assert metrics["moe_load"].shape == (1, 4)  # one sparse layer of 4 experts
  tokens = 2 * 32 // (cfg.tst.s if "tst" in cfg else 1)  # TST phase 1: the bags route like tokens
  assert float(metrics["moe_load"].sum()) == 2 * tokens
  names = {"nitp_loss", "mtp_loss"} if "nitp" in config else set()
  assert names | {"moe_lb_loss", "router_z_loss", "router_entropy"} <= set(metrics)


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_tiny_moe_trains_and_logs_the_router_losses(tmp_path, corpus_dir):
  from latent_jax.train.loop import train
  cfg = moe_cfg("model.moe.router=sigmoid", "model.moe.capacity_factor=1.0", "train.steps=3",
                "optim.warmup_steps=1", "train.eval_every=0", f"data.source={corpus_dir}")
  rows = train(cfg, str(tmp_path / "run"))
  for name in ("loss", "moe_lb_loss", "router_z_loss", "moe_dropped", "router_entropy", "moe_load_max/0"):
    assert np.isfinite(rows[name]), name
  assert "moe_bias_probe" not in rows
  from latent_jax.nn import abstract_model, axes_tree
  from latent_jax.train import flops
  _, abstract = abstract_model(cfg)
  assert (rows["active_params"], rows["nonembedding_params"]) == flops.parameter_counts(abstract, axes_tree(abstract), cfg.model)
  assert rows["active_params"] < rows["nonembedding_params"]
  assert rows["flops"] == pytest.approx(3 * 8 * 32 * flops.flops_per_token(cfg, 32))  # the active FLOPs
  from latent_jax.infer import load
  model = load.load_model(str(tmp_path / "run"))[0]
  bias = np.asarray(model.blocks.sparse_blocks.mlp.router_bias[...])  # 3 steps of +-rate (or 0) from 0
  rate = cfg.model.moe.bias_update_rate
  assert np.any(bias != 0) and np.all(np.abs(bias) <= 3 * rate + 1e-9)
  np.testing.assert_allclose(bias / rate, np.round(bias / rate), atol=1e-4)


def test_flops_and_parameters_count_the_active_experts():
  """Against independent counts: the MoE's FLOPs are the dense model's with the active experts' width
  (top_k + shared) * expert_dim, plus the router's 2 d E per sparse layer (forward), x3 for training; the
  parameters counted by hand."""
  from latent_jax.nn import abstract_model, axes_tree
  from latent_jax.train import flops
  cfg = moe_cfg("model.num_layers=4", "model.moe.first_dense=1", "model.moe.every=2", "model.moe.shared_experts=1")
  d, e, f, k = 32, 4, 16, 2
  dense = load_config(TINY, [*TINY_OVERRIDES, "model.num_layers=4", f"model.mlp_dim={(k + 1) * f}"])
  sparse_layers = 2  # layers 1 and 3
  per_dense_layer = 3 * (2 * 3 * d * 64 - 2 * 3 * d * (k + 1) * f)  # layers 0 and 2 keep mlp_dim=64
  expected = flops.flops_per_token(dense.model, 32) + 3 * sparse_layers * 2 * d * e + 2 * per_dense_layer
  assert flops.flops_per_token(cfg.model, 32) == pytest.approx(expected)
  _, abstract = abstract_model(cfg.model)
  active, total = flops.parameter_counts(abstract, axes_tree(abstract), cfg.model)
  attention = d * 32 + 2 * d * 16 + 32 * d + 32 + 16 + 2 * d   # q, k, v, o, QK-norms (layer), two block norms
  experts, shared, router = 3 * e * d * f, 3 * d * f, d * e
  dense_mlp = 3 * d * 64
  assert total == 4 * attention + 2 * dense_mlp + 2 * (experts + shared + router) + d  # + the final norm
  assert active == total - 2 * experts * (1 - k / e)


@pytest.mark.parametrize("override,names", [
    ("model.moe.top_k=9", ["model.moe.top_k", "num_experts=8"]),
    ("model.moe.first_dense=4", ["model.moe.first_dense", "[0, 4)"]),
    ("model.moe.every=0", ["model.moe.every", "positive"]),
    ("model.moe.capacity_factor=-1.0", ["model.moe.capacity_factor", "dropless"]),
    ("model.moe.expert_dim=0", ["model.moe.expert_dim", "positive"]),
    ("model.moe.router=relu", ["model.moe.router", "'relu'"]),
])
def test_bad_moe_settings_are_config_errors(override, names, tmp_path, capsys):
  with pytest.raises(ConfigError) as e:
    load_config(TINY_MOE, [override])
  for name in names:
    assert name in str(e.value), (name, str(e.value))
  from test_cli_errors import check_one_error_line, run_main
  code, err = run_main("latent_jax.train.__main__", ["--config", TINY_MOE, f"--config.{override}",
                                                     "--workdir", str(tmp_path / "run")], capsys)
  check_one_error_line(code, err, names[:1])
  assert not (tmp_path / "run").exists()


def test_concept_lm_decoding_through_the_sparse_layers():
  """ConceptLM with model.moe, token by token from an empty cache (the concept module in its lax.cond): the
  full forward's logits at every position."""
  from test_generate_concept import random_model
  graphdef, params = random_model("model.moe.enabled=True", "model.moe.num_experts=4", "model.moe.top_k=2",
                                  "model.moe.expert_dim=8", "model.moe.router=sigmoid")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)))
  full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)(params, tokens)
  cache = nnx.merge(graphdef, params).init_cache(2, 9)
  step = jax.jit(lambda p, t, c, i: nnx.merge(graphdef, p)(t, cache=c, cache_index=i))
  for i in range(9):
    out = step(params, tokens[:, i:i + 1], cache, i)
    cache = out.cache
    np.testing.assert_allclose(out.logits[:, 0], full[:, i], rtol=1e-5, atol=1e-5, err_msg=f"position {i}")


def test_router_terms_add_up_over_microbatches():
  """Split as train/step.py splits a batch, each half divided by the whole batch's counts: the router z-loss,
  entropy and expert loads add up to the whole batch's (the load-balancing loss is the halves' mean: a
  statistic of each forward pass, docs/moe.md)."""
  from latent_jax.objectives import lm_objective
  cfg = moe_cfg()
  model, batch = build_model(cfg, nnx.Rngs(0)), random_batch(rows=4)
  run = nnx.jit(lambda m, b, counts: lm_objective(m, b, cfg, counts))
  _, whole = run(model, batch, None)
  halves = [run(model, jax.tree.map(lambda x: x[i::2], batch), whole["counts"])[1] for i in (0, 1)]
  for name in ("loss", "router_z_loss", "router_entropy", "moe_load"):
    np.testing.assert_allclose(halves[0][name] + halves[1][name], whole[name], rtol=1e-5, err_msg=name)
  own = [run(model, jax.tree.map(lambda x: x[i::2], batch), None)[1]["moe_lb_loss"] for i in (0, 1)]
  np.testing.assert_allclose(halves[0]["moe_lb_loss"] + halves[1]["moe_lb_loss"], (own[0] + own[1]) / 2, rtol=1e-5)
