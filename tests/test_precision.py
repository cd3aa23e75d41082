"""Mixed precision: the paper recipes keep float32 master parameters and optimiser state and
compute in bfloat16, and train like the same run in float32 (the independent reference); bf16
storage without a master copy is refused unless a config asks for it; the embedding's gradient
sums a frequent token's rows in float32."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES, ragged_batch
from latent_jax import ConfigError, load_config, objectives, sharding
from latent_jax.nn.layers import embed_lookup
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer

# The recipes shrunk in width, depth and length only: their dtypes, Muon, lr 6e-5, z-loss, clipping,
# remat and microbatches stay. The 2000 warmup steps do not fit in 10: every step takes the peak lr.
SHRINK = ["model.vocab_size=256", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
          "model.num_kv_heads=4", "model.head_dim=16", "model.mlp_dim=128", "model.window=16",
          "data.seq_len=32", "data.batch_size=8", "train.steps=10", "optim.warmup_steps=0",
          "optim.schedule=constant", "kernels.impl=xla"]
# ConceptLM keeps every module, IRC and CRC route. residual_hidden=1: the last IRC layer of the
# concept module and of the decoder feeds an RMSNorm, so its weight on the newest slot does not
# change the loss and that column of irc_w2's gradient is rounding noise (1e-5 of the other
# column in float32, 1e-2 in bf16). With a wider hidden layer Muon's Newton-Schulz lifts the
# bf16 noise to a full-size direction of the update, which then matches no reference; a
# one-row matrix has no spare direction for it.
NCP = ["model.encoder_layers=1", "model.concept_layers=1", "model.decoder_layers=1", "model.num_segments=4",
       "model.codebook_size=8", "model.residual_hidden=1"]
RECIPES = {"olmo3_7b": ("olmo3_7b.py", SHRINK), "ncp_archpreview_8b": ("ncp_archpreview_8b.py", SHRINK + NCP)}
FLOAT32 = ["model.param_dtype=float32", "model.dtype=float32"]
# The steps compile without LLVM's optimisations, in half the CPU time: the same HLO, so the same
# dtypes and, up to the order of a sum, the same numbers.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def setup(cfg):
  """(mesh of one device, optimiser, state shardings) of cfg."""
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  _, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  return mesh, tx, steps.state_shardings(abstract, tx, mesh)


def train(cfg, state, batches, mesh, tx, shardings):
  """The state after one train step on each of `batches`, from `state` (left as it is), as NumPy."""
  graphdef, _ = abstract_model(cfg)
  train_step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg))
  train_step = train_step.lower(state, batches[0]).compile(FAST_COMPILE)
  state = jax.tree.map(jnp.copy, state)  # the step donates its input
  for batch in batches:
    state, _ = train_step(state, batch)
  return jax.device_get(state)


def weight_changes(first, last):
  """{"a/b/c": final - initial parameter} in float64."""
  leaves = jax.tree_util.tree_flatten_with_path(first)[0]
  return {"/".join(str(k.key) for k in path): np.asarray(b, np.float64) - np.asarray(a, np.float64)
          for (path, a), b in zip(leaves, jax.tree.leaves(last))}


def as_float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@pytest.mark.parametrize("recipe", [r if r == "olmo3_7b" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])  # slow: by time
def test_recipe_precision_trains_like_float32(recipe):
  """10 steps in the recipe's precision move every parameter, norm scales included, by 0.8-1.25
  times the float32 run's change, at a cosine of at least 0.9 to it."""
  name, shrink = RECIPES[recipe]
  path = os.path.join(ROOT, "configs", name)
  cfg = load_config(path, shrink)
  mesh, tx, shardings = setup(cfg)
  start = jax.jit(lambda: steps.init_state(cfg, cfg.train.seed, tx, shardings)).lower().compile(FAST_COMPILE)()
  first = jax.device_get(start["params"])
  batches = [ragged_batch(cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size, seed=i)
             for i in range(cfg.train.steps)]
  state = train(cfg, start, batches, mesh, tx, shardings)
  reference = train(load_config(path, shrink + FLOAT32), as_float32(start), batches, mesh, tx, shardings)
  got, want = weight_changes(first, state["params"]), weight_changes(first, reference["params"])

  assert got.keys() == want.keys() and any("norm" in key for key in want)
  bad = []
  for key, w in want.items():
    g, w_norm = got[key], np.linalg.norm(w)
    if w_norm == 0:  # no gradient reaches it (a softmax over one CRC source): nor may it move here
      if np.any(g):
        bad.append(f"{key}: moved by {np.linalg.norm(g):.3g}, in float32 not at all")
      continue
    ratio, cos = np.linalg.norm(g) / w_norm, float(np.vdot(g, w) / max(np.linalg.norm(g) * w_norm, 1e-300))
    if not (0.8 <= ratio <= 1.25 and cos >= 0.9):
      bad.append(f"{key}: norm ratio {ratio:.3f}, cosine {cos:.3f}")
  assert not bad, f"{recipe}, weight change after {cfg.train.steps} steps against float32: " + "; ".join(bad)

  # The precision: float32 master parameters and optimiser state (moments, Muon's momentum), bf16 compute.
  assert (cfg.model.param_dtype, cfg.model.dtype, cfg.optim.name, cfg.optim.lr) == ("float32", "bfloat16", "muon", 6e-5)
  assert {x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)} == {np.dtype("float32")}
  graphdef, abstract = abstract_model(cfg)
  out = jax.eval_shape(lambda p: nnx.merge(graphdef, p)(jnp.zeros((1, 32), jnp.int32), logits=False), abstract)
  assert out.hidden.dtype == jnp.bfloat16


def test_bf16_storage_is_refused_unless_asked_for():
  with pytest.raises(ConfigError, match=r"model\.param_dtype: 'bfloat16' .* no float32 master copy.*"
                                        r"model\.param_dtype=float32 with model\.dtype=bfloat16.*"
                                        r"model\.allow_bf16_params=True"):
    load_config(TINY, TINY_OVERRIDES + ["model.param_dtype=bfloat16"])
  cfg = load_config(TINY, TINY_OVERRIDES + ["model.param_dtype=bfloat16", "model.allow_bf16_params=True"])
  assert cfg.model.param_dtype == "bfloat16"


def test_embedding_gradient_sums_in_float32():
  """bf16 compute: a token seen 4096 times gets 4096 times its row's gradient, not bf16's 256."""
  tokens = jnp.full((2, 2048), 7, jnp.int32)
  lookup = lambda table: jnp.sum(embed_lookup(table, tokens, jnp.bfloat16).astype(jnp.float32))
  row = np.asarray(jax.grad(lookup)(jnp.zeros((16, 8), jnp.float32)))[7]
  np.testing.assert_array_equal(row, np.full(8, 4096.0, np.float32))
