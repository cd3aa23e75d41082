"""python -m latent_jax.prepare --config CONFIG --out DIR [--config.data.source=...] [--workers=N]

Tokenises data.source once into a token store (latent_jax/data/store.py, docs/data.md), which
training then reads lazily: --config.data.source=DIR. Four steps:

  scan      every source file is read once (in parallel): each document's hash (the split rule of
            corpus.split_documents, by document), its size, and a bounded tokenizer sample: the
            training documents of highest hash up to --sample_mb, in corpus order
  tokenizer data.tokenizer, or SentencePiece trained on that sample (on a corpus smaller than the
            sample: the whole training split, as training from the files does)
  shards    runs of about --shard_mb of text, in corpus order, tokenised by --workers processes
  manifest  after every shard's checksum is read back: sources (size, sha256), tokenizer, tokens
            and documents per split, the split rule, the unigram entropy, the shards

A named source (kjv, python_stdlib, arithmetic, kjv_facts, ...) is first written as DIR/.source/NAME.jsonl,
its documents in order, which the scan reads: the store splits it as training on the name does.

A killed prepare continues where it stopped when run again with the same --out (finished shards
are kept, the rest are written whole); a finished store is never overwritten. `--verify` reads a
finished store's checksums again. --out and the sources may be in a bucket (gs://...).

On several hosts (the multi-host flags, as for train) every process runs the same command:
process 0 prepares the store, the others wait for it (however long it takes), then check that
they see it; an error on process 0 stops every process with its message.
"""
import contextlib
import heapq
import json
import multiprocessing
import os
import time

import jax
import numpy as np

from latent_jax import cli, distributed, paths
from latent_jax.data import store
from latent_jax.data.corpus import (NAMED_SOURCES, cuttable, document_key, held_out, load_documents, read_documents,
                                    resolve_files)
from latent_jax.data.pipeline import count_entropy, token_stream
from latent_jax.data.tokenizer import TOKENIZER_FILES, Tokenizer, find_tokenizer, load_or_train_tokenizer
from latent_jax.train import progress

NAMED_FOLDER = ".source"  # in --out: a named source's documents, as the JSONL file its scan reads
SPLIT_RULE = ("documents ranked by the sha256 of their UTF-8 text (ties by corpus order); the "
              "max(1, round(val_fraction * documents)) lowest are validation")


# ----------------------------------------------------------------------------- scan


def scan_file(args):
  """(path, doc_separator, sample_bytes): one source file -> its size, sha256, documents' keys, text bytes and end offsets, and its
  part of the tokenizer sample: (key, index, bytes, text) of its highest keys up to sample_bytes."""
  path, doc_separator, sample_bytes = args
  keys, sizes, offsets, sample, held = [], [], [], [], 0
  for i, (doc, offset) in enumerate(read_documents(path, doc_separator)):
    key, size = document_key(doc), len(doc.encode("utf-8"))
    keys.append(key)
    sizes.append(size)
    offsets.append(offset or 0)
    heapq.heappush(sample, (key, i, size, doc))
    held += size
    while held > sample_bytes and len(sample) > 1:  # keep the highest keys that fit
      held -= heapq.heappop(sample)[2]
  return {"path": path, "bytes": paths.size(path), "mtime_ns": paths.mtime_ns(path),
          "sha256": store.sha256_file(path), "keys": b"".join(keys), "sizes": np.asarray(sizes, np.int64),
          "offsets": np.asarray(offsets, np.int64), "sample": sample}


def plan_shards(scans, held, shard_bytes):
  """Runs of documents of about shard_bytes of text, in corpus order: pieces (file, start, end,
  documents) that cut a plain .jsonl at line offsets and keep other files whole."""
  shards, pieces, size, first = [], [], 0, 0

  def close():
    nonlocal pieces, size, first
    docs = sum(p[3] for p in pieces)
    shards.append({"name": f"{len(shards):05d}", "pieces": pieces, "first_doc": first, "docs": docs,
                   "val": [int(i) for i in np.flatnonzero(held[first:first + docs]) + first], "bytes": int(size)})
    pieces, size, first = [], 0, first + docs

  for f, scan in enumerate(scans):
    n, cum = len(scan["sizes"]), np.cumsum(scan["sizes"])
    if not n:
      continue
    if not cuttable(scan["path"]):
      pieces.append([f, 0, None, n])
      size += int(cum[-1])
    else:
      i = 0
      while i < n:
        base = int(cum[i - 1]) if i else 0
        last = min(int(np.searchsorted(cum, base + shard_bytes - size)), n - 1)  # reaches shard_bytes
        pieces.append([f, int(scan["offsets"][i - 1]) if i else 0, int(scan["offsets"][last]), last - i + 1])
        size += int(cum[last]) - base
        i = last + 1
        if size >= shard_bytes and i < n:
          close()
    if size >= shard_bytes:
      close()
  if pieces:
    close()
  return shards


