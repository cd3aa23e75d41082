"""`python -m latent_jax.plan`: the per-device memory of the real train step on fake CPU devices,
checked against sizes derived here from the model's parameter shapes; the fits / exit-code rule;
Cloud TPU names; bad input. (TPU compiles need libtpu and run in plan runs and benchmarks only.)"""
import importlib.util
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from test_cli_errors import check_one_error_line, run_main

FSDP4 = ["--config.mesh.data=1", "--config.mesh.fsdp=-1"]


def run_plan(*flags):
  """The CLI in a fresh process (cpu:N sets the device count before jax starts) -> (exit code, JSON, output)."""
  argv = [sys.executable, "-m", "latent_jax.plan", "--config", TINY, *[f"--config.{o}" for o in TINY_OVERRIDES], *flags]
  result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
  lines = result.stdout.strip().splitlines()
  return result.returncode, json.loads(lines[-1]) if lines else None, result.stdout + result.stderr


def expected_per_device(cfg, fsdp):
  """Bytes per device when fsdp splits every weight (here all their model dimensions divide by
  fsdp) and norm scales replicate: README, "NamedSharding over a (data, fsdp, tensor) mesh"."""
  from flax import nnx

  from latent_jax.nn import build_model
  params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))))
  size = lambda x: math.prod(x.shape) * np.dtype(x.dtype).itemsize
  return sum(size(x) if path[-1].key == "scale" else size(x) // fsdp
             for path, x in jax.tree_util.tree_flatten_with_path(params)[0])


def test_plan_on_four_cpu_devices_matches_the_model(tiny_cfg):
  code, out, log = run_plan("--topology", "cpu:4", *FSDP4)
  assert code == 0, log
  assert {"topology", "devices", "peak_gib", "hbm_gib", "fits", "phases"} <= out.keys()
  assert out["topology"] == "cpu:4" and out["devices"] == 4 and out["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
  assert out["fits"] and 0 < out["peak_gib"] <= out["hbm_gib"]
  [phase] = out["phases"]
  assert phase["params_bytes"] == expected_per_device(tiny_cfg, 4)
  # AdamW: two float32 moments per (float32) parameter, sharded like it, plus a few scalar counts.
  assert 2 * phase["params_bytes"] <= phase["opt_state_bytes"] < 2 * phase["params_bytes"] + 256
  features, rows, length = 4, tiny_cfg.data.batch_size, tiny_cfg.data.seq_len
  assert phase["batch_bytes"] == features * rows * length * 4 // 4
  held = phase["params_bytes"] + phase["opt_state_bytes"] + phase["batch_bytes"]
  assert phase["peak_bytes"] >= held + phase["temp_bytes"] and phase["temp_bytes"] > 0
  assert out["peak_gib"] == phase["peak_bytes"] / 2**30
  assert phase["flops"] > 0 and phase["model_flops"] > 0
  # The steps that read the model, on the training's layout: its parameters as split for training;
  # the eval step's batch is the train batch's; the generation step's KV cache (keys, values and
  # their positions for every layer, row and slot) splits over the 4 batch shards.
  evaluation, generation = out["eval"], out["generate"]
  assert evaluation["params_bytes"] == generation["params_bytes"] == phase["params_bytes"]
  assert evaluation["batch_bytes"] == phase["batch_bytes"]
  m = tiny_cfg.model
  kv = 2 * m.num_kv_heads * m.head_dim * np.dtype(m.dtype).itemsize + 4
  assert generation["cache_bytes"] == m.num_layers * rows * length * kv // 4
  for step in (evaluation, generation):
    assert step["compiled"] and step["temp_bytes"] > 0
    assert step["peak_bytes"] >= step["params_bytes"] + step["temp_bytes"]
  assert "eval step" in log and "generation step" in log and "the peak above decides the fit" in log
  code, out, log = run_plan("--topology", "cpu:4", *FSDP4, "--noreading")  # the train step alone
  assert code == 0 and "eval" not in out and "eval step" not in log and out["phases"][0]["compiled"], log


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_peak_is_the_sum_of_its_parts_and_grows_with_the_model(tiny_cfg):
  """For two widths: the reported peak is the step's held bytes (params, optimiser state, batch)
  plus its temporaries, with only the step's small outputs and code besides; every part grows."""
  phases = []
  for d in (32, 64):
    code, out, log = run_plan("--topology", "cpu:4", *FSDP4, f"--config.model.d_model={d}")
    assert code == 0, log
    [phase] = out["phases"]
    tiny_cfg.model.d_model = d
    assert phase["params_bytes"] == expected_per_device(tiny_cfg, 4)
    held = phase["params_bytes"] + phase["opt_state_bytes"] + phase["batch_bytes"]
    extra = phase["peak_bytes"] - held - phase["temp_bytes"]
    assert 0 <= extra <= 2**20, extra  # the metrics' scalars and the generated code
    phases.append(phase)
  small, big = phases
  assert big["params_bytes"] > 1.5 * small["params_bytes"] and big["opt_state_bytes"] > 1.5 * small["opt_state_bytes"]
  assert big["batch_bytes"] == small["batch_bytes"] and big["temp_bytes"] > small["temp_bytes"]
  assert big["peak_bytes"] > small["peak_bytes"]


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_plan_of_two_slices_doubles_the_data_axis_and_reports_dcn_bytes():
  """--slices 2 of cpu:2 (fake slices: runs of CPU devices): the per-slice mesh twice along data,
  and the estimated bytes a device sends over DCN, a ring all-reduce of its gradient shard."""
  code, out, log = run_plan("--topology", "cpu:2", "--slices", "2", *FSDP4)
  assert code == 0, log
  assert out["slices"] == 2 and out["devices"] == 4 and out["mesh"] == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 1}
  [phase] = out["phases"]
  assert phase["dcn_bytes"] == phase["params_bytes"]  # 2 (S - 1) / S = 1 at S = 2
  assert "sent over DCN" in log


