"""Scaling-ladder fits: raw IsoFLOP minima with paired seed differences, then pooled compute multipliers.

Plain numpy/scipy functions of points, so `python -m latent_jax.ladder fit --points FILE.csv` runs without
jax or any training code. A point is a dict: method, flops (training compute C), params (non-embedding N,
NaN when unknown), tokens (D, NaN when unknown), loss (validation nats/token), seed (default 0), and
optionally budget (the planned budget it belongs to; without it, flops rounded to 2 significant digits)
and lm_head_flops (the LM head's share of flops: then both FLOPs conventions are fitted).

What is reported, in this order (docs/ladder.md):
1. Per method and budget, the IsoFLOP minimum (Hoffmann et al. 2022, approach 2) of the seed-mean profile:
   the vertex of a parabola in ln N where the lowest mean is inside the sizes, else flagged "edge" (not
   bracketed, left out of the multipliers); and the paired difference to the reference, seed by seed,
   with its standard error over seeds.
2. One pooled multiplier per method and convention: M such that the reference frontier at M C meets the
   method's bracketed minima (the geometric mean over budgets of C_ref(L_m(C_b)) / C_b). The reference
   frontier L(C) = E + A (C/c0)^-alpha fits E only from MIN_BUDGETS_FOR_E budgets; below that E = 0.
3. Per-budget multipliers only from MIN_BUDGETS_PER_BUDGET budgets; the parametric L(N, D) only from
   MIN_POINTS_PER_PARAMETER points per parameter; otherwise a line says why they are left out.
Intervals come from seed noise: a parametric bootstrap that redraws every (method, budget, size) mean
from the pooled seed variance of its method (its own uncertainty drawn too), and refits. With one seed
per point there is no noise estimate and no interval.
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
OPTIONAL = ("seed", "budget", "lm_head_flops")
HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, approach 3
MIN_BUDGETS_FOR_E = 5  # E, A and alpha from fewer budgets pass through every minimum and say nothing
MIN_BUDGETS_PER_BUDGET = 5  # a multiplier per budget (and a trend) needs this many budgets
MIN_POINTS_PER_PARAMETER = 5  # the parametric law's 5 parameters need 25 distinct (N, D)
SIGNIFICANT = 6  # digits kept in fit.json: a refit of the same points writes the same bytes


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
  """Points from a CSV with columns method,flops,params,tokens,loss (optional seed, budget, lm_head_flops;
  other columns are kept out; '#' lines skipped)."""
  hints = {
      "flops": "write the training compute in FLOPs, e.g. 1.2e18",
      "params": "write the non-embedding parameter count, or leave it empty when unknown",
      "tokens": "write the number of training tokens, or leave it empty when unknown",
      "loss": "write the validation loss in nats/token (> 0)",
      "budget": "write the planned budget in FLOPs, or leave it empty to group by flops",
      "lm_head_flops": "write the LM head's FLOPs within flops, or leave it empty",
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
      if len(fields) != len(header):
        raise ValueError(f"{path}, line {line}: {len(fields)} fields but the header has {len(header)}; "
                         "write one value per column (empty for unknown params/tokens; quote a field with a comma)")
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
      for column in ("budget", "lm_head_flops"):
        if row.get(column):
          point[column] = _number(row[column], path, line, column, hints[column])
      points.append(point)
  if not points:
    raise ValueError(f"{path}: no points; write a header line {','.join(COLUMNS)} and one line per run")
  return points


def budget_of(point):
  """The budget a point belongs to: its planned budget, else its flops rounded to 2 significant digits."""
  budget = point.get("budget")
  if budget is None or math.isnan(budget):
    return float(f"{point['flops']:.2g}")
  return float(budget)


def conventions(points):
  """{name: C of a point}: the FLOPs as given, and without the LM head where every point has lm_head_flops."""
  if all("lm_head_flops" in p for p in points):
    bad = [p for p in points if not 0 <= p["lm_head_flops"] < p["flops"]]
    if bad:
      raise ValueError(f"lm_head_flops {bad[0]['lm_head_flops']:.4g} is not below the point's flops "
                       f"{bad[0]['flops']:.4g} ({bad[0]['method']}); lm_head_flops is the LM head's share of flops")
    return {"with_lm_head": lambda p: p["flops"], "without_lm_head": lambda p: p["flops"] - p["lm_head_flops"]}
  return {"flops": lambda p: p["flops"]}


# ----------------------------------------------------------------------------- IsoFLOP profiles and minima

def profile(points, compute):
  """One method's points at one budget as a table: log N of its sizes (ascending; each point of unknown N a
  size of its own), seeds, loss [sizes, seeds] (NaN where a seed is missing) and ln C per size (mean over seeds)."""
  known = sorted({p["params"] for p in points if not math.isnan(p["params"])})
  keys = [p["params"] if not math.isnan(p["params"]) else ("unknown", i) for i, p in enumerate(points)]
  sizes = known + [k for k in keys if isinstance(k, tuple)]
  seeds = sorted({p.get("seed", 0) for p in points})
  loss = np.full((len(sizes), len(seeds)), np.nan)
  log_c = np.zeros((len(sizes), len(seeds)))
  for key, p in zip(keys, points):
    i, j = sizes.index(key), seeds.index(p.get("seed", 0))
    loss[i, j], log_c[i, j] = p["loss"], math.log(compute(p))
  count = (~np.isnan(loss)).sum(1)
  return {"log_n": np.log([s if not isinstance(s, tuple) else math.nan for s in sizes]), "seeds": seeds,
          "loss": loss, "log_c": np.where(~np.isnan(loss), log_c, 0).sum(1) / count, "count": count}


def minima(log_n, mean):
  """IsoFLOP minima of profiles: mean [sizes, R] (R replicates) -> (loss_opt [R], ln N_opt [R], kind [R]).

  kind: "parabola" (the vertex of loss = c2 ln N^2 + c1 ln N + c0 through the sizes, a minimum between the
  smallest and largest, with the lowest mean inside them: Hoffmann et al. 2022, approach 2), "best_point"
  (the lowest mean is inside the sizes but the parabola is not a minimum there), "edge" (the lowest mean
  is at the smallest or largest size: not bracketed) or "given" (one size: a table of minima).
  """
  mean = np.asarray(mean, float)
  best = np.argmin(mean, axis=0)
  cols = np.arange(mean.shape[1])
  loss, log_opt = mean[best, cols], log_n[best]
  n = mean.shape[0]
  if n == 1:
    return loss, log_opt, np.full(mean.shape[1], "given")
  kind = np.where((best == 0) | (best == n - 1), "edge", "best_point")
  if n >= 3 and not np.isnan(log_n).any():
    centre = log_n.mean()  # centring keeps the fit well conditioned at ln N ~ 20
    c2, c1, c0 = np.polyfit(log_n - centre, mean, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
      vertex = -c1 / (2 * c2)
    ok = (kind == "best_point") & (c2 > 0) & (vertex >= log_n.min() - centre) & (vertex <= log_n.max() - centre)
    loss = np.where(ok, c0 - c1 ** 2 / (4 * np.where(ok, c2, 1)), loss)
    log_opt = np.where(ok, vertex + centre, log_opt)
    kind = np.where(ok, "parabola", kind)
  return loss, log_opt, kind


def _log_c_at(prof, log_opt):
  """ln C of the profile at ln N_opt: interpolated between its sizes (the FLOPs of a convention that the
  budget did not hold fixed vary along the profile); the mean where N is unknown."""
  if np.isnan(prof["log_n"]).any():
    return np.full(np.shape(log_opt), prof["log_c"].mean())
  return np.interp(log_opt, prof["log_n"], prof["log_c"])


def noise(points):
  """Pooled seed variance of one method's losses within its (budget, size) cells: (sd, degrees of freedom);
  (None, 0) without two seeds in any cell."""
  cells = {}
  for p in points:
    cells.setdefault((budget_of(p), p["params"] if not math.isnan(p["params"]) else id(p)), []).append(p["loss"])
  dof = sum(len(v) - 1 for v in cells.values())
  if dof == 0:
    return None, 0
  return math.sqrt(sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in cells.values()) / dof), dof


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


def power_law(log_c, log_l, c0):
  """L = A (C/c0)^-alpha by least squares on ln L (E fixed at 0), for replicates: log_c, log_l [budgets, R]
  -> (A [R], alpha [R])."""
  x = np.asarray(log_c) - math.log(c0)
  xm, ym = x.mean(0), np.asarray(log_l).mean(0)
  slope = ((x - xm) * (log_l - ym)).sum(0) / ((x - xm) ** 2).sum(0)
  return np.exp(ym - slope * xm), -slope


def fit_frontier(flops, losses, c0=None, fit_e=None):
  """Fit L(C) = E + A (C/c0)^-alpha to IsoFLOP minima by least squares on log L (Hoffmann et al. 2022, approach 2).

  Returns {"E", "A", "alpha", "c0", "fixed"}: A is for C normalised by c0 (the geometric mean of `flops` unless
  given). E is fitted (L-BFGS-B, E in [0, min loss), alpha in (0, 2], from the best few of a grid) only with
  MIN_BUDGETS_FOR_E or more budgets (or when fit_e says so); otherwise E = 0, a power law ("fixed": ["E"]).
  Fewer than two budgets, or a loss that does not fall with compute under E = 0, raise ValueError.
  """
  flops, losses = np.asarray(flops, dtype=float), np.asarray(losses, dtype=float)
  n_budgets = np.unique(flops).size
  if n_budgets < 2:
    raise ValueError(f"a compute frontier needs minima at two or more budgets, got {n_budgets}")
  c0 = float(np.exp(np.mean(np.log(flops)))) if c0 is None else float(c0)
  log_c, log_l = np.log(flops / c0), np.log(losses)
  if not (n_budgets >= MIN_BUDGETS_FOR_E if fit_e is None else fit_e):
    a, alpha = power_law(np.log(flops)[:, None], log_l[:, None], c0)
    if alpha[0] <= 0:
      raise ValueError("the loss does not fall with compute across the budgets")
    return {"E": 0.0, "A": float(a[0]), "alpha": float(alpha[0]), "c0": c0, "fixed": ["E"]}
  e_max = losses.min() * (1 - 1e-9)
  e, alpha = (x.ravel() for x in np.meshgrid(e_max * np.array([0, .3, .5, .7, .8, .9, .95, .99]),
                                             np.array([.02, .05, .1, .2, .35, .5, .8, 1.2])))
  # For a given (E, alpha), ln A is the mean offset of ln(L - E) + alpha ln C: a start already on the data.
  log_a = np.mean(np.log(losses - e[:, None]) + alpha[:, None] * log_c, axis=1)
  starts = np.stack([e, log_a, alpha], -1)
  starts = starts[np.argsort(_frontier_objective(starts, log_c, log_l)[0])[:3]]
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


def parametric_note(params, tokens):
  """Why the parametric law is not fitted to these points (None when it is)."""
  params, tokens = np.asarray(params, float), np.asarray(tokens, float)
  known = ~(np.isnan(params) | np.isnan(tokens))
  cells = len({(n, d) for n, d in zip(params[known], tokens[known])})
  need = 5 * MIN_POINTS_PER_PARAMETER
  if cells < need:
    return (f"{cells} distinct (N, D) with both known, fewer than {need} ({MIN_POINTS_PER_PARAMETER} per parameter "
            "of E + A/N^a + B/D^b): not identifiable from these points")
  u, v = np.log(params[known]), np.log(tokens[known])
  if np.unique(u).size < 3 or np.unique(v).size < 3 or abs(np.corrcoef(u, v)[0, 1]) > 1 - 1e-6:
    return "N and D do not vary independently (one IsoFLOP profile): a and b cannot be told apart"
  return None


def fit_parametric(params, tokens, losses):
  """Fit L(N, D) = E + A/N^a + B/D^b with a Huber loss on ln L (Hoffmann et al. 2022, approach 3, delta 1e-3).

  Uses the points with known N and D; None where `parametric_note` says why not. Otherwise {"E", "A", "a",
  "B", "b", "huber" (the summed Huber loss), "n_points"}: L-BFGS-B from the 5 best of a grid of 4^5 starts,
  in ln N and ln D centred on their means so that ln A and a are not entangled.
  """
  params, tokens, losses = (np.asarray(x, dtype=float) for x in (params, tokens, losses))
  if parametric_note(params, tokens):
    return None
  known = ~(np.isnan(params) | np.isnan(tokens))
  n, d, loss = params[known], tokens[known], losses[known]
  u, v = np.log(n) - np.log(n).mean(), np.log(d) - np.log(d).mean()
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

def _interval(values):
  """2.5 and 97.5 percentiles (order statistics, so replicates with M = inf stay inf); None without replicates."""
  values = np.asarray(values, float)
  if values.size == 0:
    return None
  return [float(x) for x in np.percentile(values, [2.5, 97.5], method="inverted_cdf")]


def _multipliers(front, log_c, loss):
  """ln of C_ref(L_m) / C_m per budget: log_c, loss [budgets, R]; front has E [R], A [R], alpha [R], c0."""
  gap = loss - front["E"]
  with np.errstate(divide="ignore", invalid="ignore"):
    log_cref = math.log(front["c0"]) + (np.log(front["A"]) - np.log(gap)) / front["alpha"]
  return np.where(gap > 0, log_cref - log_c, np.inf)


def _replicate_frontier(log_c, loss, c0, fit_e):
  """The reference frontier of each replicate: log_c, loss [budgets, R] -> {E, A, alpha} arrays [R], c0."""
  if not fit_e:
    a, alpha = power_law(log_c, np.log(loss), c0)
    return {"E": np.zeros_like(a), "A": a, "alpha": alpha, "c0": c0}
  fits = [fit_frontier(np.exp(log_c[:, r]), loss[:, r], c0=c0, fit_e=True) for r in range(loss.shape[1])]
  return {k: np.array([f[k] for f in fits]) for k in ("E", "A", "alpha")} | {"c0": c0}


def fit_ladder(points, reference="baseline", n_boot=1000, seed=0, notes=None):
  """Raw minima, paired seed differences, pooled multipliers per FLOPs convention; intervals from seed noise.

  Returns a JSON-safe dict (see module docstring and docs/ladder.md): reference, budgets, noise per method,
  minima per method (each budget's minimum with its kind, the paired difference to the reference and its
  standard error), per convention the reference frontier and each method's pooled multiplier with its 95%
  interval (and per-budget multipliers with enough budgets), the parametric fits or why they are left out.
  """
  methods = sorted({p["method"] for p in points}, key=lambda m: (m != reference, m))
  if reference not in methods:
    raise ValueError(f"the reference method {reference!r} has no points (methods: {', '.join(methods)}); "
                     "name the reference with --reference")
  convs = conventions(points)
  rng = np.random.default_rng(seed)
  budgets = sorted({budget_of(p) for p in points})
  by = {m: {b: [p for p in points if p["method"] == m and budget_of(p) == b] for b in budgets} for m in methods}
  sd = {m: noise([p for p in points if p["method"] == m]) for m in methods}
  boot = n_boot if all(s is not None for s, _ in sd.values()) else 0

  # Per method and budget: the profile (in the first convention: sizes, seeds, losses are the same in each),
  # its observed minimum, and the bootstrap's redrawn minima [R].
  table, drawn = {m: [] for m in methods}, {m: {} for m in methods}
  for m in methods:
    s, dof = sd[m]
    scale = s * np.sqrt(dof / rng.chisquare(dof, boot)) if boot else np.zeros(0)  # the variance's own uncertainty
    for b in budgets:
      if not by[m][b]:
        continue
      prof = {c: profile(by[m][b], compute) for c, compute in convs.items()}
      first = next(iter(prof.values()))
      mean = np.nanmean(first["loss"], 1)
      loss, log_opt, kind = (x[0] for x in minima(first["log_n"], mean[:, None]))
      redrawn = mean[:, None] + rng.standard_normal((mean.size, boot)) * scale / np.sqrt(first["count"])[:, None]
      r_loss, r_log_opt, _ = minima(first["log_n"], redrawn) if boot else (np.zeros(0),) * 3
      drawn[m][b] = {"loss": r_loss, "log_c": {c: _log_c_at(p, r_log_opt) for c, p in prof.items()}}
      table[m].append({"budget": b, "loss": float(loss), "params_opt": float(np.exp(log_opt)), "kind": str(kind),
                       "bracketed": str(kind) != "edge", "n_sizes": int(mean.size),
                       "n_seeds": int(first["count"].max()), "flops": {c: float(np.exp(_log_c_at(p, log_opt)))
                                                                        for c, p in prof.items()},
                       "per_seed": {str(sd_): float(minima(first["log_n"], first["loss"][:, [j]])[0][0])
                                    for j, sd_ in enumerate(first["seeds"]) if not np.isnan(first["loss"][:, j]).any()}})
  for m in methods:  # the paired difference to the reference, seed by seed
    ref = {x["budget"]: x for x in table[reference]}
    for x in table[m]:
      x["delta"] = None
      if m != reference and x["budget"] in ref:
        seeds = sorted(set(x["per_seed"]) & set(ref[x["budget"]]["per_seed"]))
        d = np.array([x["per_seed"][s] - ref[x["budget"]]["per_seed"][s] for s in seeds])
        x["delta"] = {"mean": float(d.mean()) if d.size else None, "n_seeds": int(d.size),
                      "se": float(d.std(ddof=1) / math.sqrt(d.size)) if d.size >= 2 else None}

  result_conventions = {}
  for c in convs:
    ref_rows = [x for x in table[reference] if x["bracketed"]]
    entry = {"frontier": None, "frontier_note": None, "multipliers": {}}
    result_conventions[c] = entry
    if len(ref_rows) < 2:
      entry["frontier_note"] = (f"{len(ref_rows)} bracketed minimum of {reference}: a frontier needs two; "
                                "widen its sizes (max_sizes_per_budget) or add budgets")
      continue
    fit_e = len(ref_rows) >= MIN_BUDGETS_FOR_E
    front = fit_frontier([x["flops"][c] for x in ref_rows], [x["loss"] for x in ref_rows], fit_e=fit_e)
    entry["frontier"] = front
    entry["frontier_note"] = (f"E, A and alpha fitted to {len(ref_rows)} bracketed minima" if fit_e else
                              f"E fixed at 0 (a power law): {len(ref_rows)} bracketed minima, fewer than "
                              f"{MIN_BUDGETS_FOR_E} to fit E")
    if boot:
      log_c = np.stack([drawn[reference][x["budget"]]["log_c"][c] for x in ref_rows])
      r_front = _replicate_frontier(log_c, np.stack([drawn[reference][x["budget"]]["loss"] for x in ref_rows]),
                                    front["c0"], fit_e)
    for m in methods:
      if m == reference:
        continue
      rows = [x for x in table[m] if x["bracketed"]]
      left_out = [x["budget"] for x in table[m] if not x["bracketed"]]
      mult = {"pooled": None, "ci": None, "budgets": [x["budget"] for x in rows], "left_out": left_out,
              "per_budget": None}
      entry["multipliers"][m] = mult
      if not rows:
        continue
      one = lambda v: np.array([v])
      log_m = _multipliers({k: one(v) if k != "c0" else v for k, v in front.items() if k != "fixed"},
                           np.array([[math.log(x["flops"][c])] for x in rows]), np.array([[x["loss"]] for x in rows]))
      mult["pooled"] = float(np.exp(log_m.mean()))
      if boot:
        r_log_m = _multipliers(r_front, np.stack([drawn[m][x["budget"]]["log_c"][c] for x in rows]),
                               np.stack([drawn[m][x["budget"]]["loss"] for x in rows]))
        mult["ci"] = _interval(np.exp(r_log_m.mean(0)))
      if len(budgets) >= MIN_BUDGETS_PER_BUDGET:
        mult["per_budget"] = [{"budget": x["budget"], "multiplier": float(np.exp(log_m[j, 0])),
                               "ci": _interval(np.exp(r_log_m[j])) if boot else None} for j, x in enumerate(rows)]

  parametric = {}
  for m in methods:
    mine = [p for p in points if p["method"] == m]
    args = [p["params"] for p in mine], [p["tokens"] for p in mine]
    parametric[m] = {"fit": fit_parametric(*args, [p["loss"] for p in mine]), "note": parametric_note(*args)}
  for rows in table.values():
    for x in rows:
      del x["per_seed"]
  return _plain({
      "reference": reference, "budgets": budgets, "notes": dict(notes or {}), "n_boot": boot,
      "noise": {m: {"sd": s, "dof": dof} if s is not None else None for m, (s, dof) in sd.items()},
      "noise_note": None if boot else (", ".join(m for m, (s, _) in sd.items() if s is None) +
                                       ": one seed per point, no noise estimate, so no intervals"),
      "per_budget_note": (None if len(budgets) >= MIN_BUDGETS_PER_BUDGET else
                          f"{len(budgets)} budgets, fewer than {MIN_BUDGETS_PER_BUDGET}: no multiplier per budget "
                          "and no trend over compute, only the pooled one"),
      "minima": table, "conventions": result_conventions, "parametric": parametric})


def _plain(x):
  """JSON-safe copy with SIGNIFICANT digits: Python floats and ints, non-finite floats as "inf", "-inf", "nan"."""
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_plain(v) for v in x]
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(f"{x:.{SIGNIFICANT}g}") if math.isfinite(x) else str(float(x))
  return x if x is None or isinstance(x, str) else str(x)


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


LABELS = {"with_lm_head": "with the LM head", "without_lm_head": "without the LM head", "flops": "as given"}


def _sections(result):
  """The report as (title, lines before, header, rows) sections."""
  ref = result["reference"]
  rows = []
  for b in result["budgets"]:
    for m, table in result["minima"].items():
      for x in table:
        if x["budget"] != b:
          continue
        delta = x["delta"]
        versus = "ref" if m == ref else "-"
        if delta and delta["mean"] is not None:
          versus = f"{delta['mean']:+.4f}" + (f" ± {delta['se']:.4f}" if delta["se"] is not None else "") + \
              f" ({delta['n_seeds']} seeds)"
        rows.append([_fmt(b, 3), m, _fmt(x["loss"]), _fmt(x["params_opt"], 3),
                     x["kind"] + ("" if x["bracketed"] else " (not bracketed)"), f"{x['n_sizes']} x {x['n_seeds']}",
                     versus])
  noise = ", ".join(f"{m} {v['sd']:.4f} nats ({v['dof']} dof)" for m, v in result["noise"].items() if v)
  minima = ("IsoFLOP minima (raw)", [
      "Each budget's minimum of the seed-mean loss over sizes, and the paired difference to "
      f"{ref}: per seed, the method's minimum minus {ref}'s, mean ± standard error over seeds.",
      f"Seed noise (pooled sd within a point's seeds): {noise}." if noise else result["noise_note"] + "."],
      ["budget C", "method", "loss at minimum", "N_opt", "minimum", "sizes x seeds", f"minus {ref} (paired)"], rows)
  out = [minima]
  for c, entry in result["conventions"].items():
    lines = [f"FLOPs {LABELS.get(c, c)}. Reference frontier: " + (entry["frontier_note"] or "") + (
        (f": L(C) = {_fmt(entry['frontier']['E']) + ' + ' if entry['frontier']['E'] else ''}"
         f"{_fmt(entry['frontier']['A'])} (C / {_fmt(entry['frontier']['c0'], 3)})^-{_fmt(entry['frontier']['alpha'])}")
        if entry["frontier"] else "") + "."]
    rows = []
    for m, mult in entry["multipliers"].items():
      rows.append([m, _with_ci(mult["pooled"], mult["ci"]),
                   ", ".join(_fmt(b, 3) for b in mult["budgets"]) or "-",
                   ", ".join(_fmt(b, 3) for b in mult["left_out"]) or "-"])
    out.append((f"Pooled compute multiplier over {ref}, FLOPs {LABELS.get(c, c)}", lines,
                ["method", "M [95% interval]", "budgets used", "left out (minimum not bracketed)"], rows))
    per_budget = [[m, _fmt(x["budget"], 3), _with_ci(x["multiplier"], x["ci"])]
                  for m, mult in entry["multipliers"].items() for x in mult["per_budget"] or []]
    if per_budget:
      out.append((f"Multiplier per budget, FLOPs {LABELS.get(c, c)}", [], ["method", "budget C", "M [95% interval]"],
                  per_budget))
  rows = [[m, ", ".join(f"{k}={_fmt(v['fit'][k])}" for k in ("E", "A", "a", "B", "b")) if v["fit"] else
           "left out: " + v["note"]] for m, v in result["parametric"].items()]
  out.append(("Parametric law L(N, D) = E + A/N^a + B/D^b", [], ["method", "fit"], rows))
  return out


def _closing(result):
  lines = ["M: the reference frontier at M x C reaches the method's IsoFLOP minimum at C (M > 1: the method "
           "buys compute); pooled over the budgets whose minimum is bracketed (geometric mean of C_ref(L_m(C_b)) / C_b)."]
  if result["per_budget_note"]:
    lines.append(result["per_budget_note"] + ".")
  lines.append(f"Intervals: parametric bootstrap from the seed noise, {result['n_boot']} replicates." if result["n_boot"]
               else "No intervals: " + result["noise_note"] + ".")
  return lines


def report_markdown(result):
  """The fit as markdown: what the points are (notes), raw minima, the pooled multipliers, what is left out."""
  out = [f"- {k}: {v}" for k, v in result["notes"].items()] + ([""] if result["notes"] else [])
  for title, lines, header, rows in _sections(result):
    out += [f"### {title}", ""] + [x + "\n" for x in lines]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows] + [""]
  return "\n".join(out + _closing(result)) + "\n"


def table(result):
  """The same report as aligned plain text for the terminal."""
  out = []
  for title, lines, header, rows in _sections(result):
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    out += [title] + lines + ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header] + rows] + [""]
  return "\n".join(out + _closing(result))


def write_fit(result, out_dir):
  """Write out_dir/fit.json and out_dir/fit.md (creating out_dir), each only where its text changed; returns
  their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "fit.json"), os.path.join(out_dir, "fit.md")]
  for path, text in zip(paths, [json.dumps(result, indent=1, allow_nan=False) + "\n", report_markdown(result)]):
    if os.path.isfile(path) and open(path).read() == text:
      continue
    with open(path, "w") as f:
      f.write(text)
  return paths
