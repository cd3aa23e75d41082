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
  """On resume, forget rows logged after the restored checkpoint: they will be logged again."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
  with open(path, "w") as f:
    f.writelines(rows)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
