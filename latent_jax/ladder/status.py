"""ladder status: each point done (recorded), partial (its workdir has started) or missing; and the tune's table."""
import os

from latent_jax import paths
from latent_jax.ladder.points import ladder_points, read_results, tune_rows
from latent_jax.ladder.run import read_result, results_dir
from latent_jax.ladder.tune import tune_markdown, tune_summary
from latent_jax.train.metrics import read_metrics


def point_status(ladder, workdir, point):
  """(state, the last validation loss or None, the last step trained)."""
  result = read_result(ladder, workdir, point)
  if result:
    return result["status"], result["val_loss"], point.steps
  rows = read_metrics(os.path.join(workdir, point.name))
  if not rows:
    return "missing", None, 0
  with_val = [r for r in rows if "val_loss" in r]
  return "partial", with_val[-1]["val_loss"] if with_val else None, rows[-1]["step"]


def status(ladder, workdir, points, notes=(), log=print):
  """Print one line per point and a count per state, then the plan's notes; returns {state: count}."""
  counts = {}
  for p in points:
    state, val, step = point_status(ladder, workdir, p)
    counts[state] = counts.get(state, 0) + 1
    val_text = f"{val:.4f}" if val is not None else "-"
    log(f"{p.name:40s} {state:8s} step {step:>6}/{p.steps:<6} val_loss {val_text}")
  log(", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + f" of {len(points)} points planned so far")
  for n in notes:
    log(n)
  return counts


def write_tune(ladder, workdir, log=print):
  """Write RESULTS/tune.md (the sweep and each method's factor) when the ladder has a tune; print it."""
  if not ladder.tune.sizes:
    return None
  recorded = read_results(results_dir(ladder, workdir))
  tune = [p for p in ladder_points(ladder, recorded, store_required=False)[0] if p.stage == "tune"]
  rows = tune_rows(tune, recorded)
  text = ("# The learning-rate tune\n\nValidation loss (nats/token) at each factor of the rule's learning rate, "
          f"budget {ladder.tune.budget:.3g} FLOPs, seed {ladder.tune.seed}; a sweep whose lowest loss is at its "
          "smallest or largest factor takes one more factor beyond it (up to tune.max_factors). A method's factor "
          "at a point's size is interpolated in ln N between its tuned sizes' best (held at the nearest beyond "
          "them, where the rule's N^-1/3 carries the learning rate).\n\n" + tune_markdown(tune_summary(rows)))
  path = os.path.join(results_dir(ladder, workdir), "tune.md")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  paths.write_atomic(path, lambda f: f.write(text.encode()))
  log(text)
  log(f"wrote {path}")
  return path
