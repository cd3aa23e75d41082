"""Metrics to WORKDIR/metrics.jsonl (one JSON object per logged step), TensorBoard, and optionally
Weights & Biases (train.wandb_project, the `wandb` extra): the same scalars, the run's config, and on
resume the same W&B run (its id is kept in WORKDIR/wandb_run_id).

Process 0 keeps metrics.jsonl open for the run and flushes each row as it writes it, so a local
file holds every row logged so far. A bucket has no appends, and an object appears only when its
upload ends: there the rows so far are uploaded whole after every evaluation, at least every
UPLOAD_SECONDS, and when the run ends, stops or fails (TensorBoard's events are uploaded every two
minutes), so a hard kill loses at most the rows of the last few minutes.
"""
import json
import math
import os
import time
import uuid

import jax

from latent_jax import paths

UPLOAD_SECONDS = 300.0  # a long run's rows (~50 MB at 7B scale) are uploaded whole: not at every step


class MetricsWriter:
  def __init__(self, workdir, resume_step=0, cfg=None):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.file = self.tb = self.rows = self.wandb = None
    if not self.enabled:
      return
    # On resume, forget rows logged after the restored checkpoint: they will be logged again.
    kept = [r for r in read_rows(self.path, warn=True) if r["step"] <= resume_step] if paths.path(
        self.path).exists() else []
    lines = [json.dumps(r) + "\n" for r in kept]
    if paths.is_url(self.path):
      self.rows, self.uploaded = lines, time.monotonic()
    else:
      self.file = paths.path(self.path).open("w")
      self.file.writelines(lines)
      self.file.flush()
    from tensorboardX import SummaryWriter  # imported here: only the writing process needs it
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
    if cfg is not None and cfg.train.get("wandb_project"):
      self.wandb = open_wandb(workdir, cfg)

  def write(self, step, metrics, upload=False):
    """One row; `upload`: in a bucket, upload the rows now (the loop asks after an evaluation)."""
    if not self.enabled:
      return
    row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
    if self.rows is None:
      self.file.write(json.dumps(row) + "\n")
      self.file.flush()
    else:
      self.rows.append(json.dumps(row) + "\n")
      if upload or time.monotonic() - self.uploaded >= UPLOAD_SECONDS:
        self.upload()
    scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
    for k, v in scalars.items():
      self.tb.add_scalar(k, v, step)
    if self.wandb is not None:
      self.wandb.log(scalars, step=int(step))

  def upload(self):
    """Write the bucket's metrics.jsonl whole: one object, every row so far."""
    paths.path(self.path).write_text("".join(self.rows))
    self.uploaded = time.monotonic()

  def close(self):
    if self.file is not None:
      self.file.close()
    if self.rows is not None:
      self.upload()
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()


def open_wandb(workdir, cfg):
  """The run's W&B run: a new one, or on resume the one whose id WORKDIR/wandb_run_id keeps. W&B drops
  rows of steps it has already seen, so a resumed run's re-logged steps (after its checkpoint) are skipped
  there; metrics.jsonl and TensorBoard rewrite them."""
  import wandb  # the wandb extra; config validation has checked that it is installed
  id_path = os.path.join(workdir, "wandb_run_id")
  if paths.path(id_path).exists():
    run_id = paths.path(id_path).read_text().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    paths.write_atomic(id_path, lambda f: f.write(run_id.encode()))
  return wandb.init(project=cfg.train.wandb_project, id=run_id, resume="allow", name=os.path.basename(
      os.path.abspath(workdir)), config=cfg.to_dict(), dir=workdir)


def to_python(v):
  v = v.item() if hasattr(v, "item") else v
  return v if not isinstance(v, float) or math.isfinite(v) else str(v)


def read_rows(path, warn=False):
  """The rows of a metrics.jsonl; a line that is not a whole JSON row (a write cut short by a kill)
  is skipped, with a notice when `warn`."""
  rows = []
  with paths.path(path).open("r") as f:
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
  return read_rows(path) if paths.path(path).exists() else []
