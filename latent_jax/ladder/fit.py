"""Scaling-ladder fits: IsoFLOP minima, compute frontiers, the parametric law, and compute multipliers.

Plain numpy/scipy functions of points, so `python -m latent_jax.ladder fit --points FILE.csv` runs without
jax or any training code. A point is a dict: method, flops (training compute C), params (non-embedding N,
NaN when unknown), tokens (D, NaN when unknown), loss (validation nats/token), seed (default 0) and optionally
budget (the planned budget it belongs to; without it, flops rounded to 2 significant digits).

Following Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models"): approach 2 fits a parabola
in log N to each IsoFLOP profile and a frontier L(C) = E + A (C/c0)^-alpha through the minima; approach 3 fits
L(N, D) = E + A/N^a + B/D^b to every point. A method's compute multiplier at budget C is
M = C_ref(L_m(C)) / C: the reference needs M times the compute to reach the loss the method reaches at C.
"""
import contextlib
import csv
import functools
import json
import math
import os

import numpy as np
from scipy.optimize import minimize

try:
  from threadpoolctl import ThreadpoolController
except ImportError:  # optional: the fits are the same without it, only slower on a busy machine
  ThreadpoolController = None

COLUMNS = ("method", "flops", "params", "tokens", "loss")
OPTIONAL = ("seed", "budget")
HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, approach 3
CONVENTION = ("M = C_ref(L_m(C_b)) / C_b: the reference reaches, at M * C_b, the loss the method reaches at C_b "
              "(M > 1: the method is better); delta_loss = L_m(C_b) - L_ref(C_b), both on the fitted frontiers; "
              "C in FLOPs, N non-embedding parameters, loss in nats/token; 95% intervals: paired bootstrap.")


@functools.cache
def _blas():
  """The process's BLAS thread pools (threadpoolctl), found once."""
  return ThreadpoolController() if ThreadpoolController else None


def _one_blas_thread():
  """scipy >= 1.15's L-BFGS-B calls BLAS on tiny matrices, where OpenBLAS threads cost ~10x on a busy machine."""
  return _blas().limit(limits=1, user_api="blas") if _blas() else contextlib.nullcontext()


# ----------------------------------------------------------------------------- reading points

def _number(text, path, line, column, hint):
  """One positive numeric CSV field, or a one-line ValueError naming the file, line, column and the fix."""
  try:
    value = float(text)
  except ValueError:
    raise ValueError(f"{path}, line {line}, column '{column}': {text!r} is not a number; {hint}") from None
  if not 0 < value < math.inf:
    raise ValueError(f"{path}, line {line}, column '{column}': {text!r} must be a finite number > 0; {hint}")
  return value


def read_points(path):
  """Points from a CSV with columns method,flops,params,tokens,loss (optional seed, budget; '#' lines skipped)."""
  hints = {
      "flops": "write the training compute in FLOPs, e.g. 1.2e18",
      "params": "write the non-embedding parameter count, or leave it empty when unknown",
      "tokens": "write the number of training tokens, or leave it empty when unknown",
      "loss": "write the validation loss in nats/token (> 0)",
      "budget": "write the planned budget in FLOPs, or leave it empty to group by flops",
  }
  header, points = None, []
  with open(path, newline="") as f:
    for line, text in enumerate(f, start=1):
      if not text.strip() or text.lstrip().startswith("#"):
        continue
      fields = [x.strip() for x in next(csv.reader([text]))]
      if header is None:
        header = fields
        for column in COLUMNS:
          if column not in header:
            raise ValueError(f"{path}, line {line}: the header has no column '{column}'; it must name "
                             f"{','.join(COLUMNS)} (optional {','.join(OPTIONAL)})")
        continue
      if len(fields) < len(header):
        raise ValueError(f"{path}, line {line}: {len(fields)} fields but the header has {len(header)}; "
                         "write one value per column (empty for unknown params/tokens)")
      row = dict(zip(header, fields))
      if not row["method"]:
        raise ValueError(f"{path}, line {line}, column 'method': empty; name the method, e.g. baseline")
      point = {"method": row["method"]}
      for column in ("flops", "loss"):
        point[column] = _number(row[column], path, line, column, hints[column])
      for column in ("params", "tokens"):
        point[column] = _number(row[column], path, line, column, hints[column]) if row[column] else math.nan
      seed = row.get("seed") or "0"
      try:
        point["seed"] = int(seed)
      except ValueError:
        raise ValueError(f"{path}, line {line}, column 'seed': {seed!r} is not an integer; "
                         "write the run's seed, e.g. 0") from None
      if row.get("budget"):
        point["budget"] = _number(row["budget"], path, line, "budget", hints["budget"])
      points.append(point)
  if not points:
    raise ValueError(f"{path}: no points; write a header line {','.join(COLUMNS)} and one line per run")
  return points


