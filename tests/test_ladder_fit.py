"""The scaling ladder's fits (latent_jax/ladder/fit.py) on points drawn from known laws, and its report and plots."""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from latent_jax.ladder import fit
from latent_jax.ladder.fit import minima, noise

# Hoffmann et al. 2022's approach-3 fit (Chinchilla): L(N, D) = E + A/N^a + B/D^b.
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
BUDGETS = np.geomspace(1e18, 1e20, 5)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def law(n, d):
  return E + A / n ** ALPHA + B / d ** BETA


def n_opt(c):
  """The N minimising law(N, C/6N) (Hoffmann et al. 2022, Eq. 4)."""
  return (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA)) * (c / 6) ** (BETA / (ALPHA + BETA))


def ladder(method, k, rng, sizes=7, seeds=3, noise=0.003):
  """IsoFLOP points of a method whose loss at compute C is the law's at k*C: a compute multiplier of k.

  Every method gets the same sizes per budget, spanning a factor 4 either side of the optimum, so the
  parabola minima lie inside them and the bootstrap pairs the methods size by size.
  """
  points = []
  for c in BUDGETS:
    for n in n_opt(c * 1.25) * np.geomspace(1 / 4, 4, sizes):
      for seed in range(seeds):
        loss = law(n, k * c / (6 * n)) * math.exp(noise * rng.standard_normal())
        points.append({"method": method, "flops": c, "params": n, "tokens": c / (6 * n), "loss": loss, "seed": seed})
  return points


def test_parametric_fit_recovers_the_law():
  rng = np.random.default_rng(0)
  n, d = (x.ravel() for x in np.meshgrid(np.geomspace(2e7, 2e9, 6), np.geomspace(4e8, 4e10, 6)))
  losses = law(n, d) * np.exp(0.002 * rng.standard_normal(n.size))
  got = fit.fit_parametric(n, d, losses)
  # Tolerances ~2-3x the worst error over 20 noise seeds (E 0.025, a and b 0.01).
  assert abs(got["E"] - E) < 0.05 and abs(got["a"] - ALPHA) < 0.03 and abs(got["b"] - BETA) < 0.03, got
  assert got["n_points"] == 36 and got["huber"] > 0
  # Too few points, one IsoFLOP profile (ln D = const - ln N: a and b inseparable), unknown tokens: no fit.
  assert fit.fit_parametric(n[:4], d[:4], losses[:4]) is None
  assert fit.fit_parametric(n[:6], 1e19 / (6 * n[:6]), losses[:6]) is None
  assert fit.fit_parametric(n, np.full(n.size, np.nan), losses) is None


def test_multiplier_of_a_method_with_known_compute_advantage():
  # The law's frontier has an E, fitted with 5 budgets; over 30 noise seeds the pooled M was within 5% of k.
  k = 1.5
  rng = np.random.default_rng(1)
  points = ladder("baseline", 1.0, rng) + ladder("ncp", k, rng)
  result = fit.fit_ladder(points, n_boot=200, seed=0)
  entry = result["conventions"]["flops"]
  mult = entry["multipliers"]["ncp"]
  assert mult["budgets"] == result["budgets"] == [float(f"{c:.2g}") for c in BUDGETS] and mult["left_out"] == []
  assert abs(mult["pooled"] / k - 1) < 0.05 and mult["ci"][0] <= k <= mult["ci"][1], mult
  assert entry["frontier"]["fixed"] == [] and "fitted to 5 bracketed minima" in entry["frontier_note"]
  assert abs(entry["frontier"]["alpha"] - ALPHA * BETA / (ALPHA + BETA)) < 0.03
  # Five budgets: a multiplier per budget too, each interval holding k; every paired difference negative.
  assert len(mult["per_budget"]) == 5 and result["per_budget_note"] is None
  assert all(x["ci"][0] <= k <= x["ci"][1] for x in mult["per_budget"]), mult["per_budget"]
  for x in result["minima"]["ncp"]:
    assert x["kind"] == "parabola" and x["delta"]["n_seeds"] == 3 and x["delta"]["mean"] + 2 * x["delta"]["se"] < 0
  assert result["noise"]["ncp"]["dof"] == 5 * 7 * 2  # 35 cells of 3 seeds


