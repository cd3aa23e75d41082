"""The experiment scripts: a smoke run (--steps N) trains and writes under ROOT/smokeN, never into
experiments/results, where the committed results are."""
import ast
import hashlib
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT

EXPERIMENTS = pathlib.Path(ROOT) / "experiments"
SCRIPTS = sorted(p for p in EXPERIMENTS.glob("*.py") if "write_results(" in p.read_text() and p.name != "common.py")


def test_every_script_writes_where_results_dir_says():
  """Each script's write_results call passes out=results_dir(args) (parsed, not imported)."""
  assert len(SCRIPTS) >= 6
  for script in SCRIPTS:
    calls = [n for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "write_results"]
    assert calls, script
    for call in calls:
      out = [k.value for k in call.keywords if k.arg == "out"]
      assert out and ast.unparse(out[0]) == "results_dir(args)", f"{script.name}: write_results without out=results_dir(args)"


def test_a_smoke_run_is_kept_apart(tmp_path):
  sys.path.insert(0, str(EXPERIMENTS))
  try:
    from common import RESULTS, arguments, results_dir
  finally:
    sys.path.pop(0)
  real = arguments("doc").parse_args(["--root", str(tmp_path)])
  smoke = arguments("doc").parse_args(["--root", str(tmp_path), "--steps", "4"])
  assert results_dir(real) == RESULTS and real.root == str(tmp_path)
  assert smoke.root == str(tmp_path / "smoke4") and results_dir(smoke) == str(tmp_path / "smoke4" / "results")


@pytest.mark.slow
def test_a_smoke_run_leaves_the_committed_results_alone(tmp_path):
  """experiments/aux.py --steps 2 (as a new user tried it): experiments/results/aux.* unchanged."""
  digest = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (EXPERIMENTS / "results").glob("aux*")}
  before = digest()
  out = subprocess.run([sys.executable, str(EXPERIMENTS / "aux.py"), "--steps", "2", "--seeds", "0", "--root",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert digest() == before
  assert (tmp_path / "smoke2" / "results" / "aux.md").exists()
