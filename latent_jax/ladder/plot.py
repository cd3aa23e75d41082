"""Figures of a ladder fit: IsoFLOP profiles with their parabolas and minima, and the compute frontier with
each method's minima and its pooled multiplier (the reference frontier at M x C)."""
import math
import os

import numpy as np

from latent_jax.ladder.fit import LABELS, budget_of, frontier_loss

LOSS_LABEL = "validation loss (nats/token)"


def _log_axis(ax):
  """A log x axis labelled at 1, 2 and 5 of each decade ("2e+12"), minor ticks unlabelled: a range of less than
  a decade still gets labels, and they do not overlap."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0e}".replace("e+0", "e").replace("e+", "e")))
  ax.xaxis.set_minor_formatter(NullFormatter())


def _isoflop(plt, points, result, path):
  """Seed-mean loss vs N per budget (bars: seed sd), the parabola through it and the minimum (NCP Fig. 10)."""
  from matplotlib.lines import Line2D
  methods = [m for m in result["minima"] if any(p["method"] == m and not math.isnan(p["params"]) for p in points)]
  budgets = result["budgets"]
  colours = plt.cm.viridis(np.linspace(0, 0.85, len(budgets)))
  fig, axes = plt.subplots(1, len(methods), figsize=(4.6 * len(methods), 4.2), sharey=True, squeeze=False)
  for ax, method in zip(axes[0], methods):
    for x in result["minima"][method]:
      cell = [p for p in points if p["method"] == method and budget_of(p) == x["budget"] and not math.isnan(p["params"])]
      if not cell:
        continue
      colour = colours[budgets.index(x["budget"])]
      sizes = sorted({p["params"] for p in cell})
      losses = [[p["loss"] for p in cell if p["params"] == n] for n in sizes]
      mean = [np.mean(v) for v in losses]
      ax.errorbar(sizes, mean, yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in losses], fmt="o", ms=4,
                  color=colour, capsize=2)
      if x["kind"] == "parabola":
        log_n = np.log(sizes)
        coef = np.polyfit(log_n, mean, 2)
        grid = np.linspace(log_n.min(), log_n.max(), 100)
        ax.plot(np.exp(grid), np.polyval(coef, grid), color=colour)
      ax.scatter([x["params_opt"]], [x["loss"]], marker="*", s=160, zorder=3, color=colour if x["bracketed"] else "white",
                 edgecolor=colour if not x["bracketed"] else "black")
    ax.set_xscale("log")
    _log_axis(ax)
    ax.set_xlabel("N, non-embedding parameters")
    ax.set_title(method)
  handles = [Line2D([], [], color=c, marker="o", label=f"C = {b:.2g}") for b, c in zip(budgets, colours)]
  handles.append(Line2D([], [], ls="", marker="*", ms=12, color="grey", markeredgecolor="black", label="minimum"))
  if any(not x["bracketed"] for m in methods for x in result["minima"][m]):
    handles.append(Line2D([], [], ls="", marker="*", ms=12, color="white", markeredgecolor="grey",
                          label="lowest point at an edge (not bracketed)"))
  axes[0][0].set_ylabel(LOSS_LABEL + "\nmean over seeds (bars: seed sd)")
  fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
  fig.suptitle("IsoFLOP profiles")
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _frontier(plt, result, path):
  """Every method's minima vs C, the reference frontier, and each method's pooled multiplier as the reference
  frontier shifted to L_ref(M C) (NCP Fig. 4), under the first FLOPs convention."""
  from matplotlib.lines import Line2D
  convention, entry = next(iter(result["conventions"].items()))
  fig, ax = plt.subplots(figsize=(7, 5))
  flops = [x["flops"][convention] for rows in result["minima"].values() for x in rows]
  c = np.geomspace(min(flops) / 1.5, max(flops) * 1.5, 200)
  colours = dict(zip(result["minima"], plt.cm.tab10(np.arange(len(result["minima"])) % 10)))
  handles = []
  for method, rows in result["minima"].items():
    colour = colours[method]
    for x in rows:
      ax.scatter([x["flops"][convention]], [x["loss"]], s=40, zorder=3, color=colour if x["bracketed"] else "white",
                 edgecolor=colour)
    label = method
    mult = entry["multipliers"].get(method)
    if entry["frontier"] and method == result["reference"]:
      ax.plot(c, frontier_loss(entry["frontier"], c), color=colour)
      label += ": frontier " + entry["frontier_note"].split(":")[0]
    elif entry["frontier"] and mult and mult["pooled"] is not None and math.isfinite(float(mult["pooled"])):
      ax.plot(c, frontier_loss(entry["frontier"], float(mult["pooled"]) * c), color=colour, ls="--")
      label += f": reference at M x C, M = {float(mult['pooled']):.3g}"
    handles.append(Line2D([], [], color=colour, marker="o", label=label))
  if any(not x["bracketed"] for rows in result["minima"].values() for x in rows):
    handles.append(Line2D([], [], ls="", marker="o", color="white", markeredgecolor="grey",
                          label="minimum at an edge (not bracketed, left out)"))
  ax.set_xscale("log")
  _log_axis(ax)
  ax.set_xlabel(f"C, training FLOPs {LABELS.get(convention, convention)}")
  ax.set_ylabel(LOSS_LABEL + " at the IsoFLOP minimum")
  ax.set_title(f"Compute frontier and pooled multipliers over {result['reference']}")
  ax.legend(handles=handles, fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_ladder(points, result, out_dir):
  """Write out_dir/isoflop.png (when the points give sizes) and out_dir/frontier.png for points and their
  `fit_ladder` result; returns one line per figure: where it went, or why it was not drawn."""
  import matplotlib
  matplotlib.use("Agg")  # files only: no display needed on a cluster or in CI
  import matplotlib.pyplot as plt
  os.makedirs(out_dir, exist_ok=True)
  lines = []
  if any(not math.isnan(p["params"]) for p in points):
    path = os.path.join(out_dir, "isoflop.png")
    _isoflop(plt, points, result, path)
    lines.append(f"wrote {path}")
  else:
    lines.append("isoflop.png not drawn: the points give no sizes (params), so there is no IsoFLOP profile")
  path = os.path.join(out_dir, "frontier.png")
  _frontier(plt, result, path)
  return lines + [f"wrote {path}"]
