"""The optional spike guard (optim.skip_factor): a step whose gradient norm exceeds skip_factor x the
running median of the applied steps' norms is not applied (counted and logged), the data position
advancing as usual, and a resumed run skips exactly as an uninterrupted one."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY, TINY_OVERRIDES


def test_a_spike_is_skipped_and_counted():
  from latent_jax.train.optim import MIN_HISTORY, skip_spikes, skipped_steps
  inner = optax.adam(0.1)
  tx = skip_spikes(inner, factor=5.0, window=20)
  params = {"w": jnp.ones(3)}
  state, ref_state, ref_params = tx.init(params), inner.init(params), params
  norms = [1.0 + 0.1 * (i % 3) for i in range(MIN_HISTORY)] + [100.0, 1.0, 4.9]
  for i, n in enumerate(norms):
    grads = {"w": jnp.full(3, n / np.sqrt(3))}  # global norm n
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    if n == 100.0:  # skipped: nothing moves, the inner state neither
      assert jax.tree.all(jax.tree.map(jnp.array_equal, new, params))
      assert jax.tree.all(jax.tree.map(jnp.array_equal, state.inner, ref_state))
    else:  # applied exactly as the inner optimiser alone would
      ref_updates, ref_state = inner.update(grads, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)
      np.testing.assert_array_equal(new["w"], ref_params["w"])
    params = new
  assert int(skipped_steps(state)) == 1
  # The median ignores the skipped norm: 4.9 < 5 x median(~1.1) was applied.
  assert float(np.median(np.asarray(state.norms)[:int(state.known)])) < 1.2


def test_before_enough_history_nothing_is_skipped():
  from latent_jax.train.optim import skip_spikes
  tx = skip_spikes(optax.sgd(0.1), factor=2.0, window=50)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  for n in (1.0, 50.0, 1.0):
    _, state = tx.update({"w": jnp.full(2, n)}, state, params)
  assert int(state.skipped) == 0


def test_bad_skip_factor_is_refused():
  from latent_jax import load_config
  from latent_jax.config import ConfigError
  with pytest.raises(ConfigError, match="optim.skip_factor"):
    load_config(TINY, ["optim.skip_factor=0.5"])


@pytest.mark.slow
def test_the_guard_resumes_exactly_and_logs_its_count(tmp_path):
  """Steps 1-6 straight equal 1-3, a resume, 4-6 (bitwise); every row logs skipped_steps."""
  from latent_jax import load_config
  from latent_jax.checkpoint import saved_params
  from latent_jax.train.loop import train
  from latent_jax.train.metrics import read_metrics
  # A high lr over a short window: the third step's gradient norm is about 3x the first two's (measured).
  guard = [*TINY_OVERRIDES, "optim.skip_factor=2.0", "optim.skip_window=2", "optim.lr=0.05", "train.checkpoint_every=3"]
  straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
  cfg = load_config(TINY, guard)
  train(cfg, straight)
  train(load_config(TINY, [*guard, "train.steps=3"]), split)
  train(cfg, split)
  rows, resumed = read_metrics(straight), read_metrics(split)
  assert rows[-1]["skipped_steps"] >= 1  # the guard acted, after the resume too
  assert [r["skipped_steps"] for r in resumed] == [r["skipped_steps"] for r in rows]
  assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
  a, b = (saved_params(w, cfg, 6) for w in (straight, split))
  assert jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
