"""Optimisers (AdamW; Muon for hidden matrices with AdamW for the rest), schedules and masks."""
import jax
import optax
from optax.contrib import MuonDimensionNumbers


def learning_rate_schedule(o, steps):
  """Linear warmup to `lr`, then cosine or warmup-stable-decay (WSD) down to lr*min_lr_ratio."""
  floor = o.lr * o.min_lr_ratio
  warmup = optax.linear_schedule(0.0, o.lr, o.warmup_steps)
  rest = max(1, steps - o.warmup_steps)
  if o.schedule == "cosine":
    after = optax.cosine_decay_schedule(o.lr, rest, alpha=o.min_lr_ratio)
  elif o.schedule == "wsd":
    decay = max(1, round(steps * o.decay_fraction))
    stable = max(0, rest - decay)
    after = optax.join_schedules([optax.constant_schedule(o.lr), optax.linear_schedule(o.lr, floor, decay)], [stable])
  else:
    after = optax.constant_schedule(o.lr)
  return optax.join_schedules([warmup, after], [o.warmup_steps])


def is_matrix(axes):
  """A hidden-layer matrix: two named dims, neither of them the vocabulary."""
  return len(axes) == 2 and "vocab" not in axes


def decays(axes):
  """Weight decay on every matrix but the token embedding; never on norms or vectors."""
  return len(axes) >= 2 and tuple(axes) != ("vocab", "embed")


def build_optimizer(o, steps, axes):
  """optax transformation for params whose logical axes are the tree `axes` (tuples as leaves)."""
  schedule = learning_rate_schedule(o, steps)
  is_axes = lambda x: isinstance(x, tuple)
  wd_mask = jax.tree.map(decays, axes, is_leaf=is_axes)
  adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=wd_mask)
  if o.name == "adamw":
    tx = adamw
  else:
    labels = jax.tree.map(lambda a: "muon" if is_matrix(a) else "adam", axes, is_leaf=is_axes)
    # Orthogonalise the last two dims; a leading stacked-layer dim is a batch dim, so
    # Newton-Schulz runs per layer. consistent_rms=0.2 is Moonlight's 0.2*sqrt(max(din, dout)).
    dims = lambda params: jax.tree.map(lambda p: MuonDimensionNumbers(p.ndim - 2, p.ndim - 1), params)
    muon = optax.contrib.muon(schedule, beta=0.95, weight_decay=o.weight_decay, weight_decay_mask=None,
                              muon_weight_dimension_numbers=dims, consistent_rms=0.2)
    tx = optax.partition({"muon": muon, "adam": adamw}, labels)
  if o.clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
  return tx, schedule
