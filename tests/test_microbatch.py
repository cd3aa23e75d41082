"""train.microbatches: one train step over k microbatches gives the loss, every logged term and the
gradients of the whole batch (k = 1), for every objective, on rows that score unequal numbers of
targets (so a mean of the microbatches' means would not do); and the settings that cannot split."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES, ragged_batch
from latent_jax import ConfigError, build_model, load_config
from latent_jax import objectives, sharding
from latent_jax.nn import abstract_model
from latent_jax.train import step as steps

CONFIGS = os.path.join(ROOT, "configs")
NCP = ["model.encoder_layers=1", "model.concept_layers=1", "model.decoder_layers=1", "model.num_segments=4",
       "model.codebook_size=8", "model.residual_hidden=8"]
CASES = {  # config, overrides, objective, tokens per row
    "baseline": ("tiny.py", [], objectives.lm_objective, 32),
    "nitp": ("tiny_nitp.py", [], objectives.lm_objective, 32),
    "mtp": ("tiny.py", ["mtp.enabled=True"], objectives.lm_objective, 32),
    "ncp": ("tiny_ncp.py", NCP, objectives.ncp_objective, 32),
    "tst_phase1": ("tiny_tst.py", ["tst.s=2", "nitp.enabled=True"], objectives.tst_objective, 64),
    "drafter": ("tiny_ncp.py", NCP, objectives.drafter_objective, 32),  # a drafter run on that target (drafter_run)
}


def drafter_run(target_cfg):
  """The config python -m latent_jax.draft trains with, for a target of config target_cfg."""
  from latent_jax.draft import run_config
  drafter = load_config(os.path.join(CONFIGS, "tiny_drafter.py"), [
      "target=unused", "drafter.block_size=3", "drafter.context=4", "drafter.anchors=5",
      f"data.batch_size={target_cfg.data.batch_size}", f"train.steps={target_cfg.train.steps}", "optim.warmup_steps=1"])
  return run_config(drafter, target_cfg)


def keep_gradients():
  """An 'optimiser' that leaves the params and keeps the last gradients as its state, to read them back."""
  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def step_once(cfg, objective, batch, k):
  """(metrics, gradients) of one train step with train.microbatches = k, on one device."""
  cfg.train.microbatches = k
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef, abstract = abstract_model(cfg)
  tx = keep_gradients()
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  state, metrics = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objective)(state, batch)
  return jax.device_get(metrics), jax.device_get(state["opt_state"])


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) for c in CASES])  # slow: by time
def test_microbatches_give_the_whole_batch_loss_and_gradients(case):
  name, overrides, objective, length = CASES[case]
  cfg = load_config(os.path.join(CONFIGS, name), TINY_OVERRIDES + overrides + ["train.z_loss=1e-3"])
  if case == "drafter":
    cfg = drafter_run(cfg)
  batch = ragged_batch(cfg.data.batch_size, length, cfg.model.vocab_size)
  k = 4
  # The microbatches (rows i, i+k, ...) score unequal numbers of targets: a mean of their means
  # is not the batch's mean, so the test below fails for it.
  scored = np.asarray(batch["targets"] >= 0).reshape(-1, k, length).sum((0, 2))
  assert len(set(scored.tolist())) > 1, scored
  whole, whole_grads = step_once(cfg, objective, batch, 1)
  split, split_grads = step_once(cfg, objective, batch, k)
  assert set(split) == set(whole) and {"loss", "total_loss", "grad_norm"} <= set(whole)
  for key in whole:
    np.testing.assert_allclose(split[key], whole[key], rtol=1e-5, err_msg=key)
  scale = max(np.abs(g).max() for g in jax.tree.leaves(whole_grads))
  for a, b in zip(jax.tree.leaves(split_grads), jax.tree.leaves(whole_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
  if case == "baseline":  # a mean of the microbatches' means misses by more than the tolerance
    graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))  # the step's initial params
    loss = lambda b: objective(nnx.merge(graphdef, params), b, cfg)[1]["loss"]
    means = jax.jit(jax.vmap(loss))(jax.tree.map(lambda x: x.reshape(-1, k, length).swapaxes(0, 1), batch))
    assert abs(float(np.mean(means)) - whole["loss"]) > 5e-5 * whole["loss"]


def test_microbatches_that_do_not_split_are_config_errors():
  with pytest.raises(ConfigError, match=r"train\.microbatches: 3 does not divide data\.batch_size=8"):
    load_config(TINY, TINY_OVERRIDES + ["train.microbatches=3"])
  with pytest.raises(ConfigError, match=r"train\.microbatches: must be a positive integer"):
    load_config(TINY, TINY_OVERRIDES + ["train.microbatches=0"])
  mesh = jax.sharding.AbstractMesh((2, 2, 1, 1), sharding.MESH_AXES)
  sharding.check_batch(8, mesh, 2)
  with pytest.raises(ConfigError, match=r"data\.batch_size=8 in train\.microbatches=4 microbatches of 2 rows "
                                        r"does not divide over data\*fsdp\*expert=4"):
    sharding.check_batch(8, mesh, 4)


SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=900")
    sys.path.insert(0, "tests")
    import jax, numpy as np
    from conftest import TINY, TINY_OVERRIDES, ragged_batch
    from latent_jax import load_config
    from latent_jax import sharding
    from latent_jax.nn import abstract_model, axes_tree
    from latent_jax.train import step as steps
    from latent_jax.train.optim import build_optimizer

    cfg = load_config(TINY, TINY_OVERRIDES)
    batch = ragged_batch(8, 32, 320)

    def run(mesh_sizes, devices, k):
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_sizes
      cfg.train.microbatches = k
      mesh = sharding.make_mesh(cfg.mesh, devices)
      sharding.check_batch(cfg.data.batch_size, mesh, k)
      graphdef, abstract = abstract_model(cfg.model)
      tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
      shard = steps.state_shardings(abstract, tx, mesh)
      state = steps.init_state(cfg.model, 0, tx, shard)
      state, metrics = steps.make_train_step(graphdef, tx, cfg, shard, mesh)(state, sharding.global_batch(batch, mesh))
      return jax.device_get(metrics), jax.device_get(state["params"])

    one, one_params = run((1, 1, 1), jax.devices()[:1], 1)
    many, many_params = run((2, 2, 1), jax.devices(), 2)
    for key in one:
      np.testing.assert_allclose(many[key], one[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(one_params), jax.tree.leaves(many_params)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    print("OK")
""")


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_sharded_microbatches_equal_one_device():
  """k = 2 microbatches on a (data 2, fsdp 2) mesh of 4 fake CPU devices against one device, k = 1."""
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "OK" in result.stdout
