"""Judging a model on task files alone (issue 39): `eval --tasks` on a workdir or an export folder whose
training data is not at hand prints the proxies, leaves validation out (`"val_loss": null`) with one line
on stderr saying why, and names an export's step; `--val` makes missing data an error again."""
import json
import os
import shutil

import pytest

from conftest import TINY, TINY_OVERRIDES
from test_cli_errors import check_one_error_line, run_main

PROXIES = {"proxy/math/nll", "proxy/math/bpb", "proxy/math/acc", "proxy/arithmetic/nll"}


@pytest.fixture(scope="module")
def judged(tmp_path_factory, corpus_dir):
  """(workdir, export, task file) of a 2-step tiny run whose corpus has since gone."""
  from latent_jax import load_config
  from latent_jax.data.task_sets import write_task_sets
  from latent_jax.export import export
  from latent_jax.train.loop import train
  root = tmp_path_factory.mktemp("judged")
  corpus = shutil.copytree(corpus_dir, root / "corpus")
  workdir, out = str(root / "run"), str(root / "export")
  train(load_config(TINY, TINY_OVERRIDES + [f"data.source={corpus}", "train.steps=2", "optim.warmup_steps=1",
                                            "train.eval_every=0"]), workdir)
  export(workdir, out)
  write_task_sets(str(root / "tasks"), ["arithmetic"], max_examples=8)
  shutil.rmtree(corpus)
  return workdir, out, str(root / "tasks" / "arithmetic.jsonl")


def eval_json(argv, capsys):
  from latent_jax.eval import main
  capsys.readouterr()
  main(argv)
  captured = capsys.readouterr()
  return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def notes(err):
  return [line for line in err.splitlines() if line.startswith("eval: validation loss left out")]


def test_tasks_need_no_data(judged, capsys):
  workdir, out, tasks = judged
  for directory, step in ((workdir, 2), (out, 2)):
    result, err = eval_json(["--workdir", directory, "--tasks", tasks], capsys)
    assert PROXIES <= set(result) and result["val_loss"] is None and "batches" not in result
    assert result["step"] == step
    assert len(notes(err)) == 1 and "matches no file" in notes(err)[0] and "error" not in err, err
  assert result["source"] == f"export of {workdir} at step 2"


def test_val_requires_the_data(judged, capsys):
  workdir, out, tasks = judged
  for argv in (["--tasks", tasks, "--val"], []):  # asked for, or nothing else to do: an error, as before
    code, err = run_main("latent_jax.eval", ["--workdir", out, *argv], capsys)
    check_one_error_line(code, err, ["data.source", "matches no file"])
  result, err = eval_json(["--workdir", workdir, "--tasks", tasks, "--noval"], capsys)
  assert PROXIES <= set(result) and result["val_loss"] is None and not notes(err)


def test_data_too_small_and_an_export_without_its_step(judged, tmp_path, capsys):
  """The issue's other case, data at hand but less than one batch of it (it met data.source=kjv under OLMo-3's
  512 x 8192 batch; a small file here); and an export folder written before export.json (or by hand) says it
  is an export rather than `"step": null`."""
  _, out, tasks = judged
  copy = shutil.copytree(out, tmp_path / "export")
  (tmp_path / "small.txt").write_text("Kar lon mith sethal nur. " * 40)
  config = json.loads((copy / "config.json").read_text())
  config["data"].update(source=str(tmp_path / "small.txt"), batch_size=512, doc_separator=". ")
  (copy / "config.json").write_text(json.dumps(config))
  os.remove(copy / "export.json")
  result, err = eval_json(["--workdir", str(copy), "--tasks", tasks], capsys)
  assert PROXIES <= set(result) and result["val_loss"] is None
  assert len(notes(err)) == 1 and "fewer than one batch of data.batch_size=512" in notes(err)[0], err
  assert result["step"] == "export" and "not recorded" in result["source"]
  (copy / "export.json").write_text(json.dumps({"hf": "/models/Olmo-3"}))  # what convert --hf writes
  from latent_jax.eval import describe_source
  assert describe_source(str(copy), None) == ("export", "import of the Hugging Face checkpoint /models/Olmo-3 "
                                                        "(convert --hf)")