# ----------------------------------------------------------------------------- IsoFLOP minima (approach 2)

def budget_of(point):
  """The budget a point belongs to: its planned budget, else its flops rounded to 2 significant digits."""
  budget = point.get("budget")
  if budget is None or math.isnan(budget):
    return float(f"{point['flops']:.2g}")
  return float(budget)


def _group(points):
  """One budget's points, ordered by size (known N ascending, then each point of unknown N alone) and seed.

  The order makes bootstrap draws pair the same (size, seed) across methods trained on the same grid.
  """
  known = sorted({p["params"] for p in points if not math.isnan(p["params"])})
  cell = {n: i for i, n in enumerate(known)}
  size, unknown = [], 0
  for p in points:
    size.append(cell.get(p["params"], len(known) + unknown))
    unknown += math.isnan(p["params"])
  order = sorted(range(len(points)), key=lambda i: (size[i], points[i].get("seed", 0)))
  return {
      "budget": budget_of(points[0]),
      "flops": float(np.exp(np.mean(np.log([p["flops"] for p in points])))),
      "log_n": np.log(known + [math.nan] * unknown),
      "size": np.array([size[i] for i in order]),
      "loss": np.array([points[i]["loss"] for i in order]),
  }


def _minimum(log_n, mean_loss):
  """Vertex of loss = c2 (ln N)^2 + c1 ln N + c0 over the known sizes (Hoffmann et al. 2022, approach 2)."""
  known = ~np.isnan(log_n)
  if np.unique(log_n[known]).size >= 3:
    centre = log_n[known].mean()  # centring keeps polyfit well conditioned at ln N ~ 20
    c2, c1, c0 = np.polyfit(log_n[known] - centre, mean_loss[known], 2)
    vertex = -c1 / (2 * c2) if c2 > 0 else math.nan
    # A parabola opening downward, or with its vertex beyond the sampled sizes, extrapolates: use the best point.
    if log_n[known].min() - centre <= vertex <= log_n[known].max() - centre:
      return {"params_opt": math.exp(vertex + centre), "loss_opt": c0 - c1 ** 2 / (4 * c2), "kind": "parabola",
              "curvature": c2}
  best = int(np.argmin(mean_loss))
  return {"params_opt": math.exp(log_n[best]), "loss_opt": float(mean_loss[best]), "kind": "best_point",
          "curvature": None}


def _group_minimum(group, pick=None):
  """IsoFLOP minimum of a `_group` (or of the points `pick` drawn from it), with seeds averaged per size first."""
  size, loss = (group["size"], group["loss"]) if pick is None else (group["size"][pick], group["loss"][pick])
  count = np.bincount(size, minlength=len(group["log_n"]))
  drawn = count > 0
  mean_loss = np.bincount(size, weights=loss, minlength=len(count))[drawn] / count[drawn]
  return {"budget": group["budget"], "flops": group["flops"], **_minimum(group["log_n"][drawn], mean_loss),
          "n_sizes": int(drawn.sum()), "n_points": len(size)}


def isoflop_minimum(points):
  """Minimum of one method's IsoFLOP profile at one budget (Hoffmann et al. 2022, approach 2).

  Losses are averaged over seeds per N; with >= 3 distinct N, the vertex of a parabola in ln N ("parabola",
  loss = loss_opt + curvature (ln N - ln params_opt)^2), else, or when that vertex is not a minimum inside the
  sampled N, the size with the lowest mean loss ("best_point"). flops is the geometric mean of the points' flops.
  """
  if not points:
    raise ValueError("isoflop_minimum needs at least one point")
  return _group_minimum(_group(points))


# ----------------------------------------------------------------------------- the compute frontier

