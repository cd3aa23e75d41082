"""The training loop end to end: resume after SIGKILL, SIGTERM saves, CLIs load runs (tests/test_workdir.py:
damage, the lock, resume checks, the NaN guard)."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import checkpoint
from latent_jax.infer import load


def cli(module, *args):
  return [sys.executable, "-m", module, *args]


def train_cmd(workdir, corpus, *extra):
  return cli("latent_jax.train", "--config", TINY, "--workdir", str(workdir),
             *[f"--config.{o}" for o in TINY_OVERRIDES], f"--config.data.source={corpus}", *extra)


def final_params(workdir):
  cfg, step = checkpoint.load_config(str(workdir))
  return step, jax.tree.leaves(load.load_params(str(workdir), cfg, step)[1])


def wait_for_step(workdir, proc, step, checkpoint=None, timeout=300):
  """Wait until `step` is logged (and checkpoint `checkpoint` is committed, if given)."""
  path = os.path.join(workdir, "metrics.jsonl")
  start = time.time()
  while time.time() - start < timeout:
    if proc.poll() is not None:
      raise AssertionError(f"training exited early: {proc.stdout.read()}")
    if checkpoint and not os.path.isdir(os.path.join(workdir, "checkpoints", str(checkpoint))):
      pass
    elif os.path.exists(path):
      with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
      if rows and rows[-1]["step"] >= step:
        return rows[-1]["step"]
    time.sleep(0.05)
  raise AssertionError("timed out waiting for training")


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, corpus_dir):
  steps = ["--config.train.steps=8", "--config.train.checkpoint_every=3"]
  straight = tmp_path / "straight"
  subprocess.run(train_cmd(straight, corpus_dir, *steps), check=True, cwd=ROOT, capture_output=True)

  killed = tmp_path / "killed"
  proc = subprocess.Popen(train_cmd(killed, corpus_dir, *steps), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  wait_for_step(str(killed), proc, 5, checkpoint=3)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  tokenizer = killed / "tokenizer.model"
  stamp = (tokenizer.stat().st_mtime_ns, tokenizer.read_bytes())
  out = subprocess.run(train_cmd(killed, corpus_dir, *steps), cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "resumed from" in out.stdout
  assert (tokenizer.stat().st_mtime_ns, tokenizer.read_bytes()) == stamp  # reused, not retrained

  (step_a, a), (step_b, b) = final_params(straight), final_params(killed)
  assert step_a == step_b == 8
  for x, y in zip(a, b):  # bitwise: same program, same batches, deterministic CPU kernels
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = [json.loads(line) for line in open(killed / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, 9))  # rows after the restored step were replaced


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_sigterm_saves_and_exits_cleanly(tmp_path, corpus_dir):
  proc = subprocess.Popen(train_cmd(tmp_path, corpus_dir, "--config.train.steps=100000",
                                    "--config.train.checkpoint_every=1000"),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  wait_for_step(str(tmp_path), proc, 2)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out
  cfg, step = checkpoint.load_config(str(tmp_path))
  assert 2 <= step < 100000 and f"stopped at step {step}" in out


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_generate_eval_export_cli(tmp_path, corpus_dir):
  run = tmp_path / "run"
  subprocess.run(train_cmd(run, corpus_dir), check=True, cwd=ROOT, capture_output=True)
  logged = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert {"step", "loss", "val_loss", "val_bpb", "tokens_per_s", "mfu"} <= set(logged[-1])

  ev = subprocess.run(cli("latent_jax.eval", "--workdir", str(run)), cwd=ROOT, capture_output=True, text=True)
  assert ev.returncode == 0, ev.stderr
  result = json.loads(ev.stdout.strip().splitlines()[-1])
  assert result["step"] == 6 and 0 < result["val_loss"] < 10 and result["val_bpb"] > 0
  # By default eval scores what the training's validation scored (train.eval_batches=2): same numbers.
  assert (result["batches"], result["val_loss"], result["val_bpb"]) == (2, logged[-1]["val_loss"], logged[-1]["val_bpb"])
  whole = subprocess.run(cli("latent_jax.eval", "--workdir", str(run), "--batches=0"), cwd=ROOT, capture_output=True,
                         text=True)
  whole = json.loads(whole.stdout.strip().splitlines()[-1])
  assert whole["batches"] == whole["split_batches"] > 2 and whole["tokens"] > result["tokens"]

  out = tmp_path / "export"
  subprocess.run(cli("latent_jax.export", "--workdir", str(run), "--out", str(out)), check=True, cwd=ROOT)
  assert sorted(os.listdir(out)) == ["config.json", "export.json", "params", "tokenizer.model"]
  ev2 = subprocess.run(cli("latent_jax.eval", "--workdir", str(out)), cwd=ROOT, capture_output=True, text=True)
  result2 = json.loads(ev2.stdout.strip().splitlines()[-1])
  assert result2["val_loss"] == pytest.approx(result["val_loss"], rel=1e-6)
  assert result2["step"] == 6 and result2["source"] == f"export of {run} at step 6"  # not "step": null

  texts = []
  for directory in (run, out):
    gen = subprocess.run(cli("latent_jax.generate", "--workdir", str(directory), "--prompt", "Kar lon",
                             "--temperature=0", "--max_new_tokens=12"), cwd=ROOT, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    texts.append(gen.stdout)
  assert texts[0] == texts[1] and texts[0].startswith("Kar lon")
