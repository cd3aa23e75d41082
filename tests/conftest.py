import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture
def tiny_cfg():
  """configs/tiny.py shrunk further so a train step compiles and runs in seconds."""
  from latent_jax import load_config
  return load_config(os.path.join(ROOT, "configs", "tiny.py"), [
      "model.vocab_size=320", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
      "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.window=8",
      "model.full_attention_every=2", "data.seq_len=32", "data.batch_size=8", "train.steps=6",
      "optim.warmup_steps=2", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
      "train.checkpoint_every=2", "kernels.impl=xla"])