def test_plan_exits_1_when_the_step_does_not_fit():
  code, out, log = run_plan("--topology", "cpu:4", *FSDP4, "--hbm_gib=0.0001")
  assert code == 1, log
  assert not out["fits"] and out["hbm_gib"] == 0.0001 and out["peak_gib"] > 0.0001
  assert "does NOT fit" in log


def test_a_mesh_that_does_not_divide_the_topology_stops_before_compiling():
  code, out, log = run_plan("--topology", "cpu:4", "--config.mesh.data=1", "--config.mesh.fsdp=3")
  check_one_error_line(code, log, ["mesh", "4 devices"])


@pytest.mark.parametrize("name,grid", [
    # Cloud TPU's published slice shapes: v4 and v5p names count TensorCores (two per chip).
    ("v5p-8", "2x2x1"), ("v5p-16", "2x2x2"), ("v5p-32", "2x2x4"), ("v5p-128", "4x4x4"), ("v5p-256", "4x4x8"),
    ("v5p-1024", "8x8x8"), ("v4-64", "2x4x4"), ("v4-128", "4x4x4"), ("v5e-8", "2x4"), ("v5e-16", "4x4"),
    ("v5e-128", "8x16"), ("v5e-256", "16x16"), ("v6e-64", "8x8"), ("v5p:4x4x12", "4x4x12")])
def test_cloud_tpu_names(name, grid):
  from latent_jax.plan import tpu_topology
  assert tpu_topology(name) == (name.split("-")[0].split(":")[0], grid)


@pytest.mark.parametrize("topology,names", [
    ("tpu-8", ["--topology tpu-8", "cpu:N", "v5p-128"]),
    ("v9z-8", ["--topology v9z-8", "v5p"]),
    ("v5p-12", ["--topology v5p-12", "v5p:4x4x4"]),
    ("v5e:4x4x4", ["--topology v5e:4x4x4", "2-D"]),
    ("cpu:0", ["--topology cpu:0"])])
def test_bad_topology(topology, names, capsys):
  code, err = run_main("latent_jax.plan", ["--config", TINY, "--topology", topology], capsys)
  check_one_error_line(code, err, names)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_tpu_names_without_libtpu_say_how_to_install_it(capsys):
  code, err = run_main("latent_jax.plan", ["--config", TINY, "--topology", "v5p-128"], capsys)
  check_one_error_line(code, err, ["--topology v5p-128", "libtpu", 'pip install -e ".[tpu]"'])


def test_help(capsys):
  from latent_jax import plan
  with pytest.raises(SystemExit) as exit_:
    plan.main(["--help"])
  assert exit_.value.code == 0 and "--topology" in capsys.readouterr().out


def test_an_interrupted_plan_says_so_in_one_line():
  """Ctrl-C while plan compiles: one error line and exit code 130, no traceback or stack dump."""
  import signal
  argv = [sys.executable, "-u", "-m", "latent_jax.plan", "--config", TINY, *[f"--config.{o}" for o in TINY_OVERRIDES],
          "--topology", "cpu:2"]
  child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  child.stdout.readline()  # the devices line: the compiles come next
  child.send_signal(signal.SIGINT)
  _, err = child.communicate(timeout=120)
  assert child.returncode == 130 and err.strip().splitlines()[-1].startswith("error: interrupted"), err
  assert "Traceback" not in err
