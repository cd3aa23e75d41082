"""A whole training loss and its gradients are the same with every kernel implementation."""
import jax
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import build_model, load_config, objectives


def loss_and_grads(cfg, impl, batch):
  cfg.kernels.impl = impl
  graphdef, state = nnx.split(build_model(cfg.model, nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  objective = objectives.objective_for(cfg)
  fn = jax.jit(jax.value_and_grad(lambda p: objective(nnx.merge(graphdef, p), batch, cfg), has_aux=True))
  (total, _), grads = fn(params)
  return float(total), grads


@pytest.mark.parametrize("config", ["tiny.py", pytest.param("tiny_ncp.py", marks=pytest.mark.slow)])  # slow: by time
def test_train_loss_and_grads_agree_across_impls(config):
  cfg = load_config(f"{ROOT}/configs/{config}", [o for o in TINY_OVERRIDES if not o.startswith("kernels")])
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, size=(2, cfg.data.seq_len + 1)).astype(np.int32)
  targets = tokens[:, 1:].copy()
  targets[0, -3:] = -1  # ignored labels too
  batch = {"inputs": tokens[:, :-1], "targets": targets, "segment_ids": np.ones_like(targets),
           "positions": np.tile(np.arange(cfg.data.seq_len, dtype=np.int32), (2, 1))}
  ref_loss, ref_grads = loss_and_grads(cfg, "naive", batch)
  for impl in ("xla", "pallas_interpret"):
    loss, grads = loss_and_grads(cfg, impl, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5), impl
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6, err_msg=impl)
