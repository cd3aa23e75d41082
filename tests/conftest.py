import atexit
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))

# One persistent compilation cache for the session, its xdist workers and the CLIs they start:
# most tests compile the same few tiny programs, and the CPU's compile time is the suite's
# largest cost. Set before jax is imported; the xdist workers inherit it from the controller.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="latent_jax_test_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# configs/tiny.py shrunk further so that a train step compiles and runs in seconds.
TINY_OVERRIDES = [
    "model.vocab_size=320", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.window=8",
    "model.full_attention_every=2", "data.seq_len=32", "data.batch_size=8", "train.steps=6",
    "optim.warmup_steps=2", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
    "train.checkpoint_every=2", "kernels.impl=xla"]


def pytest_collection_modifyitems(config, items):
  """Tests marked gpu (the GPU tier) skip, saying why, where jax has no GPU."""
  gpu_items = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_items:
    return
  import jax
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason=f"the GPU tier needs a GPU; jax's backend here is {jax.default_backend()!r}")
    for item in gpu_items:
      item.add_marker(skip)


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


def ragged_batch(rows, length, vocab, seed=0):
  """A batch of packed rows whose scored targets differ in number: each row holds one to three
  documents (positions restart, segment ids change) and ends in 0 to length/2 padding positions
  (segment 0, target -1), odd rows more of it, so that equal splits of the rows score unequal counts."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, size=(rows, length + 1))
  targets, seg, pos = tokens[:, 1:].copy(), np.zeros((rows, length), int), np.zeros((rows, length), int)
  for i in range(rows):
    real = length - rng.integers(0, length // 4) - (length // 4) * (i % 2)
    cuts = np.sort(rng.choice(np.arange(2, real - 1), size=rng.integers(0, 3), replace=False))
    for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, real])):
      seg[i, start:end], pos[i, start:end] = doc + 1, np.arange(end - start)
    targets[i, real - 1:] = -1  # the row's last real token has no next token in the row; padding none
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  return {"inputs": as_int(tokens[:, :-1]), "targets": as_int(targets), "segment_ids": as_int(seg),
          "positions": as_int(pos)}


@pytest.fixture(scope="session")
def hf_tokenizer_file(corpus_dir, tmp_path_factory):
  """A byte-level BPE tokenizer.json (OLMo-3's kind) of 300 tokens trained on the corpus, EOS and pad special."""
  from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
  tok = HFTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = [open(os.path.join(corpus_dir, f)).read() for f in sorted(os.listdir(corpus_dir))]
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
  path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
  tok.save(str(path))
  return str(path)
