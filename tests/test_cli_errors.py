"""Bad input on every command line: exit code 2, one `error: ...` line on stderr that names the flag,
setting or path, no traceback, and nothing written."""
import io
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES

from latent_jax import cli

CLIS = ("latent_jax.train.__main__", "latent_jax.eval", "latent_jax.generate", "latent_jax.export",
        "latent_jax.draft", "latent_jax.convert")


def listing(path):
  """Every path under `path` (or None when it does not exist): what a command must leave alone."""
  if not os.path.exists(path):
    return None
  return sorted(os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files)


def check_one_error_line(code, err, names):
  assert code == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  for name in names:
    assert name in lines[0], (name, lines[0])


def run_main(module, argv, capsys):
  """main(argv) of a CLI in this process -> (exit code, stderr)."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_:
    importlib.import_module(module).main(argv)
  return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("module,argv,names", [
    ("latent_jax.train.__main__", ["--steps=5"], ["--steps", "--config", "--workdir"]),
    ("latent_jax.train.__main__", ["--config", TINY], ["--workdir"]),
    ("latent_jax.train.__main__", ["--config", TINY, "--workdir"], ["--workdir"]),
    ("latent_jax.train.__main__", ["runs/x"], ["'runs/x'"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--batches=-1"], ["--batches=-1", ">= 0"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--step=abc"], ["--step=abc", "integer"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--config.model.d_model=8"], ["--config.model.d_model"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--temperature=-1"], ["--temperature=-1", ">= 0"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--top_p=0"], ["--top_p=0", "(0, 1]"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--top_p=1.5"], ["--top_p=1.5", "(0, 1]"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--top_k=-1"], ["--top_k=-1", ">= 0"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--max_new_tokens=0"], ["--max_new_tokens=0", ">= 1"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--num_samples=0"], ["--num_samples=0", ">= 1"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--step=-1"], ["--step=-1", ">= 0"]),
    ("latent_jax.generate", ["--workdir", "{tmp}", "--drafter", "{tmp}"], ["--drafter", "--temperature=0"]),
    ("latent_jax.export", ["--workdir", "{tmp}", "--out", "{tmp}/out", "--dtype=float16"], ["--dtype", "bfloat16"]),
    ("latent_jax.export", ["--workdir", "{tmp}", "--out", "{tmp}"], ["--out", "exists"]),
    ("latent_jax.draft", ["--workdir", "{tmp}/d"], ["--config"]),
    ("latent_jax.convert", ["--out", "{tmp}/out"], ["--hf", "--workdir"]),
    ("latent_jax.convert", ["--hf", "{tmp}", "--workdir", "{tmp}", "--out", "{tmp}/out"], ["--hf", "--workdir"]),
    ("latent_jax.convert", ["--hf", "{tmp}", "--out", "{tmp}/out"], ["--hf needs --config"]),
    ("latent_jax.convert", ["--hf", "{tmp}", "--config", TINY, "--out", "{tmp}/out"], ["--hf", "no config.json"]),
    ("latent_jax.convert", ["--workdir", "{tmp}", "--out", "{tmp}"], ["--out", "exists"]),
    ("latent_jax.convert", ["--workdir", "{tmp}", "--out", "{tmp}/out", "--dtype=int8"], ["--dtype", "bfloat16"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--lm_eval_tasks", "x", "--limit=0"], ["--limit=0", ">= 1"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--batch_size=0"], ["--batch_size=0", ">= 1"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--tasks", ","], ["--tasks", "names no task file"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--tasks", "{tmp}/nope.jsonl"], ["--tasks", "nope.jsonl", "does not exist"]),
    ("latent_jax.tasks", ["--out", "{tmp}/t", "--sets=kjv,nope"], ["--sets", "'nope'", "python_stdlib"]),
    ("latent_jax.eval", ["--workdir", "{tmp}", "--noval"], ["--noval", "nothing to evaluate", "--tasks"]),
])
def test_bad_flags(module, argv, names, tmp_path, capsys):
  before = listing(tmp_path)
  code, err = run_main(module, [a.format(tmp=tmp_path) for a in argv], capsys)
  check_one_error_line(code, err, names)
  assert listing(tmp_path) == before


def test_lm_eval_tasks_without_the_eval_extra(tmp_path, capsys, monkeypatch):
  """lm-eval is an optional extra: without it, eval --lm_eval_tasks says how to install it."""
  import latent_jax
  monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an import sees where the package is not installed
  monkeypatch.delitem(sys.modules, "latent_jax.harness", raising=False)
  monkeypatch.delattr(latent_jax, "harness", raising=False)
  code, err = run_main("latent_jax.eval", ["--workdir", str(tmp_path), "--lm_eval_tasks", "x"], capsys)
  check_one_error_line(code, err, ["--lm_eval_tasks", "lm-evaluation-harness is not installed", "pip install -e '.[eval]'"])


@pytest.mark.parametrize("module", CLIS + ("latent_jax.plan", "latent_jax.prepare"))
def test_help(module, capsys):
  """Every command line documents its flags, the multi-host ones included."""
  with pytest.raises(SystemExit) as exit_:
    importlib.import_module(module).main(["--help"])
  out = capsys.readouterr().out
  assert exit_.value.code == 0
  assert out.startswith(importlib.import_module(module).__doc__.strip())
  assert "--workdir" in out or module in ("latent_jax.plan", "latent_jax.prepare")
  for flag in ("--coordinator_address", "--num_processes", "--process_id"):
    assert flag in out


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
  """Sources and files that are wrong in each way the tables below try."""
  root = tmp_path_factory.mktemp("bad")
  (root / "empty").mkdir()
  (root / "empty.txt").write_text("")
  (root / "latin1.txt").write_bytes("Caf\xe9 au lait.".encode("latin-1"))
  (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
  (root / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut sho\n')
  (root / "small").mkdir()
  for i in range(20):  # ~100 tokens: not one batch of 8 rows of 32
    (root / "small" / f"doc{i}.txt").write_text(f"Kar lon mith {i}.")
  (root / "garbage.model").write_bytes(b"not a SentencePiece model\x00\x01")
  (root / "tokenizer.json").write_bytes(bytes(range(256)))  # garbage bytes named like a Hugging Face file
  (root / "a_file").write_text("not a folder")
  return root


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_dir):
  """A 2-step tiny run: a source for train.init_from, a workdir to resume, load and export."""
  from latent_jax import load_config
  from latent_jax.train.loop import train
  workdir = tmp_path_factory.mktemp("run")
  train(load_config(TINY, TINY_OVERRIDES + [f"data.source={corpus_dir}", "train.steps=2", "optim.warmup_steps=1",
                                            "train.eval_every=0"]), str(workdir))
  return workdir


def train_args(corpus, workdir, *overrides):
  return ["--config", TINY, "--workdir", str(workdir), *[f"--config.{o}" for o in TINY_OVERRIDES],
          f"--config.data.source={corpus}", *[f"--config.{o}" for o in overrides]]


# (workdir, overrides, what the message names); {tmp}: a fresh folder, {bad}: the fixture above,
# {corpus}: conftest's corpus_dir, {run}: the trained run. The source is {corpus} unless overridden.
TRAIN_CASES = {
    "no source": ("{tmp}/run", ["data.source="], ["data.source", "is empty"]),
    "missing source": ("{tmp}/run", ["data.source={tmp}/nope"], ["data.source", "nope", "matches no file"]),
    "empty folder": ("{tmp}/run", ["data.source={bad}/empty"], ["data.source", "no .txt / .jsonl"]),
    "empty file": ("{tmp}/run", ["data.source={bad}/empty.txt"], ["data.source", "empty.txt", "empty"]),
    "not UTF-8": ("{tmp}/run", ["data.source={bad}/latin1.txt"], ["data.source", "latin1.txt", "not UTF-8", "iconv"]),
    "binary": ("{tmp}/run", ["data.source={bad}/image.png"], ["data.source", "image.png", "binary"]),
    "jsonl without text": ("{tmp}/run", ["data.source={bad}/notext.jsonl"], ["notext.jsonl:2", '"text"']),
    "broken jsonl line": ("{tmp}/run", ["data.source={bad}/broken.jsonl"], ["broken.jsonl:2", "not valid JSON"]),
    "corpus too small": ("{tmp}/run", ["data.source={bad}/small"], ["data.batch_size=8", "data.source"]),
    "text above data.max_text_gib": ("{tmp}/run", ["data.max_text_gib=1e-6"],
                                     ["data.source", "GiB of text files", "data.max_text_gib=1e-06",
                                      "python -m latent_jax.prepare --config CONFIG --out DIR"]),
    "workdir is a file": ("{bad}/a_file", [], ["--workdir", "a_file", "is a file"]),
    "workdir under a file": ("{bad}/a_file/run", [], ["--workdir", "a_file", "is a file"]),
    "missing tokenizer": ("{tmp}/run", ["data.tokenizer={tmp}/nope.model"], ["data.tokenizer", "nope.model"]),
    "garbage tokenizer": ("{tmp}/run", ["data.tokenizer={bad}/garbage.model"],
                          ["data.tokenizer", "garbage.model", "not a SentencePiece model"]),
    "garbage tokenizer.json": ("{tmp}/run", ["data.tokenizer={bad}/tokenizer.json"],
                               ["data.tokenizer", "tokenizer.json", "not a Hugging Face tokenizer.json"]),
    "missing init_from": ("{tmp}/run", ["train.init_from={tmp}/nope"], ["train.init_from", "nope"]),
    "init_from not a run": ("{tmp}/run", ["train.init_from={bad}"], ["train.init_from", "neither a training workdir"]),
    "init_from of another shape": ("{tmp}/run", ["train.init_from={run}", "model.d_model=48"],
                                   ["train.init_from", "(2, 32, 16) in", "(2, 48, 16) here"]),
    "resume another shape": ("{run}", ["model.d_model=48"], ["another model", "model.d_model: saved 32, now 48"]),
    "vocab far above the tokenizer": ("{tmp}/run", ["model.vocab_size=200000"],
                                      ["model.vocab_size=200000", "624 pieces", "model.vocab_size=640"]),
    "unknown config field": ("{tmp}/run", ["train.stepz=5"], ["train.stepz", "not a config field"]),
    "profile past the run's end": ("{tmp}/run", ["train.profile_steps=(5,3)"],
                                   ["train.profile_steps", "(5, 3)", "train.steps=6", "START + COUNT <= 6"]),
    "missing tokenizer source": ("{tmp}/run", ["data.tokenizer_sources=arithmetic,{tmp}/nope"],
                                 ["data.tokenizer_sources", "nope", "matches no file"]),
    "bf16 parameters without a master": ("{tmp}/run", ["model.param_dtype=bfloat16"],
                                         ["model.param_dtype", "model.param_dtype=float32 with model.dtype=bfloat16",
                                          "model.allow_bf16_params=True"]),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_refuses_bad_input_and_writes_nothing(case, tmp_path, bad, corpus_dir, run, capsys):
  workdir, overrides, names = TRAIN_CASES[case]
  fill = lambda s: s.format(tmp=tmp_path, bad=bad, run=run)
  workdir = fill(workdir)
  before = listing(workdir), listing(bad), listing(run)
  code, err = run_main("latent_jax.train.__main__", train_args(corpus_dir, workdir, *map(fill, overrides)), capsys)
  check_one_error_line(code, err, [fill(n) for n in names])
  assert (listing(workdir), listing(bad), listing(run)) == before


def test_read_only_workdir(tmp_path, corpus_dir, capsys, monkeypatch):
  workdir = tmp_path / "ro"
  workdir.mkdir(mode=0o555)
  if os.geteuid() == 0:  # root writes anywhere: show it the folder as any other user sees it
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(workdir) else access(p, mode, **kw))
  code, err = run_main("latent_jax.train.__main__", train_args(corpus_dir, workdir), capsys)
  check_one_error_line(code, err, ["--workdir", str(workdir), "not writable"])
  assert os.listdir(workdir) == []


def test_non_finite_loss_is_one_line(monkeypatch, capsys):
  from latent_jax.train import __main__ as cli_main
  from latent_jax.train.loop import NonFiniteLoss

  def diverge(cfg, workdir, allow_data_change):
    raise NonFiniteLoss("non-finite loss at step 3: {'loss': nan}. Last good checkpoint: none. Lower optim.lr.")
  monkeypatch.setattr(cli_main, "train", diverge)
  code, err = run_main("latent_jax.train.__main__", ["--config", TINY, "--workdir", "unused"], capsys)
  check_one_error_line(code, err, ["non-finite loss at step 3", "optim.lr"])


@pytest.mark.parametrize("module,argv,names", [
    ("latent_jax.eval", ["--workdir", "{tmp}/nope"], ["--workdir", "nope", "no checkpoints"]),
    ("latent_jax.generate", ["--workdir", "{run}", "--step=99"], ["--workdir", "no checkpoint at step 99",
                                                                 "checkpoints are at steps"]),
    ("latent_jax.generate", ["--workdir", "{run}", "--top_k=1000"], ["--top_k=1000", "320"]),
    ("latent_jax.export", ["--workdir", "{run}", "--out", "{bad}/a_file/export"], ["--out", "a_file", "is a file"]),
    ("latent_jax.draft", ["--config", f"{ROOT}/configs/tiny_drafter.py", "--workdir", "{bad}/a_file",
                          "--config.target={run}"], ["--workdir", "a_file", "is a file"]),
    ("latent_jax.draft", ["--config", f"{ROOT}/configs/tiny_drafter.py", "--workdir", "{tmp}/d",
                          "--config.target={tmp}/nope"], ["target", "nope", "neither a training workdir"]),
    ("latent_jax.draft", ["--config", f"{ROOT}/configs/tiny_drafter.py", "--workdir", "{tmp}/d",
                          "--config.target={run}"], ["drafter.concept", "'predicted' needs a ConceptLM", "concept=none"]),
    ("latent_jax.draft", ["--config", f"{ROOT}/configs/tiny.py", "--workdir", "{tmp}/d"],
     ["--config", "drafter config naming its target", "latent_jax.train"]),
    ("latent_jax.train.__main__", ["--config", f"{ROOT}/configs/tiny_drafter.py", "--workdir", "{tmp}/d",
                                   "--config.target={run}"], ["--config", "a drafter config", "latent_jax.draft"]),
    ("latent_jax.draft", ["--config", f"{ROOT}/configs/tiny_drafter.py", "--workdir", "{tmp}/d", "--config.target={run}",
                          "--config.drafter.concept=none", "--config.optim.warmup_steps=400"],
     ["optim.warmup_steps", "400 must lie in [0, train.steps=400)"]),
])
def test_loading_commands_refuse_bad_paths(module, argv, names, tmp_path, bad, run, capsys):
  fill = lambda s: s.format(tmp=tmp_path, bad=bad, run=run)
  before = listing(tmp_path), listing(bad), listing(run)
  code, err = run_main(module, list(map(fill, argv)), capsys)
  check_one_error_line(code, err, list(map(fill, names)))
  assert (listing(tmp_path), listing(bad), listing(run)) == before


@pytest.mark.parametrize("extra,names", [
    (["--steps=5"], ["unknown flag --steps"]),  # refused, not ignored
    (["--config.data.source={tmp}/nope"], ["data.source", "matches no file"]),
    (["--config.data.source=kjv", "--config.model.vocab_size=200000"],  # not a 52M-param model of unused rows
     ["model.vocab_size=200000", "34090 pieces", "model.vocab_size=34176"]),
])
def test_a_real_process_behaves_as_main(extra, names, tmp_path, corpus_dir):
  out = subprocess.run([sys.executable, "-m", "latent_jax.train", *train_args(corpus_dir, tmp_path / "run"),
                        *[e.format(tmp=tmp_path) for e in extra]], cwd=ROOT, capture_output=True, text=True)
  check_one_error_line(out.returncode, out.stderr, names)
  assert os.listdir(tmp_path) == []


def test_an_error_without_a_message_keeps_its_traceback(capsys):
  """Bad input is one line and exit 2; an exception with no message is a bug, so it propagates."""
  with pytest.raises(SystemExit) as stop, cli.errors():
    raise ValueError("data.source: no such file")
  assert stop.value.code == 2 and capsys.readouterr().err == "error: data.source: no such file\n"
  with pytest.raises(io.UnsupportedOperation), cli.errors():
    raise io.UnsupportedOperation()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu extra (libtpu) is not installed")
def test_no_libtpu_warnings_without_a_tpu(tmp_path, corpus_dir):
  """With libtpu installed on a machine without a TPU, a command's stderr holds its own lines only:
  train (whose backend start-up would let libtpu look for a TPU) and plan (which loads libtpu to
  compile for a slice), each stopped by a mesh that does not fit once the devices are known."""
  from latent_jax import distributed
  if distributed.tpu_present():
    pytest.skip("this machine has a TPU")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
  cases = [(["latent_jax.train", *train_args(corpus_dir, tmp_path / "run", "mesh.data=2")], ["mesh", "1 devices"]),
           (["latent_jax.plan", "--config", TINY, "--topology", "v5p-8", "--config.mesh.data=3"], ["mesh", "4 devices"])]
  for args, names in cases:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    check_one_error_line(out.returncode, out.stderr, names)


def test_train_prints_a_configs_fields(capsys):
  """--print_config shows every field with the overrides applied, and trains nothing (no --workdir needed)."""
  from latent_jax.train.__main__ import main
  main(["--config", TINY, "--print_config", "--config.model.d_model=96"])
  out = capsys.readouterr().out
  assert "d_model: 96" in out and "num_layers: 4" in out and "eval_every: 200" in out
  with pytest.raises(SystemExit):
    main(["--help"])
  assert "--print_config" in capsys.readouterr().out
