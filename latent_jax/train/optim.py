"""Optimisers (AdamW; Muon for hidden matrices with AdamW for the rest), schedules and masks."""
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from latent_jax.config import ConfigError
from latent_jax.config import warmup_steps as config_warmup_steps
from latent_jax.nn.concept import VQ_PARAMS
from latent_jax.nn.lora import LORA_PARAMS

# Named values of optim.trainable. "vq": the NCP paper's VQ adaptation (Sec. 5.1), which trains
# only the codebook and the concept prediction heads (with the norm in front of them); "lora": the
# LoRA factors (lora.enabled, docs/lora.md), which optim.trainable="all" means in a LoRA run.
TRAINABLE_PRESETS = {"vq": VQ_PARAMS, "lora": LORA_PARAMS}


def learning_rate_schedule(o, steps, total_steps=None):
  """Linear warmup to `lr`, then cosine or warmup-stable-decay (WSD) down to lr*min_lr_ratio, over `steps`.
  A warmup given as a fraction (below 1) is of `total_steps` (train.steps; default `steps`): a TST phase
  with its own schedule (tst.carry='params') warms up as long as the whole run would."""
  floor = o.lr * o.min_lr_ratio
  warmup_steps = min(config_warmup_steps(o, total_steps or steps), max(steps - 1, 0))
  warmup = optax.linear_schedule(0.0, o.lr, warmup_steps)
  rest = max(1, steps - warmup_steps)
  if o.schedule == "cosine":
    after = optax.cosine_decay_schedule(o.lr, rest, alpha=o.min_lr_ratio)
  elif o.schedule == "wsd":
    decay = max(1, round(steps * o.decay_fraction))
    stable = max(0, rest - decay)
    after = optax.join_schedules([optax.constant_schedule(o.lr), optax.linear_schedule(o.lr, floor, decay)], [stable])
  else:
    after = optax.constant_schedule(o.lr)
  return optax.join_schedules([warmup, after], [warmup_steps])


def is_matrix(axes):
  """A hidden-layer matrix: two named dims, neither of them the vocabulary."""
  return len(axes) == 2 and "vocab" not in axes


def decays(axes):
  """Weight decay on every matrix but the token embedding; never on norms or vectors."""
  return len(axes) >= 2 and tuple(axes) != ("vocab", "embed")


def is_axes(x):
  return isinstance(x, tuple)


def trainable_mask(axes, trainable):
  """True for each parameter that trains: optim.trainable is "all", a preset name
  (TRAINABLE_PRESETS) or a regex matched against whole "a/b/c" parameter paths."""
  paths = jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p, simple=True, separator="/"), axes,
                                           is_leaf=is_axes)
  if trainable == "all":
    return jax.tree.map(lambda _: True, paths)
  pattern = re.compile(TRAINABLE_PRESETS.get(trainable, trainable))
  mask = jax.tree.map(lambda path: pattern.fullmatch(path) is not None, paths)
  if not any(jax.tree.leaves(mask)):
    names = ", ".join(sorted(jax.tree.leaves(paths))[:8])
    raise ConfigError(f"optim.trainable: {trainable!r} matches no parameter of this model; it is matched against "
                      f"whole paths such as {names}, ...; use 'all' to train everything.")
  return mask


def build_optimizer(o, steps, axes, trainable=None, total_steps=None):
  """optax transformation for params whose logical axes are the tree `axes` (tuples as leaves).

  Parameters outside optim.trainable (or `trainable`, where given: config.trainable_setting's, which
  a LoRA run needs) get no update and no optimiser state.
  """
  schedule = learning_rate_schedule(o, steps, total_steps)
  wd_mask = jax.tree.map(decays, axes, is_leaf=is_axes)
  transforms = {"adam": optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                    mask=wd_mask),
                "frozen": optax.set_to_zero()}
  if o.name == "muon":
    # Orthogonalise the last two dims; a leading stacked-layer dim is a batch dim, so
    # Newton-Schulz runs per layer. consistent_rms=0.2 is Moonlight's 0.2*sqrt(max(din, dout)).
    dims = lambda params: jax.tree.map(lambda p: MuonDimensionNumbers(p.ndim - 2, p.ndim - 1), params)
    transforms["muon"] = optax.contrib.muon(schedule, beta=0.95, weight_decay=o.weight_decay, weight_decay_mask=None,
                                            muon_weight_dimension_numbers=dims, consistent_rms=0.2)
  labels = jax.tree.map(lambda a, train: ("muon" if o.name == "muon" and is_matrix(a) else "adam") if train
                        else "frozen", axes, trainable_mask(axes, trainable or o.get("trainable", "all")),
                        is_leaf=is_axes)
  used = set(jax.tree.leaves(labels))
  if used == {"adam"}:
    tx = transforms["adam"]  # the plain AdamW state, as checkpoints of earlier runs hold it
  else:
    tx = optax.partition({k: v for k, v in transforms.items() if k in used}, labels)
  if o.clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
  if o.get("skip_factor", 0) > 0:
    tx = skip_spikes(tx, o.skip_factor, o.skip_window)
  return tx, schedule


class SpikeGuardState(NamedTuple):
  norms: jax.Array      # float32 [window]: gradient norms of the last applied steps (the first `known` filled)
  known: jax.Array      # int32: norms held, up to window (the state stays finite: the loop checks it)
  position: jax.Array   # int32: where the next applied step's norm goes
  skipped: jax.Array    # int32: steps not applied so far
  inner: optax.OptState


MIN_HISTORY = 10  # norms the running median needs before the guard skips anything


def skip_spikes(inner, factor, window):
  """Skip a step whose gradient norm exceeds `factor` times the median of the last `window` applied
  steps' norms: a zero update, the inner optimiser's state unchanged, the step counted. The history
  lives in the optimiser state, so a resumed run skips exactly as an uninterrupted one."""
  def init(params):
    zero = jnp.zeros((), jnp.int32)
    return SpikeGuardState(jnp.zeros((window,), jnp.float32), zero, zero, zero, inner.init(params))

  def update(updates, state, params=None):
    norm = optax.tree.norm(updates).astype(jnp.float32)
    median = jnp.nanmedian(jnp.where(jnp.arange(window) < state.known, state.norms, jnp.nan))
    spike = (state.known >= min(MIN_HISTORY, window)) & (norm > factor * median)
    new_updates, new_inner = inner.update(updates, state.inner, params)
    keep = lambda old, new: jax.tree.map(lambda a, b: jnp.where(spike, a, b), old, new)
    return (jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates),
            SpikeGuardState(jnp.where(spike, state.norms, state.norms.at[state.position].set(norm)),
                            jnp.where(spike, state.known, jnp.minimum(state.known + 1, window)),
                            jnp.where(spike, state.position, (state.position + 1) % window),
                            state.skipped + spike.astype(jnp.int32), keep(state.inner, new_inner)))

  return optax.GradientTransformation(init, update)


def skipped_steps(opt_state):
  """The spike guard's count of skipped steps in an optimiser state, or None without a guard."""
  return opt_state.skipped if isinstance(opt_state, SpikeGuardState) else None
