"""Bad input on every command line: exit code 2, one `error: ...` line on stderr that names the flag,
setting or path, no traceback, and nothing written."""
import importlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES

CLIS = ("latent_jax.train.__main__", "latent_jax.eval", "latent_jax.generate", "latent_jax.export",
        "latent_jax.draft")


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
])
def test_bad_flags(module, argv, names, tmp_path, capsys):
  before = listing(tmp_path)
  code, err = run_main(module, [a.format(tmp=tmp_path) for a in argv], capsys)
  check_one_error_line(code, err, names)
  assert listing(tmp_path) == before


@pytest.mark.parametrize("module", CLIS)
def test_help(module, capsys):
  with pytest.raises(SystemExit) as exit_:
    importlib.import_module(module).main(["--help"])
  out = capsys.readouterr().out
  assert exit_.value.code == 0
  assert out.startswith(importlib.import_module(module).__doc__.strip()) and "--workdir" in out


def test_unknown_flag_in_a_real_process(tmp_path):
  """The real entry point behaves as main() does: `--steps=5` is refused, not ignored."""
  out = subprocess.run([sys.executable, "-m", "latent_jax.train", "--config", TINY, "--workdir", str(tmp_path / "run"),
                        "--steps=5"], cwd=ROOT, capture_output=True, text=True)
  check_one_error_line(out.returncode, out.stderr, ["--steps"])
  assert not (tmp_path / "run").exists()
