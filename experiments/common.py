"""Shared by the experiment scripts: run a config for several seeds, tabulate, plot.

Each run trains in its own workdir under ROOT/NAME/seedS (so an interrupted experiment
resumes where it stopped), then its metrics.jsonl is read back.
"""
import json
import os
import statistics

from latent_jax import load_config
from latent_jax.train.loop import train
from latent_jax.train.metrics import read_metrics

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def run_seeds(name, config, overrides, seeds, root):
  """Train `config` with `overrides` once per seed; returns {seed: metrics rows}."""
  out = {}
  for seed in seeds:
    workdir = os.path.join(root, name, f"seed{seed}")
    cfg = load_config(os.path.join(CONFIGS, config), [*overrides, f"train.seed={seed}"])
    train(cfg, workdir)
    out[seed] = read_metrics(workdir)
  return out


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


def write_results(stem, table, runs, header, key="val_loss"):
  """Markdown table + JSON + a plot of `key` against tokens, in experiments/results/."""
  os.makedirs(RESULTS, exist_ok=True)
  lines = [header, "", f"| run | final {key} per seed | mean | std |", "|---|---|---|---|"]
  for name, (values, mean, spread) in table.items():
    lines.append(f"| {name} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {spread:.4f} |")
  with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
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
      pts = [(r["tokens"], r[key]) for r in rows if key in r]
      ax.plot(*zip(*pts), color=f"C{i}", alpha=0.8, label=name if j == 0 else None)
  ax.set_xlabel("training tokens")
  ax.set_ylabel(key)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(RESULTS, f"{stem}.png"), dpi=120)