# ----------------------------------------------------------------------------- shards

_WORKER = {}


def tokenise_shard(args):
  """(out, files, doc_separator, dtype, shard): reads a shard's documents, tokenises them, writes
  the shard -> its record."""
  *setup, shard = args
  if _WORKER.get("setup") != setup:  # once per process
    out, files, doc_separator, dtype = setup
    _WORKER.update(setup=setup, tok=Tokenizer(find_tokenizer(out)), out=out, files=files,
                   doc_separator=doc_separator, dtype=np.dtype(dtype))
  w = _WORKER
  val, index = set(shard["val"]), shard["first_doc"]
  docs = {split: [] for split in store.SPLITS}
  for f, start, end, count in shard["pieces"]:
    path, n = w["files"][f]["path"], 0
    for doc, _ in read_documents(path, w["doc_separator"], start, end):
      docs["val" if index in val else "train"].append(doc)
      index, n = index + 1, n + 1
    if n != count:
      raise ValueError(f"data.source: {path} changed while prepare ran ({n} documents where the scan found "
                       f"{count}); restore it, or prepare into a new --out.")
  streams, ends = {}, {}
  for split, texts in docs.items():
    ids = w["tok"].encode_batch(texts)
    streams[split] = token_stream(ids, w["tok"].eos_id).astype(w["dtype"])
    ends[split] = np.cumsum([len(i) + 1 for i in ids], dtype=np.int64)
  return store.write_shard(w["out"], shard["name"], streams, ends, {"source_bytes": shard["bytes"]})


# ----------------------------------------------------------------------------- prepare


def settings(cfg, shard_mb, sample_mb):
  """What a resumed prepare must share with the run it continues."""
  d = cfg.data
  return {"source": d.source, "doc_separator": d.get("doc_separator", ""), "val_fraction": d.val_fraction,
          "vocab_size": cfg.model.vocab_size, "tokenizer": d.tokenizer, "shard_mb": shard_mb, "sample_mb": sample_mb}


def check_out(out):
  """A new or empty --out, or an unfinished store (-> its plan); a finished store is refused."""
  folder = paths.path(out)
  if (folder / store.MANIFEST).is_file():
    raise FileExistsError(f"--out {out} is a finished token store; train on it with --config.data.source={out}, "
                          "or choose another --out (a store is never overwritten).")
  if (folder / store.PLAN).is_file():
    return store.read_json(os.path.join(out, store.PLAN))
  if folder.exists() and not folder.is_dir():
    raise NotADirectoryError(f"--out {out} is a file; choose a folder.")
  leftovers = [f.name for f in (folder.iterdir() if folder.is_dir() else ())
               if f.name not in TOKENIZER_FILES.values() and not f.name.startswith(".")]
  if leftovers:
    raise FileExistsError(f"--out {out} holds other files ({', '.join(sorted(leftovers)[:3])}); choose a new or "
                          "empty folder.")
  return None


