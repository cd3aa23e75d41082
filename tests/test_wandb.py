"""Weights & Biases as an optional logger (train.wandb_project): offline here (no network); the same
scalars as metrics.jsonl, the run config, a resumed run continuing the same W&B run; a missing
package is one error line."""
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from test_cli_errors import check_one_error_line, run_main


def test_missing_wandb_is_one_error_line(tmp_path, capsys, monkeypatch):
  import importlib.util
  find = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
  code, err = run_main("latent_jax.train.__main__", ["--config", TINY, "--workdir", str(tmp_path / "w"),
                                                     "--config.train.wandb_project=p"], capsys)
  check_one_error_line(code, err, ["train.wandb_project", "pip install"])
  assert not os.path.exists(tmp_path / "w")


def records(path):
  """The protobuf Records of a W&B offline transaction log (a .wandb file): a 7-byte header (":W&B",
  magic, version), then 32 KiB blocks of chunks, each (crc32 4, length 2, type 1) + data, a record being
  one FULL chunk or FIRST, MIDDLE..., LAST (LevelDB's log format, which W&B's data store uses)."""
  from wandb.proto import wandb_internal_pb2
  data, block, pos, parts = open(path, "rb").read(), 32768, 7, b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
      pos += block - pos % block
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind == 0:
      continue
    parts = chunk if kind in (1, 2) else parts + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      yield record


def offline_history(workdir):
  """(the W&B run ids, {step: row}, the logged config) of every offline run under WORKDIR/wandb."""
  ids, rows, config = set(), {}, {}
  for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
    for record in records(path):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        ids.add(record.run.run_id)
        config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
      elif kind == "history":
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        rows[row["_step"]] = row
  return ids, rows, config


@pytest.mark.slow
def test_wandb_logs_what_metrics_jsonl_holds_and_resumes_the_same_run(tmp_path):
  pytest.importorskip("wandb")
  workdir = str(tmp_path / "run")
  env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
  base = [sys.executable, "-m", "latent_jax.train", "--config", TINY, *[f"--config.{o}" for o in TINY_OVERRIDES],
          "--config.train.wandb_project=latent-jax-test", "--workdir", workdir]
  for steps in (4, 6):  # a run, then the same run resumed further
    out = subprocess.run(base + [f"--config.train.steps={steps}"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  run_ids, logged, config = offline_history(workdir)
  assert config["model"]["d_model"] == 32 and config["train"]["wandb_project"] == "latent-jax-test"
  assert run_ids == {open(os.path.join(workdir, "wandb_run_id")).read().strip()}  # one W&B run, resumed
  assert sorted(logged) == [r["step"] for r in rows]
  for row in rows:  # every scalar of every row, at its step
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        assert logged[row["step"]][k] == pytest.approx(v, rel=1e-6), (row["step"], k)
