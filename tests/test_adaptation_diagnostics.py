"""experiments/adaptation_diagnostics.py's concept-path ablations, against second ways of computing them:
p zeroed equals a ConceptLM whose codebook is zero (p is a mixture of codewords); p shuffled over rows
that are all the same changes nothing; cutting the path changes the loss where p zeroed alone did."""
import os
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import ROOT
from latent_jax import build_model, load_config, objectives

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import adaptation_diagnostics as diag  # noqa: E402

SMALL = ["model.vocab_size=64", "model.d_model=16", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=8",
         "model.mlp_dim=32", "model.window=3", "model.full_attention_every=2", "model.num_segments=4",
         "model.codebook_size=8", "model.residual_hidden=4", "model.crc_scale_init=0.5", "data.seq_len=16",
         "kernels.impl=xla"]


def model_and_batch(rows_alike=False):
  cfg = load_config(os.path.join(ROOT, "configs", "tiny_ncp.py"), SMALL)
  model = build_model(cfg.model, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(1 if rows_alike else 3, 17))
  tokens = np.repeat(tokens, 3, axis=0) if rows_alike else tokens
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
           "segment_ids": jnp.zeros((3, 16), jnp.int32), "positions": jnp.tile(jnp.arange(16), (3, 1))}
  return cfg, model, batch


def loss(model, cfg, batch):
  return float(objectives.eval_sums(model, batch, cfg)[0])


def test_the_ablations_against_second_ways_of_computing_them():
  cfg, model, batch = model_and_batch()
  as_trained = loss(model, cfg, batch)
  zeroed = loss(diag.ablated(nnx.clone(model), "p zeroed"), cfg, batch)
  model.codebook[...] = jnp.zeros_like(model.codebook[...])
  np.testing.assert_allclose(zeroed, loss(model, cfg, batch), rtol=1e-6)
  assert abs(zeroed - as_trained) > 1e-4  # the injection matters to a random model: the check can fail

  cfg, model, batch = model_and_batch(rows_alike=True)
  as_trained = loss(model, cfg, batch)
  np.testing.assert_allclose(loss(diag.ablated(nnx.clone(model), "p shuffled"), cfg, batch), as_trained, rtol=1e-6)
  zeroed = loss(diag.ablated(nnx.clone(model), "p zeroed"), cfg, batch)
  cut = loss(diag.ablated(nnx.clone(model), "concept path cut"), cfg, batch)
  assert abs(cut - zeroed) > 1e-5  # the CRC route from the concept module carried something
