"""NCP-ArchPreview ConceptLM: every equation against tests/ncp_ref.py (NumPy, written from the
paper), causality, gradient paths, the residuals at init, configs, FLOPs and a short train run."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ncp_ref
from conftest import ROOT, TINY_OVERRIDES
from latent_jax import ConfigError, build_model, load_config
from latent_jax.config import validate
from latent_jax.objectives import combine, ntp_terms
from latent_jax.ops import concepts as C
from latent_jax.train import flops

TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
CONFIGS = os.path.join(ROOT, "configs")
# Small enough that a NumPy forward of the whole model takes a second.
SMALL = ["model.vocab_size=64", "model.d_model=16", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=8", "model.mlp_dim=32", "model.window=3", "model.full_attention_every=2",
         "model.num_segments=4", "model.codebook_size=8", "model.residual_hidden=4", "data.seq_len=16",
         "kernels.impl=xla"]
rng = np.random.default_rng(0)
f32 = lambda x: jnp.asarray(x, jnp.float32)


def small_cfg(*overrides):
  return load_config(TINY_NCP, SMALL + list(overrides))


# ------------------------------------------------------------------ equations
@pytest.mark.parametrize("docs", [False, True])
def test_pool_concepts(docs):
  h = rng.normal(size=(2, 11, 6))
  seg = np.array([[1] * 5 + [2] * 6, [1] * 11]) if docs else None
  got = C.pool_concepts(f32(h), 3, None if seg is None else jnp.asarray(seg))
  assert got.shape == (2, 3, 6)  # M = floor(11 / 3); the partial chunk is dropped
  np.testing.assert_allclose(got, ncp_ref.pool(h, 3, seg), rtol=1e-5, atol=1e-6)


def test_concept_segments_and_positions_restart_with_documents():
  pos = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # a document starts at token 5
  seg = jnp.asarray([[1] * 5 + [2] * 7])
  assert C.chunk_segments(seg, 3).tolist() == [[1, 2, 2, 2]]
  assert C.concept_positions(pos, 3, "index").tolist() == [[0, 0, 1, 2]]
  assert C.concept_positions(pos, 3, "token").tolist() == [[0, 0, 3, 6]]


def test_pq_assign():
  c, codebook = rng.normal(size=(2, 3, 12)), rng.normal(size=(4, 5, 3))
  codes, quantized = C.pq_assign(f32(c), f32(codebook))
  want_codes, want_q = ncp_ref.pq(c, codebook)
  np.testing.assert_array_equal(codes, want_codes)
  np.testing.assert_allclose(quantized, want_q, rtol=1e-6)


@pytest.mark.parametrize("mode", ["softmax", "raw_logits"])
def test_mix_codebook(mode):
  logits, codebook = rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(4, 5, 3))
  got = C.mix_codebook(f32(logits), f32(codebook), mode, impl="xla")
  np.testing.assert_allclose(got, ncp_ref.mix(logits, codebook, "softmax" if mode == "softmax" else "raw"),
                             rtol=1e-5, atol=1e-6)


def test_injection_index_map_matches_eq11_table():
  """k=4, 1-indexed t: 1-3 get 0, 4-7 get chat_2, 8-11 chat_3, 12-15 chat_4, 16 chat_5."""
  pred = np.arange(2, 6, dtype=np.float32)[None, :, None]  # row i holds the paper index i+2 of chat
  got = np.asarray(C.align_to_tokens(jnp.asarray(pred), 16, 4))[0, :, 0]
  assert got.tolist() == [0] * 3 + [2] * 4 + [3] * 4 + [4] * 4 + [5]
  for t_len in (12, 14, 15):  # a multiple of k and not
    x = rng.normal(size=(2, t_len // 4, 3))
    np.testing.assert_array_equal(C.align_to_tokens(f32(x), t_len, 4), f32(ncp_ref.injected(x, t_len, 4)))


def test_injection_stays_in_the_document():
  # k=4, document 2 starts at token 6 (0-indexed). Token 6 reads chunk 0 (document 1): zero.
  # Chunk 1 (tokens 4-7) belongs to document 2, the document of its last token, so token 7 reads it.
  seg = jnp.asarray([[1] * 6 + [2] * 6])
  pred = jnp.ones((1, 3, 2))
  got = np.asarray(C.align_to_tokens(pred, 12, 4, C.same_document(seg, 4)))[0, :, 0]
  assert got.tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("fusion", ["add", "norm_add"])
def test_inject_concepts(fusion):
  h, pred = rng.normal(size=(2, 10, 6)), rng.normal(size=(2, 2, 6))
  hs, cs, a = rng.normal(size=6), rng.normal(size=6), 0.3
  got = C.inject_concepts(f32(h), f32(pred), 4, fusion=fusion, h_scale=f32(hs), c_scale=f32(cs), a=f32(a))
  b = ncp_ref.injected(pred, 10, 4)
  want = h + b if fusion == "add" else ncp_ref.ref.rms_norm(h, hs, 1e-6) + a * ncp_ref.ref.rms_norm(b, cs, 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["paper", "algorithm1", "released"])
def test_vq_and_ncp_losses(reduction):
  c, q, pred = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
  np.testing.assert_allclose(C.vq_loss(f32(c), f32(q), 4, reduction), ncp_ref.vq(c, q, 4, reduction), rtol=1e-5)
  np.testing.assert_allclose(C.ncp_loss(f32(pred), f32(c), 4, reduction), ncp_ref.ncp(pred, c, 4, reduction),
                             rtol=1e-5)
  # A mask drops pairs: scoring only pairs of the first row equals the loss of that row alone.
  mask = jnp.asarray([[True] * 4, [False] * 4])
  np.testing.assert_allclose(C.ncp_loss(f32(pred), f32(c), 4, reduction, mask),
                             ncp_ref.ncp(pred[:1], c[:1], 4, reduction), rtol=1e-5)


def test_losses_stop_gradients():
  """VQ moves only the codewords (Eq. 21); the NCP target is sg(c) (Eq. 22)."""
  c, q = f32(rng.normal(size=(2, 5, 8))), f32(rng.normal(size=(2, 5, 8)))
  dc, dq = jax.grad(lambda c, q: C.vq_loss(c, q, 4), argnums=(0, 1))(c, q)
  assert not np.any(dc) and np.all(np.abs(dq) > 0)
  dpred, dtarget = jax.grad(lambda p, t: C.ncp_loss(p, t, 4), argnums=(0, 1))(q, c)
  assert not np.any(dtarget) and np.any(dpred)
  dcon, dbook = jax.grad(lambda c, e: jnp.sum(C.pq_assign(c, e)[1]), argnums=(0, 1))(c, f32(rng.normal(size=(4, 3, 2))))
  assert not np.any(dcon) and np.any(dbook)


@pytest.mark.parametrize("softmax", [False, True])
def test_intra_module_residual(softmax):
  layers, latest, d = 3, 2, 6  # after layer 2 of 3: slots 0..2 hold H_1, H_1+R_1, H_2+R_2
  history = np.zeros((layers + 1, 2, 5, d))
  history[:latest + 1] = rng.normal(size=(latest + 1, 2, 5, d))
  update, w1, w2 = rng.normal(size=(2, 5, d)), rng.normal(size=(d, 4)), rng.normal(size=(4, layers + 1))
  got = C.intra_module_residual(f32(history), f32(update), f32(w1), f32(w2), latest, softmax)
  want = ncp_ref.irc(history[:latest + 1], update, w1, w2, latest, softmax)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # Zero w2 (the init) selects exactly the newest state: a plain residual connection.
  plain = C.intra_module_residual(f32(history), f32(update), f32(w1), jnp.zeros((4, layers + 1)), latest)
  np.testing.assert_array_equal(plain, f32(history[latest]))


@pytest.mark.parametrize("softmax,docs", [pytest.param(False, False, marks=pytest.mark.slow), pytest.param(True, True, marks=pytest.mark.slow)])  # slow: by time
def test_history_scan_gradients_equal_the_plain_scan(softmax, docs, monkeypatch):
  """The IRC stack's O(L)-memory backward (nn.concept.history_scan, under every model.remat but "none")
  against autodiff of a plain jax.lax.scan: gradients of params, input and CRC sources, 3 layers, one
  route of 2 depths; IRC softmax and two documents per row in the second case."""
  from latent_jax.nn import concept
  cfg = small_cfg("model.remat=full", f"model.irc_softmax={softmax}").model
  graphdef, state = nnx.split(concept.ResidualStack(cfg, 3, (2,), nnx.Rngs(0)))
  r = np.random.default_rng(0)
  state = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape) * 0.3 + (a.ndim == 1), a.dtype), state)
  x, sources = f32(r.normal(size=(2, 8, 16))), [f32(r.normal(size=(2, 2, 8, 16)))]
  positions, segments = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.zeros((2, 8), jnp.int32)
  if docs:
    positions, segments = jnp.asarray([list(range(3)) + list(range(5))] * 2), jnp.asarray([[0] * 3 + [1] * 5] * 2)
  calls, history_scan = [], concept.history_scan
  monkeypatch.setattr(concept, "history_scan", lambda *a: calls.append(1) or history_scan(*a))

  def loss(state, x, sources):
    y, outs, _ = nnx.merge(graphdef, state)(x, positions, segments, sources)
    return jnp.sin(y).sum() + 0.1 * jnp.square(outs).sum()

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = grads(state, x, sources)
  assert calls  # the remat'd IRC stack took the custom-VJP scan

  def plain_scan(body, x, history, layers, consts):
    (x, _), (outs, _) = jax.lax.scan(lambda carry, layer: body(carry, layer, consts), (x, history), layers)
    return x, outs
  monkeypatch.setattr(concept, "history_scan", plain_scan)
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(state, x, sources)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cross_module_residual():
  target, sources = rng.normal(size=(2, 5, 6)), rng.normal(size=(3, 2, 5, 6))
  w1, w2, scale, norm = rng.normal(size=(6, 4)), rng.normal(size=(4, 3)), rng.normal(size=6), rng.normal(size=6)
  normed = ncp_ref.ref.rms_norm(sources, norm, 1e-6)  # the module normalises its sources once
  got = C.cross_module_residual(f32(target), f32(normed), f32(w1), f32(w2), f32(scale))
  want = ncp_ref.crc(target, list(sources), w1, w2, scale, norm, 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_codebook_usage():
  codes = rng.integers(0, 6, size=(2, 7, 3))
  codes[..., 1] = np.minimum(codes[..., 1], 2)  # one segment uses at most 3 codes
  got = C.codebook_usage(C.code_histogram(jnp.asarray(codes), 8))
  counts = np.stack([np.bincount(codes[..., s].ravel(), minlength=8) for s in range(3)])
  p = counts / counts.sum(-1, keepdims=True)
  ppl = np.exp(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1))
  np.testing.assert_allclose(got["code_usage"], np.mean(counts > 0), rtol=1e-6)
  np.testing.assert_allclose(got["code_usage_min"], (counts[1] > 0).mean(), rtol=1e-6)
  assert (counts[1] > 0).mean() == np.min((counts > 0).mean(-1)) < np.mean(counts > 0)
  np.testing.assert_allclose(got["code_perplexity"], ppl.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["dead_codes"], np.mean((counts == 0).sum(-1)), rtol=1e-6)


# ------------------------------------------------------------------ the model
# Model tests share one jitted forward per config and shape: each XLA compile costs seconds here.
def abstract_state(cfg):
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))
  return graphdef, state


def random_params(cfg, seed=1, std=0.3):
  """Random values for every parameter (the zero-initialised IRC/CRC weights too, so every path
  is live), vectors around 1. Drawn by NumPy: no XLA compile per parameter shape."""
  _, state = abstract_state(cfg)
  leaves, tree = jax.tree.flatten(state)
  r = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [jnp.asarray(r.normal(size=x.shape) * std + (1.0 if len(x.shape) == 1 else 0.0),
                                               x.dtype) for x in leaves])


def jit_forward(cfg):
  """forward(params, tokens [B, T], seg=None, pos=None) -> ModelOutput; one compile per (B, T)."""
  graphdef, _ = abstract_state(cfg)
  run = jax.jit(lambda p, t, s, q: nnx.merge(graphdef, p)(t, s, q))

  def forward(params, tokens, seg=None, pos=None):
    tokens = jnp.asarray(tokens)
    seg = jnp.ones_like(tokens) if seg is None else jnp.asarray(seg)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if pos is None else jnp.asarray(pos)
    return run(params, tokens, seg, pos)
  return forward


def pure(params):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


@pytest.fixture(scope="module")
def small():
  """The small config (k=4, every CRC route and IRC on), its forward and random parameters."""
  cfg = small_cfg().model
  return cfg, jit_forward(cfg), random_params(cfg)


def test_concept_lm_matches_numpy(small):
  """The whole hierarchy, the paper's choices, a partial last chunk (T=14, k=4)."""
  cfg, forward, params = small
  tokens = rng.integers(0, 64, size=(2, 14))
  out = forward(params, tokens)
  logits, c, pred = ncp_ref.concept_lm(pure(params), cfg, tokens)
  np.testing.assert_allclose(out.aux["concepts"], c, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(out.aux["predicted"], pred, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(out.logits, logits, rtol=2e-3, atol=2e-3)


def test_concept_lm_matches_numpy_released_choices():
  cfg = small_cfg("model.chunk_size=3", "model.fusion=norm_add", "model.concept_positions=token",
                  "model.concept_norm=True", "model.mixing=raw_logits", "model.irc_softmax=True").model
  params = random_params(cfg)
  tokens = rng.integers(0, 64, size=(1, 11))
  out = jit_forward(cfg)(params, tokens)
  logits, c, pred = ncp_ref.concept_lm(pure(params), cfg, tokens)
  np.testing.assert_allclose(out.aux["concepts"], c, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(out.aux["predicted"], pred, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(out.logits, logits, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("t_len,with_docs", [(12, False), (14, False), (14, True)])
def test_no_future_leakage(small, t_len, with_docs):
  _, forward, params = small
  tokens = rng.integers(0, 64, size=(2, t_len))
  seg = np.repeat([[1] * 6 + [2] * (t_len - 6)], 2, 0) if with_docs else None
  pos = np.repeat([list(range(6)) + list(range(t_len - 6))], 2, 0) if with_docs else None
  base = forward(params, tokens, seg, pos).logits
  for t in [0, 2, 3, 4, 7, 8, t_len - 2]:  # around every chunk edge (k=4)
    changed = tokens.copy()
    changed[:, t + 1:] = (changed[:, t + 1:] + rng.integers(1, 63, size=changed[:, t + 1:].shape)) % 64
    out = forward(params, changed, seg, pos).logits
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(base[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_documents_do_not_see_each_other(small):
  """A document that starts on a chunk boundary gives the same logits packed as alone."""
  _, forward, params = small
  a, b = rng.integers(0, 64, size=(2, 8)), rng.integers(0, 64, size=(2, 6))
  packed = forward(params, np.concatenate([a, b], 1), [[1] * 8 + [2] * 6] * 2,
                   [list(range(8)) + list(range(6))] * 2).logits
  alone = forward(params, np.concatenate([b, a], 1), [[1] * 6 + [2] * 8] * 2).logits
  np.testing.assert_allclose(packed[:, 8:], alone[:, :6], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start", [5, 6, 7])
def test_documents_do_not_see_each_other_mid_chunk(small, start):
  """A document that starts inside a chunk (k=4; chunks stay on the row's grid): its logits do
  not depend on the document before it, although one chunk holds tokens of both."""
  _, forward, params = small
  r = np.random.default_rng(start)
  a, b = r.integers(0, 64, size=(2, start)), r.integers(0, 64, size=(2, 14 - start))
  seg, pos = [[1] * start + [2] * (14 - start)] * 2, [list(range(start)) + list(range(14 - start))] * 2
  packed = forward(params, np.concatenate([a, b], 1), seg, pos)
  other = forward(params, np.concatenate([(a + 7) % 64, b], 1), seg, pos)
  np.testing.assert_array_equal(np.asarray(other.logits[:, start:]), np.asarray(packed.logits[:, start:]))
  assert not np.allclose(other.logits[:, :start], packed.logits[:, :start])


def test_residuals_at_init_are_the_plain_model(small, monkeypatch):
  """At init IRC (w2 = 0) is the standard residual stack and CRC adds D * mix with D = crc_scale_init;
  with D = 0 the whole model is the plain hierarchy (compared with its NumPy re-derivation)."""
  cfg, forward, _ = small
  # The real constructors, but random matrices drawn by NumPy: the init under test is the IRC/CRC
  # constants, and eager jax.random would compile once per parameter shape (~15 s on 2 cores).
  draw = np.random.default_rng(2)
  numpy_param = lambda rngs, shape, axes, std, dtype: nnx.Param(jnp.asarray(draw.normal(size=shape) * std, dtype),
                                                                axes=axes)
  monkeypatch.setattr("latent_jax.nn.layers.param", numpy_param)
  monkeypatch.setattr("latent_jax.nn.concept.param", numpy_param)
  params = nnx.state(build_model(cfg, nnx.Rngs(0)))
  p = pure(params)
  for module in ("encoder", "concept", "decoder"):
    assert not np.any(p[module]["irc_w2"])
    for route in p[module].get("routes", {}).values():
      assert not np.any(route["w2"]) and np.all(route["scale"] == np.float32(cfg.crc_scale_init))
      route["scale"] = np.zeros_like(route["scale"])
  nnx.replace_by_pure_dict(params, p)
  tokens = rng.integers(0, 64, size=(2, 14))
  want, _, _ = ncp_ref.concept_lm(p, cfg, tokens, plain=True)
  np.testing.assert_allclose(forward(params, tokens).logits, want, rtol=1e-4, atol=1e-5)


def test_gradient_paths():
  """VQ reaches only the codebook; NCP reaches embed, encoder, concept module, heads and codebook
  (not the decoder: its target is sg(c)); NTP reaches every parameter."""
  # Two source depths per route (alpha is not constant); remat halves this test's compile time.
  cfg = small_cfg("model.decoder_layers=1", "model.remat=full")
  graphdef, _ = abstract_state(cfg.model)
  params = random_params(cfg.model)
  tokens = jnp.asarray(rng.integers(0, 64, size=(2, 13)))
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "segment_ids": jnp.ones_like(tokens),
           "positions": jnp.broadcast_to(jnp.arange(13), tokens.shape)}
  m = cfg.model

  def losses(p):  # [vq, ncp, ntp]
    model = nnx.merge(graphdef, p)
    out = model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
    a = out.aux
    return jnp.stack([C.vq_loss(a["concepts"], a["quantized"], m.num_segments),
                      C.ncp_loss(a["predicted"], a["concepts"], m.num_segments, mask=a["ncp_mask"]),
                      combine(ntp_terms(model, out, batch, cfg))[0]])

  # One compiled gradient of w . losses, run once per one-hot w (cheaper to compile than jacrev).
  grad = jax.jit(jax.grad(lambda p, w: jnp.dot(w, losses(p))))

  def named(tree):  # {"module/.../param": array}
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]}
  everything = set(named(params))
  vq, ncp, ntp = ({name for name, g in named(grad(params, jnp.eye(3)[i])).items() if np.any(g)} for i in range(3))
  assert vq == {"codebook"}
  assert {name.split("/")[0] for name in ncp} == {"embed", "encoder", "concept", "head_norm", "heads", "codebook"}
  assert {name for name in everything if name.startswith(("encoder", "concept"))} <= ncp  # IRC, CRC included
  assert ntp == everything


# ------------------------------------------------------------------ configs, FLOPs, parameters
@pytest.mark.parametrize("field,value,words", [
    ("model.num_segments", 6, "does not divide model.d_model"),
    ("data.seq_len", 7, "shorter than 2*model.chunk_size"),
    ("model.mixing", "argmax", "not one of"),
    ("model.fusion", "concat", "not one of"),
    ("model.concept_positions", "chunk", "not one of"),
    ("ncp.reduction", "sum", "not one of"),
    ("model.chunk_size", 0, "positive integer"),
])
def test_bad_settings_name_the_field(field, value, words):
  cfg = small_cfg()
  section, name = field.split(".")
  cfg[section][name] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
    validate(cfg)
  assert words in str(e.value)


def test_model_and_pure_functions_refuse_bad_input():
  """Past the config check: a model built from a hand-made config, a short sequence, a mode typo."""
  cfg = small_cfg().model
  bad = cfg.copy_and_resolve_references()
  bad.num_segments = 6
  with pytest.raises(ValueError, match=r"model.num_segments=6 does not divide model.d_model=16"):
    build_model(bad, nnx.Rngs(0))
  model = build_model(cfg, nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"3 tokens holds no complete chunk of model.chunk_size=4"):
    model(jnp.zeros((1, 3), jnp.int32))
  x = jnp.zeros((1, 8, 4))
  for call, words in [(lambda: C.concept_positions(jnp.zeros((1, 8), jnp.int32), 4, "chunk"), "concept_positions='chunk'"),
                      (lambda: C.fuse_concepts(x, x, fusion="concat"), "fusion='concat'"),
                      (lambda: C.ncp_loss(x, x, 2, reduction="sum"), "reduction='sum'"),
                      (lambda: C.vq_loss(x, x, 2, reduction="sum"), "reduction='sum'"),
                      (lambda: C.mix_codebook(jnp.zeros((1, 2, 3)), jnp.zeros((2, 3, 2)), mode="softmx"), "mixing='softmx'")]:
    with pytest.raises(ValueError, match=words):
      call()


def test_flops_give_the_papers_block_ratios():
  """Table 2: 16/8/16 with k=4 costs ~(16 + 8/4 + 16) = 34 blocks per token, vs 32, 34, 40."""
  ncp = load_config(os.path.join(CONFIGS, "ncp_archpreview_8b.py")).model
  base = load_config(os.path.join(CONFIGS, "olmo3_7b.py")).model
  seq = 8192
  parts = flops.concept_forward_flops(ncp, seq)
  blocks = parts["encoder"] + parts["concept"] + parts["decoder"]
  vanilla = {n: flops.stack_flops_per_token(base, n, seq) for n in (32, 34, 40)}
  assert blocks / vanilla[32] == pytest.approx(34 / 32, rel=0.01)
  assert blocks / vanilla[34] == pytest.approx(1.0, rel=0.01)
  assert blocks / vanilla[40] == pytest.approx(0.85, rel=0.01)
  # By hand: the concept module runs once per chunk, C=8 blocks over M = T/k = 2048 positions
  # (its 4096-concept window covers them all), plus IRC over 9 states and the Encoder->Concept
  # CRC over 16 encoder depths; per token that is 1/k of it.
  d, f, r, m = 4096, 11_008, ncp.residual_hidden, seq // 4
  block = 2 * (4 * d * d + 3 * d * f) + 4 * d * (m + 1) / 2  # q, k, v, o, SwiGLU; causal q k^T and p v
  irc = 8 * (2 * d * r + 2 * r * 9 + 2 * 9 * d)
  crc = 8 * (2 * d * r + 2 * r * 16 + 2 * 16 * d)
  assert parts["concept"] == pytest.approx((8 * block + irc + crc) / 4)
  assert parts["heads"] == 2 * 4096 * 32 * 128 / 4 and parts["codebook"] == 2 * 2 * 128 * 4096 / 4
  total = flops.flops_per_token(ncp, seq)
  base.num_layers = 40
  assert total / flops.flops_per_token(base, seq) == pytest.approx(0.85, abs=0.01)


def count(cfg):
  state = nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0))))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)), state


