"""The ladder's learning-rate tune: from a sweep of lr factors at a few sizes, each method's factor per size.

Plain numpy of rows {method, size, params, factor, loss (None until recorded)}, params being the rule's
key at that size (the reference's N), so it reads recorded results on any machine. Per method and size the
best factor is the vertex of a parabola of the loss in ln(factor) through the best swept factor and its
two neighbours ("parabola"), or the best swept factor itself when it is the smallest or largest ("edge":
the sweep does not bracket it). A method's factor at another size is interpolated linearly in
ln N between its tuned sizes' ln(best factor), and held at the nearest tuned size's beyond them, so beyond
the tuned range the rule's own exponent carries the learning rate (`factor_at`).
"""
import math

import numpy as np


def best_factor(factors, losses):
  """(the best lr factor, "parabola" | "best" | "edge") of one size's sweep: the vertex of the parabola in
  ln(factor) through the best swept factor and its two neighbours (a local fit: a sweep's losses rise
  faster on the high side, which would pull a parabola through all of them off the best point)."""
  x, y = np.log(np.asarray(factors, float)), np.asarray(losses, float)
  order = np.argsort(x)
  x, y = x[order], y[order]
  i = int(np.argmin(y))  # a diverged run's loss is inf: it is never the best, and no parabola goes through it
  if i in (0, x.size - 1):
    return float(np.exp(x[i])), "edge"
  if np.isfinite(y[i - 1:i + 2]).all():
    c2, c1, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
    if c2 > 0:  # the best point is below both neighbours, so the vertex lies between them
      return float(np.exp(-c1 / (2 * c2))), "parabola"
  return float(np.exp(x[i])), "best"


def tune_summary(rows):
  """{method: {"complete", "sizes": {size: {"params", "factor", "kind", "losses": {factor: loss}}}}}."""
  out = {}
  for method in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == method]
    sizes = {}
    for size in dict.fromkeys(r["size"] for r in mine):
      cell = [r for r in mine if r["size"] == size]
      losses = {r["factor"]: r["loss"] for r in cell}
      entry = {"params": cell[0]["params"], "losses": losses, "factor": None, "kind": None}
      if all(v is not None for v in losses.values()):
        entry["factor"], entry["kind"] = best_factor(list(losses), list(losses.values()))
      sizes[size] = entry
    out[method] = {"complete": all(r["loss"] is not None for r in mine), "sizes": sizes}
  return out


def factor_at(summary, params):
  """A complete method's lr factor at N = params: ln(best factor) linear in ln N between its tuned sizes,
  the nearest one's beyond them (3 significant digits)."""
  tuned = sorted((math.log(s["params"]), math.log(s["factor"])) for s in summary["sizes"].values())
  x, y = zip(*tuned)
  return float(f"{math.exp(np.interp(math.log(params), x, y)):.3g}")


def tune_markdown(summary):
  """The tune as a markdown table: per method and size the loss at each factor and the best factor."""
  factors = sorted({f for s in summary.values() for size in s["sizes"].values() for f in size["losses"]})
  out = ["| method | size | N (rule's key) | " + " | ".join(f"x{f:g}" for f in factors) + " | best factor |",
         "|" + "---|" * (len(factors) + 4)]
  for method, s in summary.items():
    for size, entry in s["sizes"].items():
      cells = [f"{entry['losses'][f]:.4f}" if entry["losses"].get(f) is not None else "-" for f in factors]
      best = f"{entry['factor']:.3g} ({entry['kind']})" if entry["factor"] else "-"
      out.append(f"| {method} | {size} | {entry['params']:,} | " + " | ".join(cells) + f" | {best} |")
  return "\n".join(out) + "\n"
