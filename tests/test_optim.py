"""Optimiser routing, schedules and FLOPs accounting against independent re-derivations."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from latent_jax.ops import transformer as T
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import flops
from latent_jax.train.optim import build_optimizer, learning_rate_schedule


def muon_updates(tiny_cfg, scale_layer=None):
  """First Muon-run update (lr 1, no warmup, no decay) for a random gradient."""
  from flax import nnx
  tiny_cfg.optim.update(name="muon", lr=1.0, warmup_steps=0, weight_decay=0.0, clip_norm=0.0)
  _, abstract = abstract_model(tiny_cfg.model)
  tx, _ = build_optimizer(tiny_cfg.optim, 10, axes_tree(abstract))
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nnx.to_pure_dict(abstract))
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
  if scale_layer is not None:
    g = grads["blocks"]["blocks"]["mlp"]["gate"]
    grads["blocks"]["blocks"]["mlp"]["gate"] = g.at[scale_layer].multiply(100.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  return updates


def test_muon_gets_hidden_matrices_adamw_the_rest(tiny_cfg):
  """AdamW's first update is -lr * sign(g) elementwise; Muon's (orthogonalised) is not."""
  updates = muon_updates(tiny_cfg)
  is_adam = lambda u: bool(np.allclose(np.abs(np.asarray(u)), 1.0, atol=1e-3))
  assert is_adam(updates["embed"]) and is_adam(updates["lm_head"]) and is_adam(updates["final_norm"]["scale"])
  blocks = updates["blocks"]["blocks"]
  assert is_adam(blocks["attn_norm"]["scale"]) and is_adam(blocks["attn"]["q_norm"]["scale"])
  for name in ("q", "k", "v", "o"):
    assert not is_adam(blocks["attn"][name]), name
  for name in ("gate", "up", "down"):
    assert not is_adam(blocks["mlp"][name]), name


def test_muon_orthogonalises_each_scanned_layer_separately(tiny_cfg):
  """A stacked [L, din, dout] gradient: each layer is orthogonalised on its own."""
  u = np.asarray(muon_updates(tiny_cfg, scale_layer=1)["blocks"]["blocks"]["mlp"]["gate"])  # [L, d, f]
  norms = [np.linalg.norm(u[i]) for i in range(u.shape[0])]
  # Scaling one layer's gradient by 100 leaves its update's size alone (no cross-layer norm).
  assert norms[1] == pytest.approx(norms[0], rel=0.15)
  s = np.linalg.svd(u[0], compute_uv=False)
  assert s.max() / s.min() < 3  # Newton-Schulz pushes the singular values toward one another


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_schedules_against_closed_form(tiny_cfg, schedule):
  o = tiny_cfg.optim
  o.update(schedule=schedule, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
  fn = learning_rate_schedule(o, 100)

  def want(t):
    if t < 10:
      return t / 10
    if schedule == "cosine":
      return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 10) / 90))
    if schedule == "wsd":
      return 1.0 if t < 80 else 1.0 - 0.9 * (t - 80) / 20
    return 1.0

  for t in [0, 5, 10, 37, 79, 80, 90, 100]:
    assert float(fn(t)) == pytest.approx(want(t), abs=1e-5), t


def test_warmup_as_a_fraction_of_the_steps():
  """optim.warmup_steps below 1 is a fraction of train.steps: configs/tiny.py's 50 of 600 steps, so that
  --config.train.steps=40 alone runs (3 warmup steps) where warmup_steps=50 refused it; whole numbers
  (configs/d512.py's, the experiments' and the ladder's overrides) stay steps."""
  from conftest import TINY
  from latent_jax import load_config
  from latent_jax.config import ConfigError, warmup_steps
  for overrides, want in (([], 50), (["train.steps=40"], 3), (["train.steps=40", "optim.warmup_steps=25"], 25),
                          (["optim.warmup_steps=0"], 0), (["train.steps=2"], 0)):
    cfg = load_config(TINY, overrides)
    assert warmup_steps(cfg.optim, cfg.train.steps) == want, overrides
    fn = learning_rate_schedule(cfg.optim, cfg.train.steps)
    assert float(fn(want)) == pytest.approx(cfg.optim.lr) and (want == 0 or float(fn(want - 1)) < cfg.optim.lr)
  # A TST phase with its own schedule (tst.carry='params') warms up as long as the whole run: 50 of 600 steps.
  fn = learning_rate_schedule(load_config(TINY).optim, 180, total_steps=600)
  assert float(fn(49)) < float(fn(50)) == pytest.approx(3e-3)
  # A run saved with warmup_steps=50 (tiny.py's before the fraction) resumes with no notice: the same 50 steps.
  from latent_jax.checkpoint import config_to_json
  from latent_jax.train import resume
  saved = config_to_json(load_config(TINY, ["optim.warmup_steps=50"]))
  saved["optim"]["warmup_steps"] = 50
  assert resume.check_config(saved, config_to_json(load_config(TINY)), "runs/x/checkpoints/600") == []
  assert resume.check_config(saved, config_to_json(load_config(TINY, ["train.steps=1200"])), "runs/x/checkpoints/600") == [
      "resuming with changed config: optim.warmup_steps: 50 -> 0.08333333333333333",
      "resuming with changed config: train.steps: 600 -> 1200"]
  for bad in ("2.5", "40"):
    with pytest.raises(ConfigError, match=rf"optim\.warmup_steps: {bad} must lie in \[0, train\.steps=40\)"):
      load_config(TINY, ["train.steps=40", f"optim.warmup_steps={bad}"])


def test_weight_decay_skips_embeddings_and_norms(tiny_cfg):
  tiny_cfg.optim.update(lr=1.0, weight_decay=0.5, clip_norm=0.0, warmup_steps=0)
  from flax import nnx
  _, abstract = abstract_model(tiny_cfg.model)
  tx, _ = build_optimizer(tiny_cfg.optim, 10, axes_tree(abstract))
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), nnx.to_pure_dict(abstract))
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)  # zero gradient: only decay moves params
  assert float(jnp.abs(updates["embed"]).max()) == 0
  assert float(jnp.abs(updates["final_norm"]["scale"]).max()) == 0
  assert float(updates["lm_head"].mean()) == pytest.approx(-0.5)
  assert float(updates["blocks"]["blocks"]["mlp"]["up"].mean()) == pytest.approx(-0.5)


@pytest.mark.parametrize("seq_len,window", [(16, 4), (16, T.NO_WINDOW), (7, 3)])
def test_attention_flops_count_the_keys_the_mask_lets_through(seq_len, window):
  pos = jnp.arange(seq_len)[None]
  seg = jnp.ones((1, seq_len), jnp.int32)
  visible = np.asarray(T.attention_mask(pos, pos, seg, seg, window)).sum() / seq_len
  assert flops.mean_visible_keys(seq_len, window) == pytest.approx(visible)


def test_baseline_flops_per_token_by_hand(tiny_cfg):
  m = tiny_cfg.model  # d 32, 4 heads, 2 kv, head 8, mlp 64, 2 layers, window 8 on layer 1
  per_layer_matmul = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64)
  keys = [np.minimum(np.arange(1, 33), 8).mean(), np.arange(1, 33).mean()]
  forward = sum(per_layer_matmul + 4 * 4 * 8 * k for k in keys) + 2 * 32 * 320
  assert flops.baseline_flops_per_token(m, 32) == pytest.approx(3 * forward)
