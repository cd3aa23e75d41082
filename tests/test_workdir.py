"""A workdir nothing can damage, through the train CLI: damaged checkpoints fall back to the one
before (same final params as an undamaged run), one training per workdir, resume checks against
the saved config, no non-finite state ever saved, readers that never disturb a training."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from test_train import cli, final_params, wait_for_step

KEEP = ["--config.train.keep_checkpoints=3"]  # checkpoints 2, 4 and 6 of the 6-step tiny run


def train_cmd(workdir, corpus, *extra):
  return cli("latent_jax.train", "--config", TINY, "--workdir", str(workdir),
             *[f"--config.{o}" for o in TINY_OVERRIDES], f"--config.data.source={corpus}", *KEEP, *extra)


def run_train(workdir, corpus, *extra):
  return subprocess.run(train_cmd(workdir, corpus, *extra), cwd=ROOT, capture_output=True, text=True)


def error_line(out):
  """The one `error:` line a failed command prints last on stderr (the progress bar may come before it)."""
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert out.returncode == 2 and "Traceback" not in out.stderr and len(errors) == 1, out.stderr
  assert out.stderr.strip().splitlines()[-1] == errors[0], out.stderr
  return errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_dir):
  """A finished 6-step run with checkpoints 2, 4, 6, and its final params."""
  run = tmp_path_factory.mktemp("finished") / "run"
  out = run_train(run, corpus_dir)
  assert out.returncode == 0, out.stdout + out.stderr
  return run, final_params(run)[1]


def truncate_largest(folder):
  files = [os.path.join(r, n) for r, _, names in os.walk(folder) for n in names]
  path = max(files, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def empty_folder(folder):
  for name in os.listdir(folder):
    p = os.path.join(folder, name)
    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def tear_metrics_and_drop_last(ckpt):
  """A kill in mid-write of metrics.jsonl, before checkpoint 6 was saved."""
  shutil.rmtree(ckpt)
  path = os.path.join(os.path.dirname(os.path.dirname(ckpt)), "metrics.jsonl")
  text = open(path).read()
  with open(path, "w") as f:
    f.write(text[:-len(text.splitlines()[-1]) // 2 - 1])


DAMAGE = {
    "truncated params": lambda c: truncate_largest(os.path.join(c, "params")),
    "deleted params": lambda c: shutil.rmtree(os.path.join(c, "params")),
    "truncated opt_state": lambda c: truncate_largest(os.path.join(c, "opt_state")),
    "deleted opt_state": lambda c: shutil.rmtree(os.path.join(c, "opt_state")),
    "garbage metadata": lambda c: open(os.path.join(c, "meta", "metadata"), "wb").write(b"\x00garbage{"),
    "emptied folder": empty_folder,
    "torn metrics line": tear_metrics_and_drop_last,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_checkpoint_falls_back(tmp_path, corpus_dir, finished_run, damage):
  source, want = finished_run
  run = tmp_path / "run"
  shutil.copytree(source, run)
  DAMAGE[damage](str(run / "checkpoints" / "6"))
  out = run_train(run, corpus_dir)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "resumed from" in out.stdout and out.stdout.rstrip().splitlines()[-1].startswith("done at step 6/6")
  if damage != "torn metrics line":
    assert f"checkpoint {run}/checkpoints/6 is unreadable" in out.stdout
    assert os.path.isdir(run / "damaged" / "checkpoints-6")  # moved aside, never deleted, with the reason
    assert (run / "damaged" / "checkpoints-6.txt").read_text().startswith(f"{run}/checkpoints/6 was unreadable: ")
  else:
    assert "not a whole JSON row" in out.stdout
  rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, 7))
  step, got = final_params(run)
  assert step == 6
  for x, y in zip(want, got):  # bitwise: the same steps 5 and 6 from the same checkpoint 4
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lost_or_damaged_tokenizer_is_restored_from_the_newest_checkpoint(tmp_path, corpus_dir, finished_run, capsys):
  """Every checkpoint holds the run's tokenizer file: train puts a damaged one back (moving it aside),
  and a reader (export) a deleted one, each with a warning; the export carries it."""
  from latent_jax.export import export
  run = tmp_path / "run"
  shutil.copytree(finished_run[0], run)
  path = run / "tokenizer.model"
  original = path.read_bytes()
  path.write_bytes(original[:100])
  out = run_train(run, corpus_dir)
  assert out.returncode == 0, out.stdout + out.stderr
  assert f"warning: {path} is damaged or another tokenizer" in out.stdout, out.stdout
  assert f"restored it from {run}/checkpoints/6" in out.stdout and f"{run} is complete: step 6" in out.stdout
  assert path.read_bytes() == original
  assert (run / "damaged" / "run-tokenizer.model").read_bytes() == original[:100]  # moved aside, never deleted
  path.unlink()
  export(str(run), str(tmp_path / "export"))
  assert f"warning: {path} is missing; restored it from {run}/checkpoints/6" in capsys.readouterr().out
  assert path.read_bytes() == original and (tmp_path / "export" / "tokenizer.model").read_bytes() == original


def test_checkpoints_saved_without_the_tokenizer_still_restore(tmp_path, corpus_dir, finished_run):
  """Checkpoints from before the tokenizer item: evaluated as before; a damaged tokenizer file is then
  a clear error, since nothing holds a copy."""
  from latent_jax.eval import evaluate_dir
  run = tmp_path / "run"
  shutil.copytree(finished_run[0], run)
  for step in ("2", "4", "6"):
    shutil.rmtree(run / "checkpoints" / step / "tokenizer")
    meta = run / "checkpoints" / step / "meta" / "metadata"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "tokenizer"}))
  want = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]["val_loss"]
  assert evaluate_dir(str(run))["val_loss"] == pytest.approx(want, abs=1e-5)
  path = run / "tokenizer.model"
  path.write_bytes(path.read_bytes()[:100])
  message = error_line(run_train(run, corpus_dir))
  assert str(path) in message and "damaged" in message


def test_finished_run_says_complete(corpus_dir, finished_run):
  out = run_train(finished_run[0], corpus_dir)
  assert out.returncode == 0, out.stderr
  assert f"{finished_run[0]} is complete: step 6" in out.stdout and "compiled" not in out.stdout


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_second_training_on_a_live_workdir_exits_naming_the_holder(tmp_path, corpus_dir):
  run = tmp_path / "run"
  first = subprocess.Popen(train_cmd(run, corpus_dir, "--config.train.steps=100000", "--config.train.checkpoint_every=1000"),
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_for_step(str(run), first, 1)
    start = time.time()
    second = run_train(run, corpus_dir)
    assert time.time() - start < 30
    line = error_line(second)
    assert f"pid {first.pid}" in line and "is in use by a live training" in line
  finally:
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
  assert first.returncode == 0
  assert not (run / "train.lock").exists()  # released at the end


def test_lock_left_by_a_dead_training_is_taken_over(tmp_path):
  from latent_jax.train.workdir import LOCK_FILENAME, WorkdirLock, WorkdirBusy
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  (tmp_path / LOCK_FILENAME).write_text(json.dumps({"host": "h", "pid": int(dead.stdout), "started": "then"}) + "\n")
  out = subprocess.run([sys.executable, "-c", "from latent_jax.train.workdir import WorkdirLock; "
                        f"WorkdirLock({str(tmp_path)!r}); print('held')"], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0 and "taking over" in out.stdout and f"pid {dead.stdout.strip()}" in out.stdout, out
  lock = WorkdirLock(str(tmp_path))  # the process above died holding it: taken over again
  with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}"):
    WorkdirLock(str(tmp_path))
  lock.release()
  assert not (tmp_path / LOCK_FILENAME).exists()


@pytest.mark.parametrize("override, words", [
    ("model.d_model=64", ["model.d_model: saved 32, now 64", "another model"]),
    ("model.vocab_size=512", ["model.vocab_size: saved 320, now 512"]),
    ("optim.name=muon", ["optim.name: saved 'adamw', now 'muon'"]),
    ("data.tokenizer=/x.model", ["data.tokenizer: saved '', now '/x.model'"]),
    ("data.batch_size=16", ["data.batch_size: saved 8, now 16", "--allow_data_change"]),
    ("data.seq_len=64", ["data.seq_len: saved 32, now 64", "--allow_data_change"]),
    ("data.source=kjv", ["data.source: saved", "now 'kjv'", "--allow_data_change"]),
    ("optim.clip_norm=0", ["another layout", "opt_state/1/0/count (): saved, not built here"]),  # another optax chain
])
def test_resume_refuses_another_model_tokenizer_optimiser_or_data(corpus_dir, finished_run, override, words):
  run = finished_run[0]
  before = sorted(os.listdir(run)), (run / "metrics.jsonl").read_text()
  out = run_train(run, corpus_dir, f"--config.{override}")
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  line = error_line(out)
  for w in words:
    assert w in line, line
  assert "compiled" not in out.stdout  # refused before anything compiles
  assert (sorted(os.listdir(run)), (run / "metrics.jsonl").read_text()) == before


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_resume_takes_changed_data_when_told_and_prints_other_changes(tmp_path, corpus_dir, finished_run):
  run = tmp_path / "run"
  shutil.copytree(finished_run[0], run)
  out = run_train(run, corpus_dir, "--config.train.steps=8", "--config.optim.lr=0.001",
                  "--config.data.batch_size=16", "--allow_data_change")
  assert out.returncode == 0, out.stdout + out.stderr
  for notice in ("train.steps: 6 -> 8", "optim.lr: 0.003 -> 0.001", "data.batch_size: 8 -> 16"):
    assert f"resuming with changed config: {notice}" in out.stdout
  assert "resumed from" in out.stdout and "done at step 8/8" in out.stdout


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_non_finite_state_is_never_saved(tmp_path, corpus_dir):
  """lr=1e39: the loss at step 1 is finite, the parameters after it are not; nothing non-finite is
  saved, and the checkpoint named as the last good one holds finite parameters."""
  out = run_train(tmp_path, corpus_dir, "--config.optim.lr=1e39", "--config.optim.clip_norm=0",
                  "--config.optim.warmup_steps=0", "--config.train.checkpoint_every=1")
  line = error_line(out)
  assert line.startswith("error: non-finite parameters") and "Last good checkpoint: none" in line  # step 1 overflowed
  assert not any(n.isdigit() for n in os.listdir(tmp_path / "checkpoints"))

  run = tmp_path / "later"  # healthy for 2 steps, then the learning rate explodes
  out = run_train(run, corpus_dir, "--config.train.steps=4", "--config.train.checkpoint_every=2")
  assert out.returncode == 0, out.stderr
  out = run_train(run, corpus_dir, "--config.train.steps=6", "--config.optim.lr=1e39",
                  "--config.train.checkpoint_every=1")
  assert f"Last good checkpoint: {run}/checkpoints/4" in error_line(out)
  assert sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit()) == [2, 4]
  step, params = final_params(run)
  assert step == 4 and all(np.isfinite(np.asarray(p)).all() for p in params)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax drops a failed read's other shard reads
def test_a_reader_whose_newest_step_is_removed_reads_the_next(tmp_path, finished_run):
  """As a training saving meanwhile would do it: the reader chooses step 4, the newest, then step 6
  is committed and 4 removed, its array files first, while 4 is being read. The reader reads 6,
  with the params of the finished run. A step given by number, or damage to the newest one, is
  read once and its error raised."""
  from latent_jax import checkpoint
  from latent_jax.infer import load
  source, want = finished_run
  run, later = tmp_path / "run", tmp_path / "6"
  shutil.copytree(source, run)
  shutil.move(run / "checkpoints" / "6", later)
  chosen = []

  def read(step):
    chosen.append(step)
    if later.exists():
      shutil.move(later, run / "checkpoints" / "6")
      shutil.rmtree(run / "checkpoints" / "4" / "params" / "ocdbt.process_0")
    cfg, step = checkpoint.load_config(str(run), step)
    return step, jax.tree.leaves(load.load_params(str(run), cfg, step)[1])

  step, got = checkpoint.read_newest(str(run), None, read)
  assert chosen == [4, 6] and step == 6
  for x, y in zip(want, got):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  chosen.clear()
  shutil.rmtree(run / "checkpoints" / "4")  # the training has finished removing it
  with pytest.raises(FileNotFoundError, match="no checkpoint at step 4"):
    checkpoint.read_newest(str(run), 4, read)
  assert chosen == [4]
  chosen.clear()
  truncate_largest(str(run / "checkpoints" / "6" / "params"))
  with pytest.raises(Exception) as damage:
    checkpoint.read_newest(str(run), None, read)
  assert chosen == [6] and "removed" not in str(damage.value)  # Orbax's error as it is


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax drops a failed read's other shard reads
@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_readers_never_disturb_a_training(tmp_path, corpus_dir):
  """eval, generate and export read a workdir over and over while it trains and saves (in this
  process, for many reads, and through each CLI); the training finishes and equals an undisturbed one."""
  from latent_jax.eval import evaluate_dir
  from latent_jax.export import export
  from latent_jax.infer import load_model
  steps = ["--config.train.steps=60", "--config.train.checkpoint_every=1", "--config.train.eval_every=0",
           "--config.train.keep_checkpoints=2"]
  straight = tmp_path / "straight"
  assert run_train(straight, corpus_dir, *steps).returncode == 0
  run = tmp_path / "run"
  proc = subprocess.Popen(train_cmd(run, corpus_dir, *steps), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  wait_for_step(str(run), proc, 1, checkpoint=1)
  commands = [cli("latent_jax.eval", "--workdir", str(run), "--batches=1"),
              cli("latent_jax.generate", "--workdir", str(run), "--max_new_tokens=2", "--temperature=0"),
              cli("latent_jax.export", "--workdir", str(run), "--out", str(tmp_path / "export_cli"))]
  clis = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
  reads, k = 0, 0
  while proc.poll() is None:  # every read succeeds: one whose step is removed meanwhile reads the newest
    k += 1
    [lambda: evaluate_dir(str(run), max_batches=1), lambda: load_model(str(run)),
     lambda: export(str(run), str(tmp_path / f"export{k}"))][k % 3]()
    reads += 1
  out = proc.communicate()[0]
  for c in clis:
    cli_out = c.communicate()[0]
    assert c.returncode == 0, cli_out
  assert proc.returncode == 0 and "done at step 60/60" in out, out
  assert reads >= 5, reads
  (_, want), (_, got) = final_params(straight), final_params(run)
  for x, y in zip(want, got):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
