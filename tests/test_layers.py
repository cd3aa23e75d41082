"""Each layer of the baseline against a NumPy re-derivation of its equation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_ref as ref
from latent_jax.nn.layers import Attention, Block
from latent_jax.ops import transformer as T

rng = np.random.default_rng(0)


def test_rms_norm():
  x, scale = rng.normal(size=(3, 5, 16)), rng.normal(size=16)
  got = T.rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32), 1e-6)
  np.testing.assert_allclose(got, ref.rms_norm(x, scale, 1e-6), rtol=1e-5, atol=1e-5)


def test_rope_matches_pairwise_rotation():
  x = rng.normal(size=(2, 7, 3, 8))
  pos = rng.integers(0, 1000, size=(2, 7))
  got = T.rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), T.rope_frequencies(8, 500_000.0))
  np.testing.assert_allclose(got, ref.rope(x, pos, 500_000.0), rtol=1e-4, atol=1e-4)


def test_rope_is_relative():
  """<rope(q, m), rope(k, n)> depends only on m - n."""
  q, k = rng.normal(size=(1, 1, 1, 8)), rng.normal(size=(1, 1, 1, 8))
  for freq in (T.rope_frequencies(8, 10_000.0), T.yarn_frequencies(8, 10_000.0, 4.0, 64, 32.0, 1.0)):
    rot = lambda x, m: T.rope(jnp.asarray(x, jnp.float32), jnp.array([[m]]), freq, 1.2)
    dot = lambda m, n: float(jnp.sum(rot(q, m) * rot(k, n)))
    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)


# (head dim, base, s, L, beta_fast, beta_slow): OLMo-3 7B's; small ones whose ramp ends clamp at 0
# or whose ramp covers most pairs.
@pytest.mark.parametrize("yarn", [(128, 500_000.0, 8.0, 8192, 32.0, 1.0), (8, 500_000.0, 4.0, 16, 32.0, 1.0),
                                  (64, 10_000.0, 2.0, 4096, 16.0, 2.0), (16, 1e6, 16.0, 128, 64.0, 0.5)])
def test_yarn_frequencies_match_numpy(yarn):
  np.testing.assert_allclose(T.yarn_frequencies(*yarn), ref.yarn_frequencies(*yarn), rtol=1e-6)
  np.testing.assert_allclose(T.rope_frequencies(*yarn[:2]), ref.yarn_frequencies(yarn[0], yarn[1], 1.0, *yarn[3:]),
                             rtol=1e-6)  # s = 1: plain RoPE


def test_yarn_of_olmo3_7b():
  """The released OLMo-3 7B's YaRN (D=128, base 5e5, s=8, L=8192): r_i crosses 32 turns at pair 18.08
  and 1 turn at 34.98, so pairs 0-18 keep theta_i, pairs 35-63 take theta_i / 8; the factor is 0.1 ln 8 + 1."""
  got, theta = np.asarray(T.yarn_frequencies(128, 500_000.0, 8.0, 8192, 32.0, 1.0)), 500_000.0 ** (-np.arange(64) / 64)
  np.testing.assert_allclose(got[:19], theta[:19], rtol=1e-6)
  np.testing.assert_allclose(got[35:], theta[35:] / 8, rtol=1e-6)
  assert np.all((got[19:35] < theta[19:35] * (1 - 1e-6)) & (got[19:35] > theta[19:35] / 8))
  assert T.yarn_attention_factor(8.0) == pytest.approx(1.2079441541679836, rel=1e-15)


@pytest.mark.parametrize("window", [3, T.NO_WINDOW])
def test_gqa_attention_with_window_and_documents(window):
  b, t, h, groups, d = 2, 9, 4, 2, 8
  q, k, v = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, groups, d)), rng.normal(size=(b, t, groups, d))
  seg = np.array([[1] * 4 + [2] * 5, [1] * 9])
  pos = np.array([list(range(4)) + list(range(5)), list(range(9))])
  mask = T.attention_mask(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg), window)
  got = T.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), mask)
  np.testing.assert_allclose(got, ref.attention(q, k, v, pos, seg, window), rtol=1e-4, atol=1e-5)


def test_swiglu():
  x, wg, wu, wd = (rng.normal(size=s) for s in [(4, 8), (8, 16), (8, 16), (16, 8)])
  got = T.swiglu(*(jnp.asarray(a, jnp.float32) for a in (x, wg, wu, wd)))
  np.testing.assert_allclose(got, ref.swiglu(x, wg, wu, wd), rtol=1e-4, atol=1e-5)


def test_layer_windows_pattern():
  w = np.asarray(T.layer_windows(8, 16, 4))
  assert list(w) == [16, 16, 16, T.NO_WINDOW] * 2
  assert set(np.asarray(T.layer_windows(3, 16, 1))) == {T.NO_WINDOW}
  assert set(np.asarray(T.layer_windows(3, 0, 4))) == {T.NO_WINDOW}


def randomize(module, seed=1):
  """Replace every parameter (norm scales too) with random values so nothing is trivially 1."""
  graphdef, state = nnx.split(module)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [jax.random.normal(k, x.shape) * 0.5 + (1.0 if x.ndim == 1 else 0.0) for k, x in zip(keys, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def attention_ref(p, cfg, x, pos, seg, window, frequencies=None, scale=1.0):
  q, key, val = ref.qkv(x, p, cfg, pos, frequencies, scale)
  return ref.attention(q, key, val, pos, seg, window).reshape(*x.shape[:2], -1) @ p["o"]


@pytest.mark.parametrize("qk_norm", ["none", "layer", "head"])
def test_attention_layer_qk_norm_modes(tiny_cfg, qk_norm):
  cfg = tiny_cfg.model
  cfg.qk_norm = qk_norm
  layer = randomize(Attention(cfg, nnx.Rngs(0)))
  x = rng.normal(size=(2, 6, cfg.d_model))
  pos, seg = np.tile(np.arange(6), (2, 1)), np.ones((2, 6), int)
  got, _ = layer(jnp.asarray(x, jnp.float32), jnp.asarray(pos), jnp.asarray(seg), 4)
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer)))
  np.testing.assert_allclose(got, attention_ref(p, cfg, x, pos, seg, 4), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("window", [10, T.NO_WINDOW])
def test_attention_yarn_on_full_attention_layers_only(tiny_cfg, window):
  """model.rope_scaling=yarn: a full-attention layer (window NO_WINDOW) rotates by YaRN's frequencies
  and scales cos and sin, a sliding-window one by plain RoPE's; the window arrives traced, as in the scan."""
  cfg = tiny_cfg.model
  cfg.update(rope_scaling="yarn", yarn_factor=4.0, yarn_original_context=16)
  layer = randomize(Attention(cfg, nnx.Rngs(0)))
  x = rng.normal(size=(2, 9, cfg.d_model))
  pos, seg = np.tile(np.arange(0, 36, 4), (2, 1)), np.ones((2, 9), int)
  got, _ = jax.jit(lambda w: layer(jnp.asarray(x, jnp.float32), jnp.asarray(pos), jnp.asarray(seg), w))(window)
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer)))
  yarn = (ref.yarn_frequencies(cfg.head_dim, cfg.rope_base, 4.0, 16, 32.0, 1.0), 0.1 * np.log(4.0) + 1)
  want = attention_ref(p, cfg, x, pos, seg, window, *(yarn if window == T.NO_WINDOW else (None, 1.0)))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  other = attention_ref(p, cfg, x, pos, seg, window, *((None, 1.0) if window == T.NO_WINDOW else yarn))
  assert np.abs(other - want).max() > 1e-2  # the two RoPEs differ here


@pytest.mark.parametrize("order", ["post", "pre"])
def test_block_order(tiny_cfg, order):
  cfg = tiny_cfg.model
  cfg.block_order = order
  block = randomize(Block(cfg, nnx.Rngs(0)))
  x = rng.normal(size=(1, 5, cfg.d_model))
  pos, seg = np.arange(5)[None], np.ones((1, 5), int)
  got, _ = block(jnp.asarray(x, jnp.float32), jnp.asarray(pos), jnp.asarray(seg), T.NO_WINDOW)
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(block)))
  norm = lambda y, n: ref.rms_norm(y, p[n]["scale"], cfg.norm_eps)
  attn = lambda y: attention_ref(p["attn"], cfg, y, pos, seg, T.NO_WINDOW)
  mlp = lambda y: ref.swiglu(y, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])
  if order == "post":   # OLMo-3: normalise each sublayer's output, then add
    h = x + norm(attn(x), "attn_norm")
    want = h + norm(mlp(h), "mlp_norm")
  else:
    h = x + attn(norm(x, "attn_norm"))
    want = h + mlp(norm(h, "mlp_norm"))
  np.testing.assert_allclose(got, want, rtol=5e-4, atol=5e-4)
