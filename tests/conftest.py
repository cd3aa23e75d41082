import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))

# configs/tiny.py shrunk further so that a train step compiles and runs in seconds.
TINY_OVERRIDES = [
    "model.vocab_size=320", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.window=8",
    "model.full_attention_every=2", "data.seq_len=32", "data.batch_size=8", "train.steps=6",
    "optim.warmup_steps=2", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
    "train.checkpoint_every=2", "kernels.impl=xla"]


@pytest.fixture
def tiny_cfg():
  from latent_jax import load_config
  return load_config(TINY, TINY_OVERRIDES)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
  """A small synthetic corpus: 200 documents of pseudo-sentences over a 60-word vocabulary."""
  rng = np.random.default_rng(0)
  words = [f"{a}{b}" for a in ["ka", "lo", "mi", "nu", "se", "ta"] for b in ["r", "n", "th", "l", "s", "m", "d", "p", "g", "v"]]
  root = tmp_path_factory.mktemp("corpus")
  for i in range(200):
    sentences = [" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(8)]
    (root / f"doc{i:03d}.txt").write_text(" ".join(sentences) + "\n")
  return str(root)
