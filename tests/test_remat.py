"""model.remat: every policy gives the loss and gradients of "none", and each keeps less for the
backward pass than the one before it (compiled temp memory), so that none of them is a no-op."""
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES, ragged_batch
from latent_jax import ConfigError, build_model, load_config
from latent_jax.config import config_from_json
from latent_jax import checkpoint, objectives
from latent_jax.train import resume

TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
NCP = ["model.encoder_layers=1", "model.concept_layers=1", "model.decoder_layers=2", "model.num_segments=4",
       "model.codebook_size=8", "model.residual_hidden=8"]
CASES = {"baseline": (TINY, []), "concept": (TINY_NCP, NCP + ["model.irc=False"]), "concept_irc": (TINY_NCP, NCP)}


def loss_grads_and_memory(path, overrides, policy, batch):
  """(loss, gradients) of the configured objective under model.remat=`policy`, and the temp bytes
  XLA allocates for computing them."""
  cfg = load_config(path, TINY_OVERRIDES + overrides + ["train.z_loss=1e-3", f"model.remat={policy}"])
  graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))
  objective = objectives.objective_for(cfg)
  compiled = jax.jit(jax.value_and_grad(lambda p: objective(nnx.merge(graphdef, p), batch, cfg)[0])).lower(
      params).compile()
  return jax.device_get(compiled(params)), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("case", [c if c == "baseline" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])  # slow: by time
def test_policies_give_the_same_gradients_and_keep_less(case):
  batch = ragged_batch(4, 32, 320, seed=1)
  got = {p: loss_grads_and_memory(*CASES[case], p, batch) for p in ("none", "full", "matmuls")}
  (loss, grads), _ = got["none"]
  for policy in ("full", "matmuls"):
    (other_loss, other_grads), _ = got[policy]
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
  memory = {p: m for p, (_, m) in got.items()}
  if case == "concept_irc":  # IRC stacks recompute whole layers under any policy (nn.concept.history_scan)
    assert memory["none"] > memory["full"] == memory["matmuls"], memory
  else:
    assert memory["none"] > memory["matmuls"] > memory["full"], memory


@pytest.mark.parametrize("value", ["block", "True"])
def test_unknown_policy_is_a_config_error(value):
  with pytest.raises(ConfigError, match=r"model\.remat.*'none', 'full', 'matmuls'"):
    load_config(TINY, [f"model.remat={value}"])


def test_checkpoints_saved_with_a_bool_remat_still_load():
  saved = checkpoint.config_to_json(load_config(TINY))
  for old, policy in [(True, "full"), (False, "none")]:
    saved["model"]["remat"] = old
    assert config_from_json(saved).model.remat == policy


def test_remat_and_microbatches_may_change_on_resume():
  """Neither changes the state's layout or the math: a resume on other hardware may change them."""
  saved = checkpoint.config_to_json(load_config(TINY))
  now = checkpoint.config_to_json(load_config(TINY, ["model.remat=matmuls", "train.microbatches=4"]))
  notices = resume.check_config(saved, now, "runs/x/checkpoints/10")
  assert notices == ["resuming with changed config: model.remat: 'none' -> 'matmuls'",
                     "resuming with changed config: train.microbatches: 1 -> 4"]
  saved["model"]["remat"] = True  # a checkpoint from before remat policies
  assert resume.check_config(saved, now, "runs/x/checkpoints/10")[0].endswith("model.remat: True -> 'matmuls'")
