"""Muon, QK-norm and loss spikes at tiny scale: the NCP paper's stability analysis (Sec. 4.6, Fig. 5-6).

  python experiments/stability.py [--root runs/experiments] [--seeds 0,1] [--muon_lr 0.05] [--only NAME,...] [--steps N]

The paper traces loss spikes under Muon to single heads whose query/key norms and attention
logits grow, and per-head QK-norm keeps them low. Here: Muon at a learning rate high enough to
spike on configs/tiny.py (MUON_LR), with layer-wise QK-norm (the recipe's) against per-head, and
AdamW at the recipe's settings as the control; train.monitors on and logged every step, so the
largest attention logit and q/k norms across layers give Fig. 6's curves at tiny size.
The learning-rate search's layer-wise Muon runs (SEARCH_LRS, seed 0) join the table.
Writes experiments/results/stability.{md,json,png}: per run the final and peak largest logit, the
peak q and k norms, the final validation loss and the loss spikes (`spikes`); the JSON keeps every
5th step's row (and every evaluation's). `--steps N` shortens
every run to prove the script works (a smoke test, written under ROOT/smokeN, never to results/);
`--only` trains just the named runs (the learning-rate search) and writes no results.
"""
import os
import statistics

from common import arguments, run_seeds, summarise, results_dir, write_results

MUON_LR = 0.3  # no run at 0.05 or 0.1 spiked; the search is in stability_notes.md
SEARCH_LRS = (0.05, 0.1)


def runs_for(lr):
  """(name, config, overrides) of each run; a Muon run's name carries its learning rate (its own workdir)."""
  muon = ["optim.name=muon", f"optim.lr={lr}"]
  return [("adamw_layer", "tiny.py", []),
          (f"muon_layer_lr{lr:g}", "tiny.py", muon),
          (f"muon_head_lr{lr:g}", "tiny.py", [*muon, "model.qk_norm=head"])]


# 300 steps as the method comparisons (experiments/common.py), every step logged with the monitors.
BUDGET = ["train.steps=300", "optim.warmup_steps=25", "train.log_every=1", "train.monitors=True",
          "train.eval_every=50", "train.eval_batches=8", "train.checkpoint_every=300"]
# A spike: loss > (1 + RISE) x the median of the previous WINDOW steps' losses (of all previous ones, at least
# MIN_HISTORY, in the first WINDOW steps).
SPIKE_WINDOW, SPIKE_RISE, MIN_HISTORY = 20, 0.2, 5
CURVES = {"attn_logit_max": "largest attention logit", "q_norm_max": "largest query norm (a head's)",
          "k_norm_max": "largest key norm (a head's)"}


def across_layers(row, name):
  """(largest value of metric `name` over the layers of a metrics row, the layer it came from)."""
  values = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith(name + "/")}
  layer = max(values, key=values.get)
  return values[layer], layer


def slim(rows):
  """The rows the results use: loss, gradient norm, validation loss and the maxima over layers (4 digits)."""
  out = []
  for r in rows:
    row = {k: r[k] for k in ("step", "tokens", "loss", "grad_norm", "val_loss") if k in r}
    for name in CURVES:
      row[name], where = across_layers(r, name)
      if name == "attn_logit_max":
        row["attn_logit_where"] = f"{where} head {int(r['attn_logit_head/' + where])}"
    out.append({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()})
  return out


def every_5th(runs):
  """The runs with every 5th step's row and every evaluation's: what the JSON keeps."""
  keep = lambda rows: [r for r in rows if r["step"] % 5 == 0 or "val_loss" in r]
  return {name: {seed: keep(rows) for seed, rows in by_seed.items()} for name, by_seed in runs.items()}


def rises(rows):
  """[(step, its loss over the median of the previous SPIKE_WINDOW steps' losses - 1)] from the MIN_HISTORY + 1-th on."""
  losses = [r["loss"] for r in rows]
  return [(rows[i]["step"], losses[i] / statistics.median(losses[max(0, i - SPIKE_WINDOW):i]) - 1)
          for i in range(MIN_HISTORY, len(rows))]


def spikes(rows):
  """The steps whose loss exceeds the median of the previous SPIKE_WINDOW steps' by more than SPIKE_RISE."""
  return [step for step, rise in rises(rows) if rise > SPIKE_RISE]