def test_archpreview_8b_parameter_count():
  cfg = load_config(os.path.join(CONFIGS, "ncp_archpreview_8b.py"))
  total, state = count(cfg)
  assert state["codebook"].shape == (32, 128, 128) and int(np.prod(state["codebook"].shape)) == 524_288
  assert round(total / 1e9, 2) == 8.94
  assert total == 8_939_886_208
  # alpha = 1/d and beta = S/d at the 8B sizes, not at the tiny ones the recipe starts from
  assert cfg.ncp.alpha == 1 / 4096 and cfg.ncp.beta == 32 / 4096
  assert state["embed"].dtype == jnp.float32 and "lm_head" in state  # float32 master (bf16 compute), untied


def test_loss_weights_follow_d_and_s_overrides():
  """ncp.alpha = 1/d and beta = S/d follow command-line overrides of model.d_model and
  model.num_segments; an override of the weights themselves wins."""
  path = os.path.join(CONFIGS, "tiny_ncp.py")
  cfg = load_config(path, ["model.d_model=256", "model.num_segments=16"])
  assert (cfg.ncp.alpha, cfg.ncp.beta) == (1 / 256, 16 / 256)
  cfg = load_config(path, ["model.d_model=256", "ncp.alpha=0.5"])
  assert (cfg.ncp.alpha, cfg.ncp.beta) == (0.5, 8 / 256)
  assert load_config(os.path.join(CONFIGS, "ncp_ladder.py:cm"), ["model.d_model=256"]).ncp.beta == 0.0


