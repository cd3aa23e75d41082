"""Figures of a ladder fit: IsoFLOP profiles with their parabolas, and the compute frontiers of every method."""
import math
import os

import numpy as np

from latent_jax.ladder.fit import budget_of, frontier_loss

LOSS_LABEL = "validation loss (nats/token)"


def _isoflop(plt, points, result, path):
  """Loss vs N per budget with the fitted parabola and its minimum, one panel per method (NCP Fig. 10)."""
  methods = list(result["methods"])
  fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), sharey=True, squeeze=False)
  budgets = result["budgets"]
  colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
  for ax, method in zip(axes[0], methods):
    mine = [p for p in points if p["method"] == method and not math.isnan(p["params"])]
    for x in result["methods"][method]["minima"]:
      cell = [p for p in mine if budget_of(p) == x["budget"]]
      if not cell:  # sizes unknown (params_opt is "nan"): nothing to place on the N axis
        continue
      colour = colours[budgets.index(x["budget"])]
      ax.scatter([p["params"] for p in cell], [p["loss"] for p in cell], s=10, alpha=0.5, color=colour)
      if x["kind"] == "parabola":
        n = np.geomspace(min(p["params"] for p in cell), max(p["params"] for p in cell), 100)
        ax.plot(n, x["loss_opt"] + x["curvature"] * np.log(n / x["params_opt"]) ** 2, color=colour,
                label=f"C = {x['budget']:.2g}")
      ax.scatter([x["params_opt"]], [x["loss_opt"]], marker="*", s=120, color=colour, edgecolor="black", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("N, non-embedding parameters")
    ax.set_title(f"{method}: IsoFLOP profiles (star: minimum)")
    if ax.get_legend_handles_labels()[0]:  # a method with no parabola has nothing to label
      ax.legend(fontsize=7)
  axes[0][0].set_ylabel(LOSS_LABEL)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _frontier(plt, result, path):
  """IsoFLOP minima vs C with each method's fitted frontier L(C) = E + A (C/c0)^-alpha (NCP Fig. 4)."""
  fig, ax = plt.subplots(figsize=(6, 4.5))
  budgets = result["budgets"]
  c = np.geomspace(min(budgets) / 2, max(budgets) * 2, 200)
  for method, fit in result["methods"].items():
    minima = fit["minima"]
    dots = ax.scatter([x["flops"] for x in minima], [x["loss_opt"] for x in minima], s=25, label=method, zorder=3)
    if fit["frontier"]:
      f = fit["frontier"]
      ax.plot(c, frontier_loss(f, c), color=dots.get_facecolor()[0],
              label=f"{method}: E={f['E']:.3g}, alpha={f['alpha']:.3g}")
  ax.set_xscale("log")
  ax.set_xlabel("C, training compute (FLOPs)")
  ax.set_ylabel(LOSS_LABEL + " at the IsoFLOP minimum")
  ax.set_title(f"Compute frontiers (reference: {result['reference']})")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_ladder(points, result, out_dir):
  """Write out_dir/isoflop.png and out_dir/frontier.png for points and their `fit_ladder` result; returns the paths."""
  import matplotlib
  matplotlib.use("Agg")  # files only: no display needed on a cluster or in CI
  import matplotlib.pyplot as plt
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "isoflop.png"), os.path.join(out_dir, "frontier.png")]
  _isoflop(plt, points, result, paths[0])
  _frontier(plt, result, paths[1])
  return paths