def synthetic_ladder(rng, k, sigma, seeds=3, budgets=(2e12, 5e12, 1.2e13), sizes=5, curvature=0.08):
  """IsoFLOP profiles L = L*(C) + curvature (ln N - ln N*(C))^2 with the frontier L*(C) = 3.2 (C/5e12)^-0.1 (E = 0:
  inside the fit's model with 3 budgets), sizes placed around N* with a random offset, Gaussian seed noise; the
  method's L* is the reference's at k C: a known multiplier k with known noise."""
  points = []
  for method, factor in (("baseline", 1.0), ("x", k)):
    for c in budgets:
      n_star = 1e5 * (c / 5e12) ** 0.5
      for n in n_star * np.exp(np.linspace(-1.2, 1.2, sizes) + rng.uniform(-0.4, 0.4)):
        for seed in range(seeds):
          loss = 3.2 * (factor * c / 5e12) ** -0.1 + curvature * math.log(n / n_star) ** 2 + sigma * rng.standard_normal()
          points.append({"method": method, "flops": c, "params": n, "tokens": c / 6 / n, "loss": loss, "seed": seed})
  return points


def test_intervals_cover_a_known_multiplier_about_95_percent_of_the_time():
  """Held-out synthetic ladders (not the data the method was built on): the 95% interval of the pooled
  multiplier holds the true k in 90-99% of 200 ladders, at two noise levels (measured: 94.5% and 97%)."""
  rng = np.random.default_rng(12345)
  for sigma in (0.01, 0.03):
    hits = 0
    for _ in range(200):
      result = fit.fit_ladder(synthetic_ladder(rng, 1.5, sigma), n_boot=400, seed=int(rng.integers(2**31)))
      lo, hi = result["conventions"]["flops"]["multipliers"]["x"]["ci"]
      hits += lo <= 1.5 <= hi
    assert 0.90 <= hits / 200 <= 0.99, (sigma, hits)


def test_one_seed_gives_no_interval_and_edges_are_left_out():
  rng = np.random.default_rng(3)
  points = synthetic_ladder(rng, 1.3, 0.01, seeds=1)
  # The method's largest budget sampled only on one side of its optimum: an edge, left out of the pooled M.
  points = [p for p in points if not (p["method"] == "x" and p["flops"] == 1.2e13 and p["params"] < 1.6e5)]
  result = fit.fit_ladder(points, n_boot=100)
  mult = result["conventions"]["flops"]["multipliers"]["x"]
  assert result["n_boot"] == 0 and mult["ci"] is None and "no noise estimate" in result["noise_note"]
  assert mult["left_out"] == [1.2e13] and mult["budgets"] == [2e12, 5e12]
  assert result["minima"]["x"][2]["kind"] == "edge" and not result["minima"]["x"][2]["bracketed"]
  assert result["minima"]["x"][0]["delta"]["se"] is None  # one seed: a difference, no standard error
  report = fit.report_markdown(result)
  assert "[" not in report.split("Pooled compute multiplier")[1].split("###")[0].split("|---|")[1]  # no interval printed
  assert "edge (not bracketed)" in report and "No intervals" in report and "fewer than 5" in report


def test_minima_parabola_edges_and_given():
  log_n = np.log(np.geomspace(1e8, 1e9, 5))
  mean = 2.0 + 0.1 * (log_n - math.log(3e8)) ** 2
  loss, log_opt, kind = minima(log_n, mean[:, None])
  assert kind[0] == "parabola" and loss[0] == pytest.approx(2.0) and math.exp(log_opt[0]) == pytest.approx(3e8)
  # A minimum beyond the sizes: the lowest point is at an edge, not bracketed; a parabola opening downward
  # whose lowest point is inside: the best point.
  far = 2.0 + 0.1 * (log_n - math.log(3e9)) ** 2
  assert minima(log_n, far[:, None])[2][0] == "edge"
  wave = np.array([2.0, 1.9, 2.5, 1.95, 2.0])  # lowest inside, the parabola through them opens downward
  loss, log_opt, kind = minima(log_n, wave[:, None])
  assert kind[0] == "best_point" and loss[0] == 1.9 and log_opt[0] == log_n[1]
  assert minima(np.array([np.nan]), np.array([[2.7]]))[2][0] == "given"
  assert minima(log_n[:2], np.array([[2.0], [2.1]]))[2][0] == "edge"
  # Replicates in columns: the same answers, one per column.
  both = minima(log_n, np.stack([mean, far], 1))
  assert list(both[2]) == ["parabola", "edge"]


def test_noise_pools_seed_variance_within_cells():
  points = [{"method": "m", "flops": 1e19, "params": n, "loss": x, "seed": s}
            for n, xs in ((1e8, (2.0, 2.2)), (2e8, (3.0, 3.1, 3.2))) for s, x in enumerate(xs)]
  sd, dof = noise(points)
  assert dof == 3 and sd == pytest.approx(math.sqrt((0.02 + 0.02) / 3))
  assert noise(points[:1] + points[2:3]) == (None, 0)


