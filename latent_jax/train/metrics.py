"""Metrics to WORKDIR/metrics.jsonl (one JSON object per logged step) and TensorBoard."""
import json
import math
import os

import jax


class MetricsWriter:
  def __init__(self, workdir, resume_step=0):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb = None
    if not self.enabled:
      return
    drop_rows_after(self.path, resume_step)
    from tensorboardX import SummaryWriter  # imported here: only the writing process needs it
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

  def write(self, step, metrics):
    if not self.enabled:
      return
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
        self.tb.add_scalar(k, v, step)

  def close(self):
    if self.tb is not None:
      self.tb.close()


def to_python(v):
  v = v.item() if hasattr(v, "item") else v
  return v if not isinstance(v, float) or math.isfinite(v) else str(v)


def drop_rows_after(path, step):
  """On resume, forget rows logged after the restored checkpoint: they will be logged again.
  A line torn by a kill in mid-write is dropped too, with a notice."""
  if not os.path.exists(path):
    return
  rows = read_rows(path, warn=True)
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= step)


def read_rows(path, warn=False):
  """The rows of a metrics.jsonl; a line that is not a whole JSON row (a torn write) is skipped."""
  rows = []
  with open(path) as f:
    for lineno, line in enumerate(f, start=1):
      try:
        row = json.loads(line) if line.strip() else None
      except json.JSONDecodeError:
        row = None
        if warn:
          print(f"warning: {path}:{lineno} is not a whole JSON row (a write cut short); dropped it")
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  return rows


def read_metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  return read_rows(path) if os.path.exists(path) else []