def frontier_loss(params, flops):
  """L(C) = E + A (C / c0)^-alpha: the loss along the compute-optimal frontier (Hoffmann et al. 2022, approach 2)."""
  return params["E"] + params["A"] * (np.asarray(flops, dtype=float) / params["c0"]) ** -params["alpha"]


def frontier_compute(params, loss):
  """Inverse of frontier_loss: C = c0 (A / (L - E))^(1/alpha), inf where L <= E (the frontier never gets there)."""
  gap = np.asarray(loss, dtype=float) - params["E"]
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    flops = params["c0"] * (params["A"] / gap) ** (1 / params["alpha"])
  return np.where(gap > 0, flops, np.inf)[()]


def _frontier_objective(theta, log_c, log_l):
  """Sum of squared residuals of log L and its gradient in theta = (E, ln A, alpha); theta may be a batch [..., 3]."""
  e, log_a, alpha = (x[..., None] for x in np.moveaxis(theta, -1, 0))
  term = np.exp(log_a - alpha * log_c)
  model = e + term
  r = np.log(model) - log_l
  g = 2 * r / model
  grad = np.stack([g.sum(-1), (g * term).sum(-1), -(g * term * log_c).sum(-1)], -1)
  return (r ** 2).sum(-1), grad


def fit_frontier(flops, losses, c0=None, start=None):
  """Fit L(C) = E + A (C/c0)^-alpha to IsoFLOP minima by least squares on log L (Hoffmann et al. 2022, approach 2).

  Returns {"E", "A", "alpha", "c0", "fixed"}: A is for C normalised by c0 (the geometric mean of `flops` unless
  given), which keeps A and the fit well conditioned. Three or more budgets: L-BFGS-B with E in [0, min loss),
  alpha in (0, 2], started from the best few of a grid over (E, alpha), or from `start` (a frontier, e.g. the full
  fit for a bootstrap replicate) alone. Two budgets cannot pin three parameters: E is fixed at 0 (a local power
  law through both minima; "fixed": ["E"]). One budget raises ValueError.
  """
  flops, losses = np.asarray(flops, dtype=float), np.asarray(losses, dtype=float)
  n_budgets = np.unique(flops).size
  if n_budgets < 2:
    raise ValueError(f"a compute frontier needs IsoFLOP minima at two or more budgets, got {n_budgets}; "
                     "add budgets to the ladder")
  c0 = float(np.exp(np.mean(np.log(flops)))) if c0 is None else float(c0)
  log_c, log_l = np.log(flops / c0), np.log(losses)
  if n_budgets == 2:
    slope, intercept = np.polyfit(log_c, log_l, 1)
    if slope >= 0:
      raise ValueError("the loss does not fall with compute between the two budgets; check the points or add budgets")
    return {"E": 0.0, "A": float(np.exp(intercept)), "alpha": float(-slope), "c0": c0, "fixed": ["E"]}
  e_max = losses.min() * (1 - 1e-9)
  if start is None:
    e, alpha = (x.ravel() for x in np.meshgrid(e_max * np.array([0, .3, .5, .7, .8, .9, .95, .99]),
                                               np.array([.02, .05, .1, .2, .35, .5, .8, 1.2])))
    # For a given (E, alpha), ln A is the mean offset of ln(L - E) + alpha ln C: a start already on the data.
    log_a = np.mean(np.log(losses - e[:, None]) + alpha[:, None] * log_c, axis=1)
    starts = np.stack([e, log_a, alpha], -1)
    starts = starts[np.argsort(_frontier_objective(starts, log_c, log_l)[0])[:3]]
  else:
    starts = [[min(start["E"], e_max), math.log(start["A"] * (c0 / start["c0"]) ** start["alpha"]), start["alpha"]]]
  # The objective is ~1e-6 for a good fit: tolerances far below scipy's defaults, which are relative to 1.
  with _one_blas_thread():
    fits = [minimize(_frontier_objective, x0, args=(log_c, log_l), jac=True, method="L-BFGS-B",
                     bounds=[(0, e_max), (None, None), (1e-4, 2)], options={"ftol": 1e-15, "gtol": 1e-12})
            for x0 in starts]
  best = min(fits, key=lambda f: f.fun)
  return {"E": float(best.x[0]), "A": float(np.exp(best.x[1])), "alpha": float(best.x[2]), "c0": c0, "fixed": []}