def test_frontier_inverse_and_fit():
  params = {"E": 1.7, "A": 0.9, "alpha": 0.15, "c0": 1e19}
  c = np.geomspace(1e17, 1e23, 13)
  assert fit.frontier_compute(params, fit.frontier_loss(params, c)) == pytest.approx(c, rel=1e-9)
  assert fit.frontier_compute(params, 1.7) == math.inf and fit.frontier_compute(params, 1.5) == math.inf
  assert fit.frontier_compute(params, 2.6) == pytest.approx(1e19)
  got = fit.fit_frontier(BUDGETS, fit.frontier_loss(params, BUDGETS), c0=1e19)  # 5 budgets: E fitted
  assert got["fixed"] == [] and got["E"] == pytest.approx(1.7, abs=1e-4)
  assert got["alpha"] == pytest.approx(0.15, rel=1e-3) and got["A"] == pytest.approx(0.9, rel=1e-3)
  two = fit.fit_frontier(BUDGETS[:2], [3.0, 2.8])
  assert two["fixed"] == ["E"] and two["E"] == 0
  assert fit.frontier_loss(two, BUDGETS[:2]) == pytest.approx([3.0, 2.8])
  three = fit.fit_frontier(BUDGETS[:3], [3.0, 2.8, 2.7])  # fewer than 5 budgets: E = 0, least squares on ln L
  slope, intercept = np.polyfit(np.log(BUDGETS[:3] / three["c0"]), np.log([3.0, 2.8, 2.7]), 1)
  assert three["fixed"] == ["E"] and three["alpha"] == pytest.approx(-slope) and three["A"] == pytest.approx(math.exp(intercept))
  with pytest.raises(ValueError, match="two or more budgets"):
    fit.fit_frontier([1e19, 1e19], [3.0, 2.9])


def test_read_points(tmp_path):
  good = tmp_path / "good.csv"
  good.write_text("# a ladder\nmethod,flops,params,tokens,loss,seed,budget,note\n"
                  "baseline,1.01e18,1e8,1.6e9,3.1,1,1e18,x\nncp,2e18,,,2.9,,,\n")
  points = fit.read_points(str(good))
  assert points[0] == {"method": "baseline", "flops": 1.01e18, "params": 1e8, "tokens": 1.6e9, "loss": 3.1, "seed": 1,
                       "budget": 1e18}
  assert math.isnan(points[1]["params"]) and math.isnan(points[1]["tokens"]) and points[1]["seed"] == 0
  assert "budget" not in points[1] and fit.budget_of(points[1]) == 2e18
  bad = {
      "method,flops,params,tokens\nbaseline,1e18,1e8,1e9\n": r"line 1: the header has no column 'loss'",
      "method,flops,params,tokens,loss\nbaseline,1e18,1e8,1e9,3\nbaseline,lots,1e8,1e9,3\n": r"line 3, column 'flops'",
      "# c\nmethod,flops,params,tokens,loss\nbaseline,1e18,1e8,1e9,-3\n": r"line 3, column 'loss'.*> 0",
      "method,flops,params,tokens,loss\nbaseline,1e18,1e8,1e9\n": r"line 2: 4 fields",
      "method,flops,params,tokens,loss\nbaseline,1e18,1e8,1e9,3\nncp,1e18,1e8,1e9,3,7\n": r"line 3: 6 fields but the header has 5",
  }
  for i, (text, message) in enumerate(bad.items()):
    path = tmp_path / f"bad{i}.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
      fit.read_points(str(path))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_both_conventions_and_a_refit_that_rewrites_nothing(tmp_path):
  """With lm_head_flops, C without the head is fitted too (the minimum's C interpolated along the profile);
  1,000 points with 100 replicates (E fitted: scipy per replicate) fit in seconds; a refit leaves the files."""
  rng = np.random.default_rng(2)
  points = ladder("baseline", 1.0, rng, sizes=10, seeds=10) + ladder("ncp", 1.3, rng, sizes=10, seeds=10)
  for p in points:  # a head costing 6 d V per token with d ~ N^(1/3): a larger share at smaller N
    p["lm_head_flops"] = 6 * 2 * p["params"] ** (1 / 3) * 5_000 * p["tokens"]
  assert len(points) == 1000 and all(p["lm_head_flops"] < p["flops"] for p in points)
  start = time.perf_counter()
  result = fit.fit_ladder(points, n_boot=100, notes={"flops": "C = 6ND"})
  elapsed = time.perf_counter() - start
  assert elapsed < 60, f"fit_ladder of 1,000 points took {elapsed:.1f}s"
  assert set(result["conventions"]) == {"with_lm_head", "without_lm_head"} and result["parametric"]["ncp"]["fit"]
  for x in result["minima"]["baseline"]:  # the minimum's C without the head: between its neighbours' along the profile
    cell = sorted((p["params"], p["flops"] - p["lm_head_flops"]) for p in points
                  if p["method"] == "baseline" and fit.budget_of(p) == x["budget"])
    below = max(c for n, c in cell if n <= x["params_opt"])
    above = min(c for n, c in cell if n >= x["params_opt"])
    assert min(below, above) <= x["flops"]["without_lm_head"] <= max(below, above)
    flops = {p["flops"] for p in points if p["method"] == "baseline" and fit.budget_of(p) == x["budget"]}
    assert len(flops) == 1 and x["flops"]["with_lm_head"] == pytest.approx(flops.pop(), rel=1e-5)
  json_path, md_path = fit.write_fit(result, str(tmp_path / "out"))
  assert json.load(open(json_path)) == result
  report = open(md_path).read()
  assert "FLOPs without the LM head" in report and "| 1e+18 | ncp |" in report and "Pooled" in fit.table(result)
  stamps = [os.stat(p).st_mtime_ns for p in (json_path, md_path)]
  time.sleep(0.01)
  fit.write_fit(fit.fit_ladder(points, n_boot=100, notes={"flops": "C = 6ND"}), str(tmp_path / "out"))
  assert [os.stat(p).st_mtime_ns for p in (json_path, md_path)] == stamps


