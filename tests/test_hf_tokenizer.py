"""Hugging Face tokenizer.json files through the `tokenizers` library, behind the Tokenizer interface:
a tiny byte-level BPE built here, then trained on, evaluated, exported and sampled through the CLIs."""
import filecmp
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax.data import build_data
from latent_jax.data import tokenizer as tokenizer_lib
from latent_jax.data.tokenizer import Tokenizer, load_or_train_tokenizer
from test_data import tiny_config


@pytest.fixture(scope="module")
def hf_file(hf_tokenizer_file):
  return pathlib.Path(hf_tokenizer_file)


def test_hf_tokenizer_interface(hf_file):
  tok = Tokenizer(str(hf_file))
  reference = HFTokenizer.from_file(str(hf_file))  # the library itself, not through our wrapper
  assert tok.kind == "huggingface" and tok.filename == "tokenizer.json" and not tok.new
  assert tok.vocab_size == reference.get_vocab_size() and tok.token_bytes.shape == (tok.vocab_size,)
  assert tok.eos_id == reference.token_to_id("<|endoftext|>") and tok.pad_id == reference.token_to_id("<|pad|>")
  text = "Karn lom  mith.\nSeth\ttav caf\u00e9 \u6c34 42! \U0001f642"  # unseen chars: bytes of the alphabet
  ids = tok.encode(text)
  assert ids == reference.encode(text, add_special_tokens=False).ids
  assert tok.decode(ids) == text and tok.encode_batch([text, "Kar"]) == [ids, tok.encode("Kar")]
  # Bits per byte are exact: the tokens' bytes add up to the text's UTF-8 length.
  assert tok.token_bytes[ids].sum() == len(text.encode("utf-8"))
  assert tok.token_bytes[tok.eos_id] == 0 and tok.token_bytes[tok.pad_id] == 0
  for i in ids:  # each token on its own: a whole character's bytes, or the bytes of part of one
    assert tok.token_bytes[i] == len(reference.decode([i]).encode()) or "\ufffd" in reference.decode([i])
  # model.vocab_size may exceed the tokenizer's only by padding (OLMo-3's 100,278 -> 100,352 = 784 * 128).
  assert tokenizer_lib.max_vocab_size(tok.vocab_size) == 384 and -(-100_278 // 128) * 128 == 100_352 == 784 * 128


def test_hf_tokenizer_errors(hf_file, tmp_path, corpus_dir):
  garbage = tmp_path / "tokenizer.json"
  garbage.write_bytes(bytes(range(256)))
  with pytest.raises(ValueError, match=f"{garbage} is not a Hugging Face tokenizer.json"):
    Tokenizer(str(garbage))
  spec = json.loads(hf_file.read_text())
  spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|endoftext|>"]
  no_eos = tmp_path / "no_eos.json"
  no_eos.write_text(json.dumps(spec))
  with pytest.raises(ValueError, match=f"{no_eos} has no EOS among its special tokens \\(<\\|pad\\|>\\)"):
    Tokenizer(str(no_eos))
  cfg = tiny_config(corpus_dir, vocab_size=385, tokenizer=str(hf_file))
  with pytest.raises(ValueError, match="model.vocab_size=385 is far above the .* Set model.vocab_size=384"):
    load_or_train_tokenizer(cfg.data, 385, str(tmp_path / "run"), [])


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_hf_tokenizer_trains_evaluates_and_exports(hf_file, corpus_dir, tmp_path):
  run, out = tmp_path / "run", tmp_path / "export"
  cli = lambda module, *args: subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                                             text=True)
  overrides = TINY_OVERRIDES + [f"data.source={corpus_dir}", f"data.tokenizer={hf_file}", "train.steps=2",
                                "optim.warmup_steps=1", "train.eval_every=2"]
  train = cli("latent_jax.train", "--config", TINY, "--workdir", str(run), *[f"--config.{o}" for o in overrides])
  assert train.returncode == 0, train.stderr
  # The workdir keeps its own copy under the Hugging Face name; nothing SentencePiece is trained.
  assert filecmp.cmp(run / "tokenizer.json", hf_file, shallow=False) and not (run / "tokenizer.model").exists()
  logged = [json.loads(line) for line in open(run / "metrics.jsonl")]
  ev = cli("latent_jax.eval", "--workdir", str(run))
  assert ev.returncode == 0, ev.stderr
  result = json.loads(ev.stdout.strip().splitlines()[-1])
  assert result["step"] == 2 and result["val_bpb"] == logged[-1]["val_bpb"] > 0
  # Without data.tokenizer, the workdir's copy gives the same ids (what a resumed run reads).
  same = build_data(tiny_config(corpus_dir), str(run))
  given = build_data(tiny_config(corpus_dir, tokenizer=str(hf_file)), str(tmp_path / "fresh"))
  assert same.tokenizer.path == str(run / "tokenizer.json") and not same.tokenizer.new
  np.testing.assert_array_equal(same.train_tokens, given.train_tokens)

  assert cli("latent_jax.export", "--workdir", str(run), "--out", str(out)).returncode == 0
  assert sorted(os.listdir(out)) == ["config.json", "export.json", "params", "tokenizer.json"]
  ev2 = cli("latent_jax.eval", "--workdir", str(out))
  assert json.loads(ev2.stdout.strip().splitlines()[-1])["val_loss"] == pytest.approx(result["val_loss"], rel=1e-6)
  gen = cli("latent_jax.generate", "--workdir", str(out), "--prompt", "Kar lon", "--temperature=0",
            "--max_new_tokens=8")
  assert gen.returncode == 0 and gen.stdout.startswith("Kar lon"), gen.stderr


def test_hf_tokenizer_token_store(hf_file, corpus_dir, tmp_path):
  """prepare keeps the tokenizer.json in the store, and a run on the store gets the in-memory ids."""
  from latent_jax import prepare as prepare_lib
  out = tmp_path / "store"
  cfg = tiny_config(corpus_dir, tokenizer=str(hf_file))
  manifest = prepare_lib.prepare(cfg, str(out), workers=1, shard_mb=0.004, log=lambda *a: None)
  assert manifest["tokenizer"]["file"] == "tokenizer.json" and manifest["tokenizer"]["kind"] == "huggingface"
  assert filecmp.cmp(out / "tokenizer.json", hf_file, shallow=False) and not (out / "tokenizer.model").exists()
  mem = build_data(cfg, str(tmp_path / "mem"))
  lazy = build_data(tiny_config(str(out)), str(tmp_path / "lazy"))
  assert lazy.tokenizer.path == str(tmp_path / "lazy" / "tokenizer.json") and lazy.tokenizer.new
  np.testing.assert_array_equal(np.asarray(lazy.train_tokens), mem.train_tokens)
  np.testing.assert_array_equal(np.asarray(lazy.val_tokens), mem.val_tokens)