# ----------------------------------------------------------------------------- the parametric law (approach 3)

def _parametric_objective(theta, u, v, log_l):
  """Huber loss (/delta) of ln L residuals for ln L = LSE(e, ln A' - a u, ln B' - b v), and its gradient.

  theta = (e, ln A', a, ln B', b), may be a batch [..., 5]; u, v are ln N, ln D centred on their means.
  """
  e, log_a, a, log_b, b = (x[..., None] for x in np.moveaxis(theta, -1, 0))
  terms = np.stack(np.broadcast_arrays(e, log_a - a * u, log_b - b * v))
  top = terms.max(0)
  weights = np.exp(terms - top)
  total = weights.sum(0)
  r = top + np.log(total) - log_l
  huber = np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r ** 2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
  psi = np.clip(r, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA / total
  grad = np.stack([(psi * weights[0]).sum(-1), (psi * weights[1]).sum(-1), -(psi * weights[1] * u).sum(-1),
                   (psi * weights[2]).sum(-1), -(psi * weights[2] * v).sum(-1)], -1)
  return huber.sum(-1) / HUBER_DELTA, grad


def fit_parametric(params, tokens, losses):
  """Fit L(N, D) = E + A/N^a + B/D^b with a Huber loss on ln L (Hoffmann et al. 2022, approach 3, delta 1e-3).

  Uses the points with known N and D. Returns None unless there are >= 5 of them with >= 3 distinct N, >= 3
  distinct D, and ln N, ln D not collinear (one IsoFLOP profile alone, D = C/6N, cannot separate a from b).
  Otherwise {"E", "A", "a", "B", "b", "huber" (the summed Huber loss), "n_points"}: L-BFGS-B from the 5 best
  of a grid of 4^5 starts, in ln N and ln D centred on their means so that ln A and a are not entangled.
  """
  params, tokens, losses = (np.asarray(x, dtype=float) for x in (params, tokens, losses))
  known = ~(np.isnan(params) | np.isnan(tokens))
  n, d, loss = params[known], tokens[known], losses[known]
  if n.size < 5 or np.unique(n).size < 3 or np.unique(d).size < 3:
    return None
  u, v = np.log(n) - np.log(n).mean(), np.log(d) - np.log(d).mean()
  if np.linalg.matrix_rank(np.stack([u, v], 1), tol=1e-6 * max(np.abs(u).max(), np.abs(v).max())) < 2:
    return None
  log_l, floor = np.log(loss), loss.min()
  grid = np.meshgrid(np.log(floor * np.array([.3, .6, .8, .95])), np.log(floor * np.array([.03, .1, .3, 1])),
                     np.array([.15, .3, .5, .8]), np.log(floor * np.array([.03, .1, .3, 1])),
                     np.array([.15, .3, .5, .8]))
  starts = np.stack([x.ravel() for x in grid], -1)
  value, _ = _parametric_objective(starts, u, v, log_l)
  with _one_blas_thread():
    fits = [minimize(_parametric_objective, x0, args=(u, v, log_l), jac=True, method="L-BFGS-B",
                     bounds=[(None, None), (None, None), (1e-3, 3), (None, None), (1e-3, 3)],
                     options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 2000})
            for x0 in starts[np.argsort(value)[:5]]]
  e, log_a, a, log_b, b = min(fits, key=lambda f: f.fun).x
  return {"E": math.exp(e), "A": math.exp(log_a + a * np.log(n).mean()), "a": float(a),
          "B": math.exp(log_b + b * np.log(d).mean()), "b": float(b),
          "huber": float(min(f.fun for f in fits) * HUBER_DELTA), "n_points": int(n.size)}


# ----------------------------------------------------------------------------- the ladder

def _resampled_frontier(groups, u, budgets, full):
  """The frontier of one bootstrap replicate (each budget's points drawn by u[budget, slot]), started from `full`."""
  minima = []
  for g in groups:
    n = len(g["loss"])
    minima.append(_group_minimum(g, (u[budgets.index(g["budget"]), :n] * n).astype(int))["loss_opt"])
  front = fit_frontier([g["flops"] for g in groups], minima, c0=full["c0"], start=full)
  if not all(math.isfinite(front[k]) for k in ("E", "A", "alpha")):
    raise ValueError("the frontier of a bootstrap replicate is not finite")
  return front


