"""ladder run: train the points here, one after another, each with the train command in its own process.

The plan is read again after every point, since it grows as results land (the tune's factors set the
ladder's learning rates; a minimum at an edge widens its sizes). A point whose result is recorded
(RESULTS/points/NAME.json, RESULTS/tune/NAME.json) is only read; a point whose workdir holds a finished
run is recorded from it; a partial workdir resumes (train's own resume). A point that stops on a signal
stops the ladder (run it again to go on); one that diverges (a non-finite loss) is recorded as such and
the ladder goes on. Results are small JSON files meant to be committed, so that a ladder stopped on one
machine goes on on another from what was committed (`--after_point` can commit each as it lands).
"""
import datetime
import json
import os
import signal
import subprocess
import sys
import time

import jax

from latent_jax import paths
from latent_jax.ladder.points import ladder_points, read_results, shard
from latent_jax.train import flops
from latent_jax.train.metrics import read_metrics

def results_dir(ladder, workdir):
  return ladder.results or os.path.join(workdir, "results")


def result_path(ladder, workdir, point):
  folder = "tune" if point.stage == "tune" else "points"
  return os.path.join(results_dir(ladder, workdir), folder, point.name + ".json")


def read_result(ladder, workdir, point):
  """The recorded result of a point, or None."""
  path = result_path(ladder, workdir, point)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def finished_metrics(workdir, point):
  """The metrics row of a finished run of the point in its workdir (its last step, with val_loss), or None."""
  rows = read_metrics(os.path.join(workdir, point.name))
  done = [r for r in rows if r["step"] == point.steps and "val_loss" in r]
  return done[-1] if done else None


def record(ladder, workdir, point, row, seconds, status="done"):
  """Write the point's result file: the plan's figures and what the run measured."""
  result = {**point.__dict__, "recipe": os.path.relpath(point.recipe), "overrides": list(point.overrides),
            "status": status, "val_loss": row.get("val_loss"), "val_bpb": row.get("val_bpb"),
            "flops_logged": row.get("flops"), "tokens_logged": row.get("tokens"), "seconds": round(seconds, 1),
            "machine": flops.processor(), "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
  path = result_path(ladder, workdir, point)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  paths.write_atomic(path, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
  return result


def train_point(point, workdir):
  """Run the point's train command; (exit code, the last stderr line). SIGTERM/SIGINT reach the child,
  which saves a checkpoint and exits; the ladder then stops."""
  command = [sys.executable, "-m", "latent_jax.train", "--config", point.recipe,
             *[f"--config.{o}" for o in point.overrides], "--workdir", os.path.join(workdir, point.name)]
  child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
  forward = lambda signum, frame: child.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    last = ""
    for line in child.stderr:  # passed through: train's progress bar and messages
      sys.stderr.write(line)
      if line.strip():
        last = line.strip()
    return child.wait(), last
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def after_point(command, ladder, workdir, point, log):
  """Run --after_point's shell command with LADDER_POINT and LADDER_RESULT set; a failure is reported, not fatal."""
  if not command:
    return
  env = {**os.environ, "LADDER_POINT": point.name, "LADDER_RESULT": result_path(ladder, workdir, point)}
  code = subprocess.run(command, shell=True, env=env).returncode
  if code:
    log(f"--after_point exited with {code} for {point.name}")


def run_point(ladder, workdir, point, prefix, log):
  """Record or train one unrecorded point; False when it stopped before its last step."""
  row = finished_metrics(workdir, point)
  if row:
    record(ladder, workdir, point, row, seconds=0.0)
    log(f"{prefix}: finished in {os.path.join(workdir, point.name)}, recorded (val_loss {row['val_loss']:.4f})")
    return True
  log(f"{prefix}: training {point.steps} steps of {point.batch_size} x {point.tokens // point.steps // point.batch_size} "
      f"tokens ({point.flops:.3g} FLOPs, lr {point.lr:.3g})")
  start = time.perf_counter()
  code, last = train_point(point, workdir)
  seconds = time.perf_counter() - start
  row = finished_metrics(workdir, point)
  if row:
    record(ladder, workdir, point, row, seconds)
    log(f"{prefix}: val_loss {row['val_loss']:.4f} in {seconds / 60:.1f} min -> {result_path(ladder, workdir, point)}")
  elif code == 2 and "non-finite" in last:
    record(ladder, workdir, point, {}, seconds, status="diverged")
    log(f"{prefix}: diverged ({last}); recorded, going on")
  else:
    log(f"{prefix}: stopped before its last step (exit code {code}); run the ladder again to resume it")
    return False
  return True


def run(ladder, workdir, spec="", after="", stages=("tune", "ladder"), log=print):
  """Train every point of this shard (--shard spec) of the given stages not yet recorded, re-planning after
  each; returns the number of this shard's points left unfinished (0: all recorded). A shard does not wait
  for the others: what they have yet to record (the tune that its points wait for, the results that may
  widen its sizes) is said, and running it again once they end picks up what that adds."""
  reported = set()
  while True:
    recorded = read_results(results_dir(ladder, workdir))
    points, notes = ladder_points(ladder, recorded)
    mine = [p for p in shard(points, spec) if p.stage in stages]
    for p in mine:
      if p.name in recorded and p.name not in reported:
        log(f"{p.name}: recorded ({recorded[p.name]['status']}, val_loss {recorded[p.name]['val_loss']})")
    reported.update(recorded)
    left = [p for p in mine if p.name not in recorded]
    if not left:
      break
    point = left[0]
    if not run_point(ladder, workdir, point, f"[{len(mine) - len(left) + 1}/{len(mine)}] {point.name}", log):
      return len(left)
    after_point(after, ladder, workdir, point, log)
  others = [p for p in points if p.name not in recorded and p.stage in stages]
  for n in notes if "ladder" in stages else []:
    log(n)
  if others:
    log(f"this shard's points are recorded; {len(others)} of other shards are not: once they are, run again "
        "(their results may widen sizes or finish the tune that points here wait for)")
  return 0