def per_seed(runs, f, fmt="{:.2f}"):
  """{run name: "a, b"}: f(rows) of each seed."""
  return {name: ", ".join(fmt.format(f(rows)) for rows in by_seed.values()) for name, by_seed in runs.items()}


def plot(runs, path):
  """Fig. 6 at tiny size: loss, largest attention logit, largest q and k norms against the step, every run and seed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
  for ax, (key, title) in zip(axes, [("loss", "training loss (nats/token)"), *CURVES.items()]):
    ax.set_yscale("log")
    for i, (name, by_seed) in enumerate(runs.items()):
      for j, rows in enumerate(by_seed.values()):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], color=f"C{i}", alpha=0.8, lw=0.8,
                linestyle="-" if j == 0 else ":", label=name if j == 0 else None)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  p = arguments(__doc__)
  p.add_argument("--muon_lr", type=float, default=MUON_LR)
  p.add_argument("--only", default="", help="a comma list of run names: train these only, write nothing")
  args = p.parse_args()
  smoke = [f"train.steps={args.steps}", "optim.warmup_steps=1", "train.eval_every=2",
           f"train.checkpoint_every={args.steps}"] if args.steps else []
  chosen = runs_for(args.muon_lr)
  if args.only:
    chosen = [run for run in chosen if run[0] in args.only.split(",")]
  runs = {name: run_seeds(f"stability_{name}", config, [*BUDGET, *extra, *smoke], args.seeds, args.root)
          for name, config, extra in chosen}
  if args.only:
    return
  plotted = list(runs)
  for lr in SEARCH_LRS:  # layer-wise Muon, seed 0 only
    name, config, extra = runs_for(lr)[1]
    runs[name] = run_seeds(f"stability_{name}", config, [*BUDGET, *extra, *smoke], [0], args.root)
    chosen.append((name, config, extra))
  runs = {name: {seed: slim(rows) for seed, rows in by_seed.items()} for name, by_seed in runs.items()}
  table = summarise(runs)
  peak = lambda key: lambda rows: max(r[key] for r in rows)
  columns = {"final largest logit": per_seed(runs, lambda rows: rows[-1]["attn_logit_max"]),
             "peak largest logit": per_seed(runs, peak("attn_logit_max")),
             "peak q norm": per_seed(runs, peak("q_norm_max")),
             "peak k norm": per_seed(runs, peak("k_norm_max")),
             "peak grad norm": per_seed(runs, peak("grad_norm")),
             "largest loss rise": per_seed(runs, lambda rows: max((r for _, r in rises(rows)), default=0.0), "{:.1%}"),
             "loss spikes": per_seed(runs, lambda rows: len(spikes(rows)), "{}")}
  spike_steps = "\n".join(f"- {name} seed {seed}: {spikes(rows) or 'none'}"
                          for name, by_seed in runs.items() for seed, rows in by_seed.items())
  described = ", ".join(f"{n} = configs/{c} {' '.join(e)}".strip() for n, c, e in chosen)
  write_results("stability", table, every_5th(runs),
                "# Muon, QK-norm and loss spikes on the tiny recipe (NCP Sec. 4.6, Fig. 5-6)\n\n"
                f"Runs: {described}; overrides {BUDGET + smoke}, seeds {args.seeds}. Each value per seed. "
                f"Largest logit: the largest q.k/sqrt(D) over the layers, heads and visible pairs of the "
                f"probe's rows; q/k norm: the largest L2 norm of one head's query (key) vector (train.monitors). "
                f"A loss spike: a step whose loss exceeds the median of the previous {SPIKE_WINDOW} steps' by "
                f"more than {SPIKE_RISE:.0%} (in the first {SPIKE_WINDOW} steps: of all previous ones, from "
                f"the {MIN_HISTORY + 1}th step on). Largest loss rise: the largest such excess.", args.root,
                columns=columns, footer=f"Loss spikes, by step:\n\n{spike_steps}", out=results_dir(args))
  plot({name: runs[name] for name in plotted}, os.path.join(results_dir(args), "stability.png"))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: val_loss {values} mean {mean:.4f}; spikes {columns['loss spikes'][name]}; "
          f"peak logit {columns['peak largest logit'][name]}")


if __name__ == "__main__":
  main()
