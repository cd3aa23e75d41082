"""experiments/moe.py's summaries of logged rows, against NumPy computed from the same synthetic rows."""
import os
import sys

import numpy as np

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import moe  # noqa: E402


def rows(seed, layers=3, steps=(10, 20, 30)):
  """Metrics rows as train writes them: per-layer load and entropy at log steps, val_loss at some."""
  rng = np.random.default_rng(seed)
  out = []
  for step in steps:
    r = {"step": step, **{f"moe_load_max/{i}": float(rng.uniform(1, 4)) for i in range(layers)},
         **{f"router_entropy/{i}": float(rng.uniform(0.5, 2)) for i in range(layers)}}
    if step != steps[1]:
      r["val_loss"] = float(rng.uniform(3, 5))
    out.append(r)
  return out


def test_paired_difference_is_the_mean_and_standard_error_of_per_seed_differences():
  a, b = {s: rows(s) for s in (0, 1, 2)}, {s: rows(10 + s) for s in (0, 1, 3)}  # seed 2 and 3 unpaired
  d = np.array([a[s][-1]["val_loss"] - b[s][-1]["val_loss"] for s in (0, 1)])
  mean, se = moe.paired(a, b)
  np.testing.assert_allclose([mean, se], [d.mean(), d.std(ddof=1) / np.sqrt(2)], rtol=1e-12)


def test_load_summary_takes_the_busiest_layer_at_the_first_and_last_log_and_the_mean_entropy():
  by_seed = {s: rows(s) for s in (0, 1)}
  load = lambda r: max(v for k, v in r.items() if k.startswith("moe_load_max/"))
  entropy = lambda r: np.mean([v for k, v in r.items() if k.startswith("router_entropy/")])
  first = np.mean([load(r[0]) for r in by_seed.values()])
  last = np.mean([load(r[-1]) for r in by_seed.values()])
  assert moe.load_summary(by_seed) == (f"{first:.2f} -> {last:.2f}",
                                       f"{np.mean([entropy(r[-1]) for r in by_seed.values()]):.3f}")
  assert moe.layer_loads(by_seed[0])[20] == [by_seed[0][1][f"moe_load_max/{i}"] for i in range(3)]


def test_a_dense_run_has_no_load_summary():
  assert moe.load_summary({0: [{"step": 10, "val_loss": 4.0}]}) == ("", "")
