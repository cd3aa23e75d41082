"""colab/ notebooks: every code cell compiles; the slow test runs each notebook end to end."""
import glob
import json
import os

import pytest

from conftest import ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))


def code_cells(path):
  with open(path) as f:
    book = json.load(f)
  return ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks_and_their_cells_compile():
  assert {os.path.basename(p) for p in NOTEBOOKS} >= {"quickstart.ipynb", "ncp.ipynb", "tst.ipynb"}
  for path in NOTEBOOKS:
    for i, source in enumerate(code_cells(path)):
      compile(source, f"{path}[cell {i}]", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  """Run the notebook's cells in order, as Jupyter would, with a few training steps."""
  import matplotlib
  matplotlib.use("Agg")
  monkeypatch.setenv("LATENT_JAX_NOTEBOOK_STEPS", "4")
  monkeypatch.setenv("LATENT_JAX_NOTEBOOK_WORKDIR", str(tmp_path))
  monkeypatch.chdir(os.path.join(ROOT, "colab"))
  namespace = {"__name__": "__main__"}
  for i, source in enumerate(code_cells(path)):
    exec(compile(source, f"{path}[cell {i}]", "exec"), namespace)
