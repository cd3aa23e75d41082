"""Baseline model: causality, document masking, KV-cache decoding and dtype options (remat: tests/test_remat.py)."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT
from latent_jax import ConfigError, build_model, load_config
from latent_jax.config import validate


def make(cfg, seed=0):
  return build_model(cfg.model, nnx.Rngs(seed))


def jitted(model):
  """The model's forward under jax.jit (eager op-by-op dispatch of a scan is slow on CPU)."""
  graphdef, params = nnx.split(model)
  fwd = jax.jit(lambda p, *args, **kw: nnx.merge(graphdef, p)(*args, **kw))
  return lambda *args, **kw: fwd(params, *args, **kw)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("with_docs", [False, True])
def test_no_future_leakage(tiny_cfg, window, with_docs):
  tiny_cfg.model.window = window
  model = jitted(make(tiny_cfg))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 320, size=(2, 24))
  seg = np.repeat([[1] * 10 + [2] * 14], 2, axis=0) if with_docs else None
  pos = np.repeat([list(range(10)) + list(range(14))], 2, axis=0) if with_docs else None
  base = model(jnp.asarray(tokens), seg, pos).logits
  for t in [0, 9, 15]:
    changed = tokens.copy()
    changed[:, t + 1:] = rng.integers(0, 320, size=changed[:, t + 1:].shape)
    out = model(jnp.asarray(changed), seg, pos).logits
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(base[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_documents_do_not_see_each_other(tiny_cfg):
  """With segment ids, the second document's logits equal those of running it alone."""
  model = jitted(make(tiny_cfg))
  a, b = np.arange(1, 11), np.arange(50, 64)
  seg = np.array([[1] * 10 + [2] * 14])
  pos = np.array([list(range(10)) + list(range(14))])
  packed = model(jnp.asarray([np.concatenate([a, b])]), seg, pos).logits
  alone = model(jnp.asarray([b])).logits
  np.testing.assert_allclose(packed[0, 10:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_scaling", ["none", "yarn"])
def test_kv_cache_decoding_matches_full_forward(tiny_cfg, rope_scaling):
  tiny_cfg.model.window = 5  # shorter than the sequence: the cache must honour the window
  tiny_cfg.model.update(rope_scaling=rope_scaling, yarn_original_context=8)  # YaRN on the full layers
  model = make(tiny_cfg)
  cache = model.init_cache(2, 20)
  model = jitted(model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 320, size=(2, 20)))
  full = model(tokens).logits
  out = model(tokens[:, :7], cache=cache, cache_index=0)  # prefill
  steps = [out.logits]
  cache = out.cache
  for i in range(7, 20):
    out = model(tokens[:, i:i + 1], cache=cache, cache_index=i)
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_bf16_and_tied_embeddings(tiny_cfg):
  """Tied embeddings in bf16 compute (float32 master) and bf16 storage: bf16 logits that equal
  the float32 model's on the same weights within bf16's rounding, ~2^-8 per op."""
  tiny_cfg.model.update(tie_embeddings=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 320, size=(2, 24)))
  reference = make(tiny_cfg)
  for param_dtype in ("float32", "bfloat16"):
    tiny_cfg.model.update(param_dtype=param_dtype, dtype="bfloat16")
    model = make(tiny_cfg)
    assert not hasattr(model, "lm_head") and model.embed.dtype == jnp.dtype(param_dtype)
    nnx.update(reference, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model)))  # the same weights
    want = np.asarray(jitted(reference)(tokens).logits)
    got = jitted(model)(tokens).logits
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 24, 320)
    err = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
    assert 0 < err <= 3e-2, (param_dtype, err)  # 0: the bf16 path really ran


def test_param_count_matches_formula(tiny_cfg):
  m = tiny_cfg.model
  per_layer = m.d_model * m.num_heads * m.head_dim * 2 + 2 * m.d_model * m.num_kv_heads * m.head_dim \
      + 3 * m.d_model * m.mlp_dim + 2 * m.d_model + m.num_heads * m.head_dim + m.num_kv_heads * m.head_dim
  want = m.num_layers * per_layer + 2 * m.vocab_size * m.d_model + m.d_model
  got = sum(x.size for x in jax.tree.leaves(nnx.state(make(tiny_cfg))))
  assert got == want


@pytest.mark.parametrize("field,value,words", [
    ("model.num_kv_heads", 3, "does not divide model.num_heads"),
    ("model.head_dim", 7, "odd"),
    ("model.qk_norm", "both", "not one of"),
    ("model.rope_scaling", "ntk", "not one of"),
    ("model.name", "gpt", "not one of"),
    ("data.seq_len", 1, ">= 2"),
    ("optim.warmup_steps", 100, "train.steps"),
    ("kernels.impl", "cuda", "not one of"),
    ("mesh.data", 0, "or -1 to take"),
])
def test_config_validation_names_the_field(tiny_cfg, field, value, words):
  section, name = field.split(".")
  tiny_cfg[section][name] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
    validate(tiny_cfg)
  assert words in str(e.value)


def test_ncp_ladder_rungs_are_the_papers_comparisons():
  """configs/ncp_ladder.py:RUNG: baselines of E+D, E+D+C/k (rounded up) and E+C+D layers; concept
  rungs that add the module, then the residuals, then the losses."""
  ladder = os.path.join(ROOT, "configs", "ncp_ladder.py")
  rung = {r: load_config(f"{ladder}:{r}") for r in
          ("vanilla", "compute_aligned", "size_aligned", "cm", "residual", "ncp", "no_residual", "irc_only")}
  full = load_config(os.path.join(ROOT, "configs", "tiny_ncp.py"))
  e, c, d, k = (full.model[f] for f in ("encoder_layers", "concept_layers", "decoder_layers", "chunk_size"))
  assert [rung[r].model.num_layers for r in ("vanilla", "compute_aligned", "size_aligned")] == \
      [e + d, math.ceil(e + d + c / k), e + c + d]
  assert rung["ncp"].to_dict() == full.to_dict()
  routes = ("crc_encoder_concept", "crc_encoder_decoder", "crc_concept_decoder")
  assert not rung["cm"].model.irc and not any(rung["cm"].model[r] for r in routes)
  assert rung["residual"].model.irc and all(rung["residual"].model[r] for r in routes)
  for r in ("cm", "residual"):
    assert rung[r].ncp.alpha == rung[r].ncp.beta == 0.0
  assert (rung["no_residual"].ncp.alpha, rung["irc_only"].ncp.alpha) == (full.ncp.alpha, full.ncp.alpha)
  assert rung["irc_only"].model.irc and not any(rung["irc_only"].model[r] for r in routes)
  with pytest.raises(ConfigError, match="unknown rung; pick one of"):
    load_config(f"{ladder}:bigger")
  with pytest.raises(ConfigError, match="needs a rung after a colon"):
    load_config(ladder)
  with pytest.raises(ConfigError, match="takes no argument"):
    load_config(os.path.join(ROOT, "configs", "tiny.py") + ":ncp")