def test_fit_imports_without_jax():
  code = ("import importlib.util, sys; "
          "spec = importlib.util.spec_from_file_location('fit', 'latent_jax/ladder/fit.py'); "
          "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
          "assert not {'jax', 'flax', 'latent_jax'} & set(sys.modules), sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plot_ladder_writes_two_pngs(tmp_path):
  pytest.importorskip("matplotlib")
  from latent_jax.ladder.plot import plot_ladder
  points = ladder("baseline", 1.0, np.random.default_rng(3), sizes=5, seeds=1)
  points += ladder("ncp", 1.5, np.random.default_rng(4), sizes=5, seeds=1)
  lines = plot_ladder(points, fit.fit_ladder(points, n_boot=5), str(tmp_path))
  assert lines == [f"wrote {tmp_path / 'isoflop.png'}", f"wrote {tmp_path / 'frontier.png'}"]
  for name in ("isoflop.png", "frontier.png"):
    assert open(tmp_path / name, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(tmp_path / name) > 10_000
  # Points without sizes (a paper's table of minima): no empty IsoFLOP panel, a line saying why.
  table = [{"method": "ncp", "flops": c, "params": math.nan, "tokens": math.nan, "loss": 3 * (c / 1e19) ** -0.05, "seed": 0}
           for c in BUDGETS]
  lines = plot_ladder(table, fit.fit_ladder(table, reference="ncp"), str(tmp_path / "table"))
  assert "isoflop.png not drawn: the points give no sizes" in lines[0] and not os.path.exists(tmp_path / "table" / "isoflop.png")


def test_tune_best_factor_and_its_interpolation_over_sizes():
  from latent_jax.ladder.tune import best_factor, factor_at
  factors = [0.25, 0.5, 1.0, 2.0, 4.0]
  loss = [3.0 + 0.05 * math.log(f / 1.3) ** 2 for f in factors]  # a parabola in ln(factor), vertex at 1.3
  assert best_factor(factors, loss)[0] == pytest.approx(1.3) and best_factor(factors, loss)[1] == "parabola"
  assert best_factor(factors, sorted(loss))[1] == "edge"  # falling: the smallest factor is best
  assert best_factor([0.5, 1.0, 2.0], [3.1, 3.0, math.inf]) == (1.0, "best")  # a diverged run: no parabola
  # A sweep rising steeply above its optimum: the vertex of the best point and its neighbours, in log2 units
  # x = -2, -1, 0 at losses 3.41, 3.38, 3.48: x* = -1 - (3.48 - 3.41) / 2 / (3.41 - 2 * 3.38 + 3.48).
  x = -1 - (3.48 - 3.41) / 2 / (3.41 - 2 * 3.38 + 3.48)
  assert best_factor([0.25, 0.5, 1.0, 2.0], [3.41, 3.38, 3.48, 3.51])[0] == pytest.approx(2 ** x)
  summary = {"sizes": {"a": {"params": 1e4, "factor": 1.0}, "b": {"params": 4e4, "factor": 4.0}}}
  assert factor_at(summary, 2e4) == pytest.approx(2.0)  # halfway in ln N: halfway in ln(factor)
  assert factor_at(summary, 1e3) == 1.0 and factor_at(summary, 1e6) == 4.0  # held beyond the tuned sizes
