"""What a run shows a person: with output to a file, a plain line per log step with the method's own
terms, codebook health and the last validation loss; and train.profile_steps writes a trace and
prints its longest operations."""
import glob
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_OVERRIDES

NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")


@pytest.mark.slow
def test_a_conceptlm_run_to_a_file_prints_plain_lines_and_a_profile(tmp_path):
  workdir = str(tmp_path / "run")
  argv = [sys.executable, "-m", "latent_jax.train", "--config", NCP, *[f"--config.{o}" for o in TINY_OVERRIDES],
          "--config.train.log_every=2", "--config.train.profile_steps=(1,2)", "--workdir", workdir]
  out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
  assert [line.split(":")[0] for line in lines] == ["step 2/6", "step 3/6", "step 4/6", "step 6/6"]  # + eval at 3
  assert "\r" not in out.stdout + out.stderr  # no progress bar: its carriage returns make one long line in a file
  for term in ("loss ", "ncp ", "vq ", "codes used ", "dead ", "tok/s ", "mfu "):
    assert term in lines[0], (term, lines[0])
  assert "val " not in lines[0] and "val " in lines[1]  # the last validation loss, from step 3 on (eval_every=3)
  for trace in ("*.xplane.pb", "perfetto_trace.json.gz"):  # XProf / TensorBoard's, and Perfetto's
    assert glob.glob(os.path.join(workdir, "profile", "**", trace), recursive=True), trace
  report = out.stdout[out.stdout.index("profile of steps 2..3"):].splitlines()[1:4]
  assert all(line.strip().split()[1] == "ms" and float(line.split()[0]) > 0 for line in report), report
