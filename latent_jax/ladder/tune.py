"""The ladder's learning-rate tune: from a sweep of lr factors at a few sizes, each method's factor.

Plain numpy of rows {method, size, factor, loss (None until recorded)}, so it reads recorded results on
any machine. Per method and size the best factor is the vertex of a parabola of the loss in ln(factor)
through the swept factors when that vertex is a minimum inside them ("parabola"), else the best swept
factor ("edge" when it is the smallest or largest: the sweep does not bracket it). The method's factor,
which scales the rule's learning rate at every size, is the geometric mean over its sizes.
"""
import math

import numpy as np


def best_factor(factors, losses):
  """(the best lr factor, "parabola" | "best" | "edge") of one size's sweep."""
  x, y = np.log(np.asarray(factors, float)), np.asarray(losses, float)
  order = np.argsort(x)
  x, y = x[order], y[order]
  i = int(np.argmin(y))  # a diverged run's loss is inf: it is never the best, and no parabola goes through it
  if x.size >= 3 and np.isfinite(y).all():
    c2, c1, _ = np.polyfit(x, y, 2)
    if c2 > 0 and x[0] <= -c1 / (2 * c2) <= x[-1] and 0 < i < x.size - 1:
      return float(np.exp(-c1 / (2 * c2))), "parabola"
  return float(np.exp(x[i])), ("edge" if i in (0, x.size - 1) else "best")


def tune_summary(rows):
  """{method: {"factor", "complete", "sizes": {size: {"factor", "kind", "losses": {factor: loss}}}}}."""
  out = {}
  for method in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == method]
    sizes, complete = {}, all(r["loss"] is not None for r in mine)
    for size in dict.fromkeys(r["size"] for r in mine):
      cell = [r for r in mine if r["size"] == size]
      losses = {r["factor"]: r["loss"] for r in cell}
      entry = {"losses": losses, "factor": None, "kind": None}
      if all(v is not None for v in losses.values()):
        entry["factor"], entry["kind"] = best_factor(list(losses), list(losses.values()))
      sizes[size] = entry
    factor = (float(f"{math.exp(np.mean([math.log(s['factor']) for s in sizes.values()])):.3g}") if complete else None)
    out[method] = {"factor": factor, "complete": complete, "sizes": sizes}
  return out


def tune_markdown(summary, ladder_lr_note=""):
  """The tune as a markdown table: per method and size the loss at each factor and the best factor."""
  factors = sorted({f for s in summary.values() for size in s["sizes"].values() for f in size["losses"]})
  out = ["| method | size | " + " | ".join(f"x{f:g}" for f in factors) + " | best factor | method's factor |",
         "|" + "---|" * (len(factors) + 4)]
  for method, s in summary.items():
    for size, entry in s["sizes"].items():
      cells = [f"{entry['losses'][f]:.4f}" if entry["losses"].get(f) is not None else "-" for f in factors]
      best = f"{entry['factor']:.3g} ({entry['kind']})" if entry["factor"] else "-"
      out.append(f"| {method} | {size} | " + " | ".join(cells) + f" | {best} | {s['factor'] or '-'} |")
  return "\n".join(out + ([""] + [ladder_lr_note] if ladder_lr_note else [])) + "\n"