def _interval(values):
  """2.5 and 97.5 percentiles (order statistics, so replicates with M = inf stay inf)."""
  if not len(values):
    return [math.nan, math.nan]
  return [float(x) for x in np.percentile(values, [2.5, 97.5], method="inverted_cdf")]


def _compare(front, ref, budget):
  """The multiplier C_ref(L_m(C)) / C and the loss difference L_m(C) - L_ref(C) at budget C."""
  loss = float(frontier_loss(front, budget))
  return float(frontier_compute(ref, loss)) / budget, loss - float(frontier_loss(ref, budget))


def _plain(x):
  """JSON-safe copy: Python floats and ints, non-finite floats as the strings "inf", "-inf", "nan"."""
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_plain(v) for v in x]
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else str(float(x))
  return x if x is None or isinstance(x, str) else str(x)


def fit_ladder(points, reference="baseline", n_boot=100, seed=0, notes=None):
  """Per method: IsoFLOP minima, frontier, parametric law; per budget: the compute multiplier over `reference`.

  Intervals come from a paired bootstrap: each replicate resamples the points (sizes and seeds) of every budget
  with replacement and refits every minimum and frontier (with the full fit's c0). The draws are made once per
  budget as uniform numbers and mapped to each method's points in (size, seed) order, so methods trained on
  the same sizes and seeds resample the same runs and their shared noise cancels in M. Replicates where a fit
  fails are dropped and counted in "boot_failed". The parametric fit is not bootstrapped. `notes` (a dict, e.g.
  the FLOPs convention) is kept as "notes"; its "convention" entry, else CONVENTION, becomes "convention".
  The result is JSON-safe (see `_plain`).
  """
  methods = sorted({p["method"] for p in points}, key=lambda m: (m != reference, m))
  if reference not in methods:
    raise ValueError(f"the reference method {reference!r} has no points (methods: {', '.join(methods)}); "
                     "name the reference with one of them")
  groups = {}
  for m in methods:
    by_budget = {}
    for p in points:
      if p["method"] == m:
        by_budget.setdefault(budget_of(p), []).append(p)
    groups[m] = [_group(by_budget[b]) for b in sorted(by_budget)]
  budgets = sorted({g["budget"] for m in methods for g in groups[m]})

  fits = {}
  for m in methods:
    minima = [_group_minimum(g) for g in groups[m]]
    try:
      front = fit_frontier([x["flops"] for x in minima], [x["loss_opt"] for x in minima]) if len(minima) > 1 else None
    except ValueError as e:
      raise ValueError(f"method {m!r}: {e}") from None
    mine = [p for p in points if p["method"] == m]
    fits[m] = {"n_points": len(mine), "minima": minima, "frontier": front,
               "parametric": fit_parametric([p["params"] for p in mine], [p["tokens"] for p in mine],
                                            [p["loss"] for p in mine])}
  fitted = [m for m in methods if fits[m]["frontier"] is not None]
  compared = [m for m in fitted if m != reference and reference in fitted]

  # One uniform draw per replicate, budget and slot; slot j is each method's j-th point in (size, seed) order.
  slots = max(len(g["loss"]) for m in methods for g in groups[m])
  boot = {m: [] for m in methods}
  failed = 0
  for u in np.random.default_rng(seed).random((n_boot, len(budgets), slots)):
    try:
      fronts = {m: _resampled_frontier(groups[m], u, budgets, fits[m]["frontier"]) for m in fitted}
      compare = {m: [_compare(fronts[m], fronts[reference], g["budget"]) for g in groups[m]] for m in compared}
    except (ValueError, np.linalg.LinAlgError):
      failed += 1
      continue
    for m in fitted:
      boot[m].append(([fronts[m][k] for k in ("E", "A", "alpha")], compare.get(m)))

  for m in methods:
    fit = fits[m]
    fit["frontier_ci"], fit["comparison"] = None, []
    if m in fitted:
      samples = np.array([front for front, _ in boot[m]]).reshape(-1, 3)
      fit["frontier_ci"] = {k: _interval(samples[:, j]) for j, k in enumerate(("E", "A", "alpha"))}
    if m in compared:
      samples = np.array([pairs for _, pairs in boot[m]]).reshape(-1, len(groups[m]), 2)
      for j, g in enumerate(groups[m]):
        multiplier, delta = _compare(fit["frontier"], fits[reference]["frontier"], g["budget"])
        loss = float(frontier_loss(fit["frontier"], g["budget"]))
        fit["comparison"].append({
            "budget": g["budget"], "loss": loss, "reference_loss": loss - delta,
            "multiplier": multiplier, "multiplier_ci": _interval(samples[:, j, 0]),
            "delta_loss": delta, "delta_loss_ci": _interval(samples[:, j, 1])})
  notes = dict(notes or {})
  return _plain({"reference": reference, "budgets": budgets, "convention": notes.get("convention", CONVENTION),
                 "notes": notes, "n_boot": n_boot, "boot_failed": failed, "seed": seed, "methods": fits})


