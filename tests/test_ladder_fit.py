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
  # Over 30 noise seeds the intervals held k at 90-100% of budgets and the estimate was within 6% of it.
  k = 1.5
  rng = np.random.default_rng(1)
  points = ladder("baseline", 1.0, rng) + ladder("ncp", k, rng)
  result = fit.fit_ladder(points, n_boot=100, seed=0)
  comparison = result["methods"]["ncp"]["comparison"]
  assert [c["budget"] for c in comparison] == result["budgets"] == [float(f"{c:.2g}") for c in BUDGETS]
  for c in comparison:
    lo, hi = c["multiplier_ci"]
    assert lo <= k <= hi and abs(c["multiplier"] / k - 1) < 0.1, c
    assert c["delta_loss_ci"][1] < 0, c  # the method is better at equal compute
  assert result["boot_failed"] == 0 and result["methods"]["baseline"]["comparison"] == []
  front = result["methods"]["baseline"]["frontier"]
  lo, hi = result["methods"]["baseline"]["frontier_ci"]["alpha"]
  assert lo <= front["alpha"] <= hi and abs(front["alpha"] - ALPHA * BETA / (ALPHA + BETA)) < 0.03


def test_isoflop_minimum_parabola_fallbacks_and_seed_average():
  n = np.geomspace(1e8, 1e9, 5)
  loss = 2.0 + 0.1 * np.log(n / 3e8) ** 2
  got = fit.isoflop_minimum([{"flops": 1e19, "params": x, "loss": y} for x, y in zip(n, loss)])
  assert got["kind"] == "parabola" and got["params_opt"] == pytest.approx(3e8, rel=1e-6)
  assert got["loss_opt"] == pytest.approx(2.0, abs=1e-9) and got["curvature"] == pytest.approx(0.1)
  # Two seeds per size, offset +-0.05: averaged first, the same parabola.
  seeded = [{"flops": 1e19, "params": x, "loss": y + s, "seed": i}
            for x, y in zip(n, loss) for i, s in enumerate([-.05, .05])]
  assert fit.isoflop_minimum(seeded)["params_opt"] == pytest.approx(3e8, rel=1e-6)
  # Two sizes: the best mean, not the best single run (1.0 is a lucky seed of a size averaging 2.0).
  two = [{"flops": 1e19, "params": 1e8, "loss": 1.0, "seed": 0}, {"flops": 1e19, "params": 1e8, "loss": 3.0, "seed": 1},
         {"flops": 1e19, "params": 2e8, "loss": 1.8, "seed": 0}, {"flops": 1e19, "params": 2e8, "loss": 1.8, "seed": 1}]
  got = fit.isoflop_minimum(two)
  assert got["kind"] == "best_point" and got["params_opt"] == 2e8 and got["loss_opt"] == 1.8
  # A parabola opening downward, or with its vertex beyond the sampled sizes: the best point.
  for bad in (2.5 - 0.1 * np.log(n / 3e8) ** 2, 2.0 + 0.1 * np.log(n / 3e9) ** 2):
    got = fit.isoflop_minimum([{"flops": 1e19, "params": x, "loss": y} for x, y in zip(n, bad)])
    assert got["kind"] == "best_point" and got["loss_opt"] == bad.min()


def test_frontier_inverse_and_fit():
  params = {"E": 1.7, "A": 0.9, "alpha": 0.15, "c0": 1e19}
  c = np.geomspace(1e17, 1e23, 13)
  assert fit.frontier_compute(params, fit.frontier_loss(params, c)) == pytest.approx(c, rel=1e-9)
  assert fit.frontier_compute(params, 1.7) == math.inf and fit.frontier_compute(params, 1.5) == math.inf
  assert fit.frontier_compute(params, 2.6) == pytest.approx(1e19)
  got = fit.fit_frontier(BUDGETS, fit.frontier_loss(params, BUDGETS), c0=1e19)
  assert got["fixed"] == [] and got["E"] == pytest.approx(1.7, abs=1e-4)
  assert got["alpha"] == pytest.approx(0.15, rel=1e-3) and got["A"] == pytest.approx(0.9, rel=1e-3)
  two = fit.fit_frontier(BUDGETS[:2], [3.0, 2.8])
  assert two["fixed"] == ["E"] and two["E"] == 0
  assert fit.frontier_loss(two, BUDGETS[:2]) == pytest.approx([3.0, 2.8])
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
  }
  for i, (text, message) in enumerate(bad.items()):
    path = tmp_path / f"bad{i}.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
      fit.read_points(str(path))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_thousand_points_with_bootstrap_under_30s(tmp_path):
  rng = np.random.default_rng(2)
  points = ladder("baseline", 1.0, rng, sizes=10, seeds=10) + ladder("ncp", 1.3, rng, sizes=10, seeds=10)
  assert len(points) == 1000
  start = time.perf_counter()
  result = fit.fit_ladder(points, n_boot=100, notes={"convention": "C = 6ND"})
  elapsed = time.perf_counter() - start
  assert elapsed < 30, f"fit_ladder of 1,000 points took {elapsed:.1f}s"
  assert result["n_boot"] == 100 and result["convention"] == "C = 6ND" and result["methods"]["ncp"]["parametric"]
  json_path, md_path = fit.write_fit(result, str(tmp_path / "out"))
  assert json.load(open(json_path)) == result
  report = open(md_path).read()
  assert "| ncp | 1e+18 |" in report and "| baseline |" in report and "multiplier" in fit.table(result)


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
  paths = plot_ladder(points, fit.fit_ladder(points, n_boot=5), str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["isoflop.png", "frontier.png"]
  for path in paths:
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000
