"""Several hosts, on localhost: real processes joined by jax.distributed (gloo on CPU), started
through the CLIs with --coordinator_address / --num_processes / --process_id, against a single
process holding the same number of (fake CPU) devices."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import checkpoint

STEPS = 8
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "train.checkpoint_every=4", "train.eval_every=4", "mesh.data=1",
       "mesh.fsdp=4", "train.peak_flops=1e12"]  # one peak for every run, so that their MFUs compare


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(module, processes, devices, *args):
  """Start `python -m module args` as `processes` processes of one job, each with `devices` CPU devices."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  cmd = [sys.executable, "-m", module, *args]
  if processes > 1:
    cmd += [f"--coordinator_address=127.0.0.1:{free_port()}", f"--num_processes={processes}"]
  return [subprocess.Popen(cmd + ([f"--process_id={i}"] if processes > 1 else []), cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(processes)]


def finish(procs, timeout=600):
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out
  return outs


def train(workdir, corpus, processes, devices=None, config=TINY, extra=()):
  overrides = [f"--config.{o}" for o in [*RUN, f"data.source={corpus}", *extra]]
  return launch("latent_jax.train", processes, devices or 4 // processes, "--config", config, *overrides,
                "--workdir", str(workdir))


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def final_params(workdir):
  cfg, step = checkpoint.load_config(str(workdir))
  return step, jax.tree.leaves(checkpoint.saved_params(str(workdir), cfg, step))


def assert_same_params(a, b):
  (step_a, a), (step_b, b) = final_params(a), final_params(b)
  assert step_a == step_b == STEPS
  for x, y in zip(a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=2e-6)


def drop_last_checkpoint(src, dst):
  """A copy of the run in `src` as it stood at step STEPS / 2."""
  shutil.copytree(src, dst)
  shutil.rmtree(os.path.join(dst, "checkpoints", str(STEPS)))


def prepare(corpus, out, processes):
  return launch("latent_jax.prepare", processes, 1, "--config", TINY, "--config.model.vocab_size=320",
                f"--config.data.source={corpus}", "--out", str(out), "--workers=1")


@pytest.fixture(scope="module")
def corpus_store(tmp_path_factory, corpus_dir):
  """conftest's corpus as a token store, prepared in this process: several processes train from a
  store, never from text (which each would tokenise whole)."""
  from latent_jax import load_config
  from latent_jax import prepare as prepare_lib
  out = tmp_path_factory.mktemp("corpus_store") / "store"
  cfg = load_config(TINY, ["model.vocab_size=320", f"data.source={corpus_dir}"])
  prepare_lib.prepare(cfg, str(out), workers=1, log=lambda *a: None)
  return str(out)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_two_processes_prepare_then_train_resume_across_process_counts_and_export(tmp_path, corpus_dir):
  # Both processes run prepare: process 0 writes the store, process 1 waits for it, then sees it.
  store = tmp_path / "store"
  outs = finish(prepare(corpus_dir, store, 2))
  assert f"{store}: " in outs[0] and f"process 1: {store} holds the finished store of process 0" in outs[1]
  procs = prepare(corpus_dir, store, 2)  # an error on process 0 (a finished store) stops both, with its message
  for p in procs:
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 2 and f"error: --out {store} is a finished token store" in out, out

  # Training from the store: each host reads its own rows; 2 processes match 1.
  one, two = tmp_path / "one", tmp_path / "two"
  outs = finish(train(one, store, 1) + train(two, store, 2))
  assert "process 0 of 1: 4 local / 4 global cpu devices; mesh data=1 fsdp=4 expert=1 tensor=1" in outs[0]
  assert "process 1 of 2: 2 local / 4 global cpu devices; mesh data=1 fsdp=4 expert=1 tensor=1" in outs[2]
  assert "params" not in outs[2]  # process 1 prints no header, summary or progress
  a, b = rows(one), rows(two)
  assert_same_metrics(a, b, tol=1e-5)  # each row once; every figure global (val_bpb: 5.057 vs 2.558 once)
  assert_same_params(one, two)

  # Resume from step 4 with another process count: a 2-process checkpoint on 1, a 1-process one on 2
  # (whose lost tokenizer file comes back from the checkpoint, every process reading, process 0 writing).
  for src, processes, name in ((two, 1, "two_then_one"), (one, 2, "one_then_two")):
    drop_last_checkpoint(src, tmp_path / name)
    if processes == 2:
      os.remove(tmp_path / name / "tokenizer.model")
    out = finish(train(tmp_path / name, store, processes))[0]
    assert f"resumed from {tmp_path / name / 'checkpoints' / '4'}" in out
    if processes == 2:
      assert f"warning: {tmp_path / name / 'tokenizer.model'} is missing; restored it from" in out
      assert (tmp_path / name / "tokenizer.model").read_bytes() == (store / "tokenizer.model").read_bytes()
    assert_same_params(one, tmp_path / name)

  # Evaluate a 2-process fsdp checkpoint on one CPU device and on 4 (data-parallel there), then
  # export it, evaluate and sample the export on one.
  for devices in (1, 4):
    ev = finish(launch("latent_jax.eval", 1, devices, "--workdir", str(two)))[0]
    assert abs(json.loads(ev.strip().splitlines()[-1])["val_loss"] - b[-1]["val_loss"]) <= 1e-5
  out = tmp_path / "export"
  finish(launch("latent_jax.export", 1, 1, "--workdir", str(two), "--out", str(out)))
  ev = finish(launch("latent_jax.eval", 1, 1, "--workdir", str(out)))[0]
  assert abs(json.loads(ev.strip().splitlines()[-1])["val_loss"] - b[-1]["val_loss"]) <= 1e-5
  finish(launch("latent_jax.generate", 1, 1, "--workdir", str(out), "--max_new_tokens=4", "--temperature=0"))


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_sigterm_to_one_host_stops_every_host_at_one_saved_step(tmp_path, corpus_store):
  steps = ["train.steps=100", "train.checkpoint_every=1000", "train.eval_every=0"]
  reference = train(tmp_path / "reference", corpus_store, 1, extra=steps)
  procs = train(tmp_path / "run", corpus_store, 2, extra=steps)
  metrics = tmp_path / "run" / "metrics.jsonl"
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
    assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)
  outs = finish(procs)
  saved = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints"))
  assert len(saved) == 1 and 0 < saved[0] < 100, (saved, outs[0])
  assert f"stopped at step {saved[0]}/100" in outs[0]
  finish(train(tmp_path / "run", corpus_store, 2, extra=steps))
  finish(reference)
  _, a = final_params(tmp_path / "reference")
  _, b = final_params(tmp_path / "run")
  for x, y in zip(a, b):  # 2 processes against 1 drift by ~3e-6 over 200 steps; a step's update is ~1e-3
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
@pytest.mark.parametrize("config", ["tiny_ncp.py", "tiny_tst.py"])
def test_concept_lm_and_tst_phase_switch_on_two_processes(tmp_path, corpus_store, config):
  """ConceptLM, and TST across its phase switch, train on 2 processes as on 1."""
  extra = ["tst.r=0.5"] if "tst" in config else []
  config = os.path.join(ROOT, "configs", config)
  finish(train(tmp_path / "one", corpus_store, 1, config=config, extra=extra)
         + train(tmp_path / "two", corpus_store, 2, config=config, extra=extra))
  a, b = rows(tmp_path / "one"), rows(tmp_path / "two")
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
  for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(1.0, abs(x["loss"])), (x, y)
  if "tst" in config:
    assert {r.get("phase") for r in b} == {1, 2}


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_distributed_flags_that_disagree_are_clear_errors(tmp_path):
  base = [sys.executable, "-m", "latent_jax.train", "--config", TINY, "--workdir", str(tmp_path / "w")]
  slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0"}
  cases = [(["--num_processes=2", "--process_id=2"], {}, "--process_id=2 is not below --num_processes=2"),
           (["--num_processes=0"], {}, "--num_processes=0: must be >= 1"),
           ([], {"JAX_NUM_PROCESSES": "two"}, "$JAX_NUM_PROCESSES='two' is not an integer"),
           (["--num_processes=4"], slurm, "--num_processes=4 but SLURM (srun) runs 2 processes")]
  for args, env, message in cases:
    out = subprocess.run(base + args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
  assert not (tmp_path / "w").exists()


def assert_same_metrics(a, b, tol=1e-6):
  """Every key of every metrics.jsonl row agrees between two runs on the same global batches:
  the figures of the batch (losses, val_bpb, tokens, FLOPs, lr, grad_norm) to `tol`, and the
  timing figures through what does not depend on the wall clock: mfu / tokens_per_s is the step's
  FLOPs per token over the peak (fixed by train.peak_flops), for any number of hosts."""
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
  for x, y in zip(a, b):
    assert x.keys() == y.keys(), (x, y)
    for key in x.keys() - {"tokens_per_s", "mfu"}:
      assert abs(x[key] - y[key]) <= tol * max(1.0, abs(x[key])), (key, x, y)
    assert x["mfu"] / x["tokens_per_s"] == pytest.approx(y["mfu"] / y["tokens_per_s"], rel=1e-9)


@pytest.mark.slow  # 4 and 2 training processes on 2 cores
@pytest.mark.parametrize("mesh,processes,devices", [
    (("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2"), 2, 2),   # tensor across processes: both read every row
    (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1"), 4, 4),   # data x fsdp over 4 processes: a quarter each
    (("mesh.slices=2", "mesh.data=1", "mesh.fsdp=2"), 2, 4)])  # 2 processes standing in for 2 slices
def test_every_process_feeds_its_devices_rows_for_any_mesh(tmp_path, corpus_store, mesh, processes, devices):
  """Each mesh, spread over several processes, trains exactly as 1 process holding all the devices;
  every logged figure, val_bpb included, is the same."""
  one, many = tmp_path / "one", tmp_path / "many"
  outs = finish(train(one, corpus_store, 1, devices, extra=mesh)
                + train(many, corpus_store, processes, devices // processes, extra=mesh))
  assert f"process 0 of {processes}: {devices // processes} local / {devices} global cpu devices" in outs[1]
  assert_same_metrics(rows(one), rows(many))
  assert_same_params(one, many)