def make_plan(cfg, out, files, pool, shard_mb, sample_mb, log):
  """Scan, split, tokenizer -> DIR/tokenizer.model (or .json), then the plan -> DIR/plan.json."""
  d, given = cfg.data, cfg.data.tokenizer
  if leftover := find_tokenizer(out):  # left by a prepare killed before its plan
    paths.path(leftover).unlink()
  sample_bytes = 0 if given else int(sample_mb * 2**20)
  args = [(f, d.get("doc_separator", ""), sample_bytes) for f in files]
  scans, sample, held_bytes, first = [], [], 0, 0
  results = pool.imap(scan_file, args, chunksize=max(1, len(args) // 64)) if pool else map(scan_file, args)
  shown = progress.counter(len(files), "scan", unit=" files", disable=len(files) < 2)
  for scan in results:
    shown.update(1)
    for key, i, size, doc in scan.pop("sample"):  # the whole corpus's highest keys up to sample_bytes
      heapq.heappush(sample, (key, first + i, size, doc))
      held_bytes += size
      while held_bytes > sample_bytes and len(sample) > 1:
        held_bytes -= heapq.heappop(sample)[2]
    scans.append(scan)
    first += len(scan["sizes"])
  shown.close()
  if not first:
    raise ValueError(f"data.source: every document in {d.source!r} is empty (or whitespace); point data.source at "
                     "text, or check data.doc_separator.")
  held = held_out(np.frombuffer(b"".join(s["keys"] for s in scans), np.uint8).reshape(-1, 32), d.val_fraction)
  train_sample = [doc for _, i, _, doc in sorted(sample, key=lambda s: s[1]) if not held[i]]
  tok = load_or_train_tokenizer(d, cfg.model.vocab_size, out, train_sample, shared=False)  # on process 0 alone
  # --out is made only now: a source that fails the scan (bad content) or the tokenizer leaves nothing behind.
  paths.path(out).mkdir(parents=True, exist_ok=True)
  paths.write_atomic(os.path.join(out, tok.filename), lambda f: f.write(tok.proto))
  origin = (f"data.tokenizer={given}" if given else
            f"SentencePiece BPE trained on {len(train_sample):,} training documents "
            f"({sum(len(t.encode()) for t in train_sample) / 2**20:.1f} MB)")
  log(f"tokenizer: {origin}, {tok.vocab_size:,} pieces")
  plan = {"settings": settings(cfg, shard_mb, sample_mb), "tokenizer_origin": origin,
          "files": [{k: s[k] for k in ("path", "bytes", "mtime_ns", "sha256")} | {"docs": len(s["sizes"])}
                    for s in scans],
          "shards": plan_shards(scans, held, int(shard_mb * 2**20))}
  store.write_json(os.path.join(out, store.PLAN), plan)
  return plan


@contextlib.contextmanager
def removed_on_error(folder):
  """Remove `folder` (when not None) if the block fails: a prepare stopped before its plan leaves no --out."""
  try:
    yield
  except BaseException:
    if folder:
      paths.path(folder).rmtree(missing_ok=True)
    raise


def named_source_file(out, name):
  """A named source (kjv, python_stdlib, ...) as OUT/.source/NAME.jsonl, one {"text": ...} line per document
  (ASCII JSON: read back exactly), which the scan then reads as any source file; written once, so that a
  resumed prepare reads the same file."""
  path = os.path.join(out, NAMED_FOLDER, name + ".jsonl")
  if not paths.path(path).exists():
    docs = load_documents(name)
    paths.path(os.path.dirname(path)).mkdir(parents=True, exist_ok=True)
    paths.write_atomic(path, lambda f: f.writelines((json.dumps({"text": doc}) + "\n").encode() for doc in docs))
  return path


def check_resume(plan, cfg, files, out, shard_mb, sample_mb):
  now = settings(cfg, shard_mb, sample_mb)
  differ = [k for k in now if plan["settings"][k] != now[k]]
  if differ:
    k = differ[0]
    raise ValueError(f"--out {out} holds an unfinished prepare with {k}={plan['settings'][k]!r}, not {now[k]!r}; "
                     "rerun it with its settings to finish it, or choose another --out.")
  for f in plan["files"]:
    if f["path"] not in files or (paths.size(f["path"]), paths.mtime_ns(f["path"])) != (f["bytes"], f["mtime_ns"]):
      raise ValueError(f"data.source: {f['path']} is gone or changed since the unfinished prepare in {out} scanned "
                       "it; restore it, or prepare into another --out.")
  if len(files) != len(plan["files"]):
    raise ValueError(f"data.source now holds {len(files)} files, the unfinished prepare in {out} scanned "
                     f"{len(plan['files'])}; restore them, or prepare into another --out.")


def finish(out, plan, tok, log):
  """Reads back every shard's checksums and the train split's unigram counts -> DIR/manifest.json."""
  shards = [store.read_json(os.path.join(out, store.SHARDS, s["name"] + ".json")) for s in plan["shards"]]
  manifest = {"format": store.FORMAT, **{k: plan["settings"][k] for k in ("source", "doc_separator", "val_fraction")},
              "split": SPLIT_RULE, "sources": plan["files"],
              "tokenizer": {"file": tok.filename, "kind": tok.kind, "origin": plan["tokenizer_origin"],
                            "sha256": store.sha256_file(tok.path), "vocab_size": tok.vocab_size},
              "dtype": store.token_dtype(tok.vocab_size).name,
              "splits": {split: {k: sum(s[f"{split}_{k}"] for s in shards) for k in ("tokens", "docs")}
                         for split in store.SPLITS},
              "shards": shards}
  store.verify(out, manifest)
  counts = np.zeros(tok.vocab_size, np.int64)
  for s in shards:  # one shard in memory at a time (read, not memory-mapped: --out may be in a bucket)
    with paths.path(os.path.join(out, store.SHARDS, s["name"] + ".train.npy")).open("rb") as f:
      tokens = np.load(f)
    for start in range(0, len(tokens), 1 << 24):  # bincount's int64 copy: 16M tokens at a time
      counts += np.bincount(tokens[start:start + (1 << 24)], minlength=tok.vocab_size)
  manifest["unigram_entropy"] = count_entropy(counts)
  store.write_json(os.path.join(out, store.MANIFEST), manifest)
  return manifest


def prepare(cfg, out, workers=1, shard_mb=64.0, sample_mb=64.0, log=print):
  """Writes (or finishes) the token store of cfg.data at `out` -> its manifest."""
  d, out = cfg.data, paths.absolute(out)
  plan = check_out(out)
  if store.is_store(d.source):
    raise ValueError(f"data.source={d.source!r} is a token store already: train on it directly; prepare reads "
                     ".txt / .jsonl / .parquet files or folders, or a named source.")
  named = d.source.strip() in NAMED_SOURCES
  fresh = named and plan is None and not paths.path(out).exists()  # removed again if the plan fails
  files = [named_source_file(out, d.source.strip())] if named else resolve_files(d.source)
  started = time.perf_counter()
  # One pool for both passes; spawned, as a fork of a process that imported JAX is unsafe.
  with multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else _nothing() as pool:
    if plan is None:
      with removed_on_error(out if fresh else None):
        plan = make_plan(cfg, out, files, pool, shard_mb, sample_mb, log)
    else:
      check_resume(plan, cfg, files, out, shard_mb, sample_mb)
      log(f"resuming the prepare in {out}")
    paths.path(os.path.join(out, store.SHARDS)).mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(find_tokenizer(out))
    dtype = store.token_dtype(tok.vocab_size)
    folder = paths.path(os.path.join(out, store.SHARDS))  # in a bucket: there once it holds a file
    done = {f.name for f in folder.iterdir()} if folder.is_dir() else set()  # one listing, not one per shard
    pending = [s for s in plan["shards"] if s["name"] + ".json" not in done]
    total = sum(s["bytes"] for s in plan["shards"])
    tasks = [(out, plan["files"], plan["settings"]["doc_separator"], dtype.name, s) for s in pending]
    with progress.counter(total, f"tokenise {len(plan['shards'])} shards", unit="B", unit_scale=True,
                          initial=total - sum(s["bytes"] for s in pending)) as bar:
      for record in pool.imap_unordered(tokenise_shard, tasks) if pool else map(tokenise_shard, tasks):
        bar.update(record["source_bytes"])
  manifest = finish(out, plan, tok, log)
  seconds = time.perf_counter() - started
  log(f"{out}: {manifest['splits']['train']['tokens']:,} train / {manifest['splits']['val']['tokens']:,} val "
      f"tokens ({dtype.name}) in {len(plan['shards'])} shards; {total / 2**20 / seconds:.1f} MB/s of text "
      f"with {workers} worker(s) ({seconds:.1f} s)")
  return manifest


class _nothing:
  """`with ... as pool` without a pool: the work runs in this process."""
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def verify(out):
  manifest, _ = store.open_store(out)
  store.verify(out, manifest)
  print(f"{out}: {len(manifest['shards'])} shards match their checksums")


def check_visible(out):
  """On a process other than 0, once process 0 has written the store: it must be visible here too."""
  try:
    manifest, _ = store.open_store(out)
  except (ValueError, OSError) as e:
    raise ValueError(f"process {jax.process_index()} does not see the store process 0 wrote at {out} ({e}); write it "
                     "where every host reads it: a shared file system or a bucket (gs://..., or its FUSE mount).") from None
  print(f"process {jax.process_index()}: {out} holds the finished store of process 0 ({len(manifest['shards'])} shards)")


FLAGS = [cli.CONFIG._replace(default=None, help="config file (data.*, model.vocab_size); --config.a.b=v overrides a field"),
         cli.Flag("out", str, cli.REQUIRED, "the store's folder: new, or an unfinished store to resume"),
         cli.Flag("workers", int, os.cpu_count(), "tokenising processes", lambda n: n >= 1, ">= 1"),
         cli.Flag("shard_mb", float, 64.0, "text per shard, in MB", lambda x: x > 0, "> 0"),
         cli.Flag("sample_mb", float, 64.0, "text the tokenizer is trained on, in MB", lambda x: x > 0, "> 0"),
         cli.Flag("verify", bool, False, "check the finished store at --out against its checksums, and stop")
         ] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    if args.verify:
      distributed.on_primary("verify", lambda: verify(args.out), *cli.EXPECTED)
      return
    if args.config is None:
      raise ValueError("missing --config (see --help).")
    distributed.on_primary("prepare", lambda: prepare(args.config, args.out, args.workers, args.shard_mb, args.sample_mb), *cli.EXPECTED)
    if not distributed.is_primary():
      check_visible(args.out)


if __name__ == "__main__":
  main()