# ----------------------------------------------------------------------------- reports

def _num(x):
  """A result value as a float (None and "nan" -> nan, "inf" -> inf)."""
  return math.nan if x is None else float(x)


def _fmt(x, digits=4):
  """A number for a table: 4 significant digits, '-' when absent."""
  x = _num(x)
  return "-" if math.isnan(x) else f"{x:.{digits}g}"


def _with_ci(value, ci):
  """'value [lo, hi]', or the value alone without an interval."""
  return f"{_fmt(value)} [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else _fmt(value)


def _tables(result):
  """The report's two tables as (title, header, rows)."""
  rows = []
  for m, fit in result["methods"].items():
    by_budget = {c["budget"]: c for c in fit["comparison"]}
    for x in fit["minima"]:
      c = by_budget.get(x["budget"])
      versus = ["-", "-"]  # no comparison where a frontier is missing (a method or the reference with one budget)
      if m == result["reference"]:
        versus = ["ref", "ref"]
      elif c:
        versus = [_with_ci(c["multiplier"], c["multiplier_ci"]), _with_ci(c["delta_loss"], c["delta_loss_ci"])]
      rows.append([m, _fmt(x["budget"], 3), _fmt(x["loss_opt"]), _fmt(x["params_opt"], 3), x["kind"]] + versus)
  budgets = ("IsoFLOP minima and compute multipliers over " + result["reference"],
             ["method", "budget C (FLOPs)", "loss at minimum", "N_opt", "minimum", "multiplier M [95% CI]",
              "delta loss at equal C [95% CI]"], rows)
  rows = []
  for m, fit in result["methods"].items():
    front, ci, law = fit["frontier"], fit["frontier_ci"] or {}, fit["parametric"]
    cells = ["-"] * 4
    if front:
      cells = [f"{_fmt(front[k])} (fixed)" if k in front["fixed"] else _with_ci(front[k], ci.get(k))
               for k in ("E", "A", "alpha")] + [_fmt(front["c0"], 3)]
    rows.append([m] + cells + [", ".join(f"{k}={_fmt(law[k])}" for k in ("E", "A", "a", "B", "b")) if law else "-"])
  frontiers = ("Frontier L(C) = E + A (C/c0)^-alpha and parametric law L(N, D) = E + A/N^a + B/D^b",
               ["method", "E [95% CI]", "A [95% CI]", "alpha [95% CI]", "c0 (FLOPs)", "parametric fit"], rows)
  return [budgets, frontiers]


def report_markdown(result):
  """The fit as markdown: minima and multipliers per method and budget, then the frontier parameters."""
  out = []
  for title, header, rows in _tables(result):
    out += [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows] + [""]
  out.append(f"{result['convention']} Bootstrap: {result['n_boot']} replicates, {result['boot_failed']} failed.")
  return "\n".join(out) + "\n"


def table(result):
  """The same tables as report_markdown, as aligned plain text for the terminal."""
  out = []
  for title, header, rows in _tables(result):
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    out += [title] + ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header] + rows] + [""]
  out.append(f"bootstrap: {result['n_boot']} replicates, {result['boot_failed']} failed")
  return "\n".join(out)


def write_fit(result, out_dir):
  """Write out_dir/fit.json and out_dir/fit.md (creating out_dir); returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "fit.json"), os.path.join(out_dir, "fit.md")]
  with open(paths[0], "w") as f:
    json.dump(result, f, indent=1, allow_nan=False)
    f.write("\n")
  with open(paths[1], "w") as f:
    f.write(report_markdown(result))
  return paths