def test_olmo3_7b_parameter_count():
  """By hand: untied embedding and LM head, then per layer q, k, v, o (32 heads of 128 = d), a
  SwiGLU MLP and four norms of d (attention, MLP, and layer-wide q and k norms), a final norm."""
  cfg = load_config(os.path.join(CONFIGS, "olmo3_7b.py"))
  total, _ = count(cfg)
  v, d, mlp, layers = 100_278, 4096, 11_008, 32
  assert total == 2 * v * d + layers * (4 * d * d + 3 * d * mlp + 4 * d) + d == 7_298_011_136


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_tiny_ncp_trains_and_logs_every_term(tmp_path, corpus_dir):
  """configs/tiny_ncp.py through the real train loop; rows log each term of Eq. 24 on its own."""
  from latent_jax.train.loop import train
  extra = ["model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=1", "model.concept_layers=1",
           "model.decoder_layers=1", "train.steps=3", "train.eval_every=0", "train.checkpoint_every=100",
           "ncp.alpha=0.5", "ncp.beta=2.0", f"data.source={corpus_dir}"]
  cfg = load_config(TINY_NCP, TINY_OVERRIDES + extra)
  train(cfg, str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    for name in ("loss", "ncp_loss", "vq_loss", "code_usage", "code_usage_min", "code_perplexity", "dead_codes",
                 "total_loss"):
      assert np.isfinite(r[name]), (name, r)
    assert r["total_loss"] == pytest.approx(r["loss"] + 0.5 * r["ncp_loss"] + 2.0 * r["vq_loss"], rel=1e-5)
  assert rows[-1]["flops"] == 3 * cfg.data.batch_size * cfg.data.seq_len * flops.flops_per_token(cfg.model, 32)
