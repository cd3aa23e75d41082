"""Shared by the experiment scripts: run a config for several seeds, tabulate, plot.

Each run trains in its own workdir under ROOT/NAME/seedS (so an interrupted experiment
resumes where it stopped), then its metrics.jsonl is read back. A finished run (its last
step's metrics row and checkpoint are there) is only read, never opened by the train loop, so
experiments that share a run (the tiny baseline, say) train it once and re-running a script
on finished runs writes nothing into them; a lock on the workdir lets two experiment scripts
run side by side.
"""
import argparse
import datetime
import fcntl
import json
import os
import statistics
import sys

import jax

from latent_jax import distributed, load_config
from latent_jax.train import flops
from latent_jax.train.loop import train
from latent_jax.train.metrics import read_metrics

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# The budget of every method comparison: half of configs/tiny.py's 600 steps (about half an
# epoch of KJV), so that the three comparisons fit a few hours of a 2-core machine; evaluated
# every 25 steps, so that curves can be compared between evaluations.
COMPARISON = ["train.steps=300", "optim.warmup_steps=25", "train.eval_every=25"]


def budget(smoke_steps=0):
  """The comparison budget, or with `smoke_steps` a few-step run that only checks the script works."""
  smoke = [f"train.steps={smoke_steps}", "optim.warmup_steps=1", "train.eval_every=2"] if smoke_steps else []
  return [*COMPARISON, *smoke]


distributed.quiet_absent_tpu()  # an installed libtpu (the tpu extra) stays quiet here, as in the commands


class Arguments(argparse.ArgumentParser):
  """The scripts' flags; a smoke run (--steps N) trains and writes under ROOT/smokeN, never beside real runs
  (which would resume from its few steps) nor in experiments/results."""

  def parse_args(self, *a, **k):
    args = super().parse_args(*a, **k)
    if getattr(args, "steps", 0):
      args.root = os.path.join(args.root, f"smoke{args.steps}")
    return args


def arguments(doc, seeds="0,1", smoke=True):
  """The experiment scripts' shared flags: --root, --seeds (and --steps for a smoke run)."""
  p = Arguments(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", default="runs/experiments")
  p.add_argument("--seeds", default=seeds, type=lambda text: [int(s) for s in text.split(",")])
  if smoke:
    p.add_argument("--steps", type=int, default=0, help="a smoke run of this many steps, which only checks that "
                   "the script works: trained and written under ROOT/smokeN")
  return p


def results_dir(args):
  """Where a script writes its table, JSON and plot: experiments/results, or for a smoke run (--steps N,
  which proves the script works and measures nothing) ROOT/smokeN/results, so that it never
  overwrites a result."""
  return os.path.join(args.root, "results") if getattr(args, "steps", 0) else RESULTS


def run_seeds(name, config, overrides, seeds, root):
  """Train `config` with `overrides` once per seed; returns {seed: metrics rows}."""
  out = {}
  for seed in seeds:
    workdir = os.path.join(root, name, f"seed{seed}")
    cfg = load_config(os.path.join(CONFIGS, config), [*overrides, f"train.seed={seed}"])
    if finished(workdir, cfg.train.steps):
      out[seed] = read_metrics(workdir)
      continue
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, ".lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # another script may be training this very run
      train(cfg, workdir)
    out[seed] = read_metrics(workdir)
  return out


def finished(workdir, steps):
  """Whether the run in `workdir` reached step `steps`: its metrics row and checkpoint are there."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints", str(steps))):
    return False
  rows = read_metrics(workdir) if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else []
  return bool(rows) and rows[-1]["step"] == steps


def wall_seconds(rows):
  """Training wall time at each logged row (evaluation excluded, compilation included)."""
  total, tokens, out = 0.0, 0, []
  for r in rows:
    total += (r["tokens"] - tokens) / r["tokens_per_s"]
    tokens = r["tokens"]
    out.append(total)
  return out


def cost_to_reach(rows, target, key="val_loss"):
  """(FLOPs, wall seconds) at which `key` first falls to `target`, interpolated between evals; None if never."""
  walls = wall_seconds(rows)
  points = [(r["flops"], w, r[key]) for r, w in zip(rows, walls) if key in r]
  previous = (0.0, 0.0, float("inf"))
  for flops, wall, value in points:
    if value <= target:
      f0, w0, v0 = previous
      a = 1.0 if v0 == float("inf") else (v0 - target) / (v0 - value)
      return f0 + a * (flops - f0), w0 + a * (wall - w0)
    previous = (flops, wall, value)
  return None


def final(rows, key="val_loss"):
  return [r for r in rows if key in r][-1][key]


def summarise(runs, key="val_loss"):
  """{name: {seed: rows}} -> {name: (values, mean, spread)} of the final `key`."""
  table = {}
  for name, by_seed in runs.items():
    values = [final(rows, key) for rows in by_seed.values()]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    table[name] = (values, statistics.mean(values), spread)
  return table


def provenance(root):
  """How a table was made: the command, the day, the machine and software, where the runs are."""
  return (f"Generated by `python {' '.join(sys.argv)}` on {datetime.date.today()}, {flops.processor()}, "
          f"jax {jax.__version__} ({jax.default_backend()}), from the runs under `{root}`.")


def write_results(stem, table, runs, header, root, key="val_loss", x="tokens", columns=None, footer="", plot_key=None,
                  out=RESULTS):
  """Markdown table + JSON + a plot of `plot_key` (default `key`) against `x` (tokens or flops), in `out`
  (results_dir(args): experiments/results/, or a smoke run's folder).

  `columns` {title: {run name: text}} adds columns to the table; `footer` is markdown after it,
  then the provenance line and, if there is one, the hand-written results/STEM_notes.md (what
  was seen, in words), which re-running the script therefore keeps.
  """
  os.makedirs(out, exist_ok=True)
  columns = columns or {}
  lines = [header, "", f"| run | final {key} per seed | mean | std |{''.join(f' {c} |' for c in columns)}",
           "|---|---|---|---|" + "---|" * len(columns)]
  for name, (values, mean, spread) in table.items():
    extra = "".join(f" {col.get(name, '')} |" for col in columns.values())
    lines.append(f"| {name} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {spread:.4f} |{extra}")
  if footer:
    lines += ["", footer]
  lines += ["", provenance(root)]
  notes = os.path.join(RESULTS, f"{stem}_notes.md")
  if os.path.exists(notes):
    with open(notes) as f:
      lines += ["", f"Notes (hand-written, `experiments/results/{stem}_notes.md`):", "", f.read().strip()]
  with open(os.path.join(out, f"{stem}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(out, f"{stem}.json"), "w") as f:
    json.dump({name: {str(s): rows for s, rows in by_seed.items()} for name, by_seed in runs.items()}, f)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed (pip install -e '.[experiments]'): no plot")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, (name, by_seed) in enumerate(runs.items()):
    for j, rows in enumerate(by_seed.values()):
      pts = [(r[x], r[plot_key or key]) for r in rows if (plot_key or key) in r]
      ax.plot(*zip(*pts), color=f"C{i % 10}", linestyle="-" if i < 10 else "--", alpha=0.8,
              label=name if j == 0 else None)
  ax.set_xlabel({"tokens": "training tokens", "flops": "training FLOPs"}[x])
  ax.set_ylabel(plot_key or key)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"{stem}.png"), dpi=120)
