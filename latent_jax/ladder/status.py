"""ladder status: each point done (recorded), partial (its workdir has started) or missing."""
import os

from latent_jax.ladder.run import read_result
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


def status(ladder, workdir, points, log=print):
  """Print one line per point and a count per state; returns {state: count}."""
  counts = {}
  for p in points:
    state, val, step = point_status(ladder, workdir, p)
    counts[state] = counts.get(state, 0) + 1
    val_text = f"{val:.4f}" if val is not None else "-"
    log(f"{p.name:32s} {state:8s} step {step:>6}/{p.steps:<6} val_loss {val_text}")
  log(", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + f" of {len(points)} points")
  return counts
