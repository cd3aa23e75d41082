"""A token store: a corpus tokenised once by `python -m latent_jax.prepare`, read lazily by training.

  DIR/manifest.json           written last: its presence means the store is finished
  DIR/tokenizer.{model,json}  the tokenizer that made the ids (SentencePiece / Hugging Face)
  DIR/plan.json               the shards, each a run of source documents (so prepare can resume)
  DIR/shards/NNNNN.json       a shard's counts and checksums; written after its arrays, so a shard
                              with a .json is complete
  DIR/shards/NNNNN.{train,val}.npy        uint16 / uint32 [tokens]: that split's documents of the
                                          shard, each followed by EOS
  DIR/shards/NNNNN.{train,val}.docs.npy   int64 [documents]: where each document ends (exclusive)

A split's stream is its shards' arrays concatenated in shard order, which is corpus order, so it
is exactly the stream `token_stream` builds in memory from the same documents (pipeline.py).
The arrays are plain .npy files: a training window is a slice, read on demand with one `pread`
(not memory-mapped: see ShardedTokens), so memory and start-up do not grow with the corpus, and
each host reads only its own rows. (ArrayRecord would add a dependency and a record per document
or window, with a decode per read; windows cut across documents are simpler as slices of a flat
array.) Token ids take the narrowest dtype that holds the vocabulary.

Opening a store checks that every shard file is there at its recorded size (cheap);
the full checksums are read by `python -m latent_jax.prepare --verify --out DIR`, and at the end
of every prepare.

DIR may be in a bucket (`gs://...`, paths.py) for prepare and --verify; training preads windows
of the shard files, so it reads a bucket's store through a file system mount (docs/data.md).
"""
from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np

from latent_jax import paths

MANIFEST, PLAN, SHARDS = "manifest.json", "plan.json", "shards"
FORMAT = "latent_jax token store 1"
SPLITS = ("train", "val")


def is_store(source: str) -> bool:
  """Whether data.source names a token store (finished or not)."""
  path = paths.path(source)
  return path.is_dir() and any((path / f).is_file() for f in (MANIFEST, PLAN))


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_files(name: str) -> dict[str, str]:
  """{role: file name in shards/} of shard `name`."""
  return {f"{split}{part}": f"{name}.{split}{part}.npy" for split in SPLITS for part in ("", ".docs")}


# ----------------------------------------------------------------------------- writing


def write_json(path: str, value):
  paths.write_atomic(path, lambda f: f.write(json.dumps(value, indent=1).encode()))


def read_json(path: str):
  return json.loads(paths.path(path).read_bytes())


def sha256_file(path: str) -> str:
  with paths.path(path).open("rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def write_shard(directory: str, name: str, streams: dict[str, np.ndarray], doc_ends: dict[str, np.ndarray],
                info: dict) -> dict:
  """Writes shard `name`'s arrays, then its .json (counts, sizes, sha256 per file) -> that record.
  (The checksums are of the bytes written; `verify` reads the files back.)"""
  folder = os.path.join(directory, SHARDS)
  arrays = {**streams, **{f"{k}.docs": v for k, v in doc_ends.items()}}
  record = {"name": name, **info, "files": {}}
  for role, file in shard_files(name).items():
    buffer = io.BytesIO()
    np.save(buffer, arrays[role])
    data = buffer.getbuffer()
    paths.write_atomic(os.path.join(folder, file), lambda f, d=data: f.write(d))
    record["files"][file] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
  for split in SPLITS:
    record[f"{split}_tokens"], record[f"{split}_docs"] = len(streams[split]), len(doc_ends[split])
  write_json(os.path.join(folder, f"{name}.json"), record)
  return record


def verify(directory: str, manifest: dict):
  """Every shard file's sha256 against the manifest; a one-line error naming the first that differs."""
  for shard in manifest["shards"]:
    for file, expected in shard["files"].items():
      path = os.path.join(directory, SHARDS, file)
      if sha256_file(path) != expected["sha256"]:
        raise ValueError(
            f"{path}: checksum mismatch, the shard is damaged; delete {os.path.join(directory, MANIFEST)} and "
            f"{os.path.join(directory, SHARDS, shard['name'] + '.json')}, then rerun python -m latent_jax.prepare "
            f"with --out {directory}: it writes that shard again.")


# ----------------------------------------------------------------------------- reading


class ShardedTokens:
  """One split's token stream over its shard files, read on demand.

  Supports len(), `.size`, contiguous slices (which read only what they cover) and np.asarray
  (which reads it all: for small streams). Pickles as its file names. A slice is read with
  `os.preadv` into a fresh array, each file opened for the read: not memory-mapped, since a map
  keeps every page it touched resident, and the kernel maps a whole page-cache folio (up to
  megabytes) around each random window, so a training's RSS would grow towards the store's size;
  and no file stays open, so a store of any number of shards needs no more file descriptors.
  """

  def __init__(self, paths: list[str], lengths: list[int], dtype: np.dtype):
    self.paths, self.lengths, self.dtype = list(paths), list(lengths), np.dtype(dtype)
    self.ends = np.cumsum(np.asarray(self.lengths, np.int64))
    self.size = int(self.ends[-1]) if len(self.ends) else 0
    self.shape = (self.size,)
    self._offsets: dict[int, int] = {}  # shard -> where its tokens start in the file (after the .npy header)

  def __len__(self) -> int:
    return self.size

  def offset(self, i: int) -> int:
    """Where shard i's tokens start in its file; its .npy header is checked on first use."""
    if i not in self._offsets:
      path = self.paths[i]
      try:
        with open(path, "rb") as f:
          version = np.lib.format.read_magic(f)
          header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
          shape, _, dtype = header(f)
          offset = f.tell()
      except (OSError, ValueError) as e:
        raise unreadable(path, e) from None
      if dtype != self.dtype or shape != (self.lengths[i],):
        raise ValueError(f"{path}: holds {dtype} {shape}, but the manifest says {self.dtype} "
                         f"({self.lengths[i]},); the store is damaged: prepare it again.")
      self._offsets[i] = offset
    return self._offsets[i]

  def read(self, i: int, start: int, out: np.ndarray):
    """Tokens start .. start + len(out) of shard i into `out`."""
    view, at = memoryview(out).cast("B"), self.offset(i) + start * self.dtype.itemsize
    try:
      fd = os.open(self.paths[i], os.O_RDONLY)
      try:
        while view.nbytes:  # a read may return less than asked
          got = os.preadv(fd, [view], at)
          if not got:
            raise EOFError("the file ends early")
          view, at = view[got:], at + got
      finally:
        os.close(fd)
    except (OSError, EOFError) as e:
      raise unreadable(self.paths[i], e) from None

  def __getitem__(self, key):
    if not isinstance(key, slice) or key.step not in (None, 1):
      raise TypeError("ShardedTokens supports contiguous slices only.")
    start, stop, _ = key.indices(self.size)
    out = np.empty(max(0, stop - start), self.dtype)
    i, at = int(np.searchsorted(self.ends, start, side="right")), 0
    while start < stop:
      first = int(self.ends[i - 1]) if i else 0
      end = min(stop, int(self.ends[i]))
      self.read(i, start - first, out[at:at + end - start])
      at, start, i = at + end - start, end, i + 1
    return out

  def __array__(self, dtype=None, copy=None):
    return self[:] if dtype is None else self[:].astype(dtype)


def unreadable(path: str, error: Exception) -> ValueError:
  return ValueError(f"{path}: unreadable token shard ({error}); run python -m latent_jax.prepare --verify "
                    f"--out {os.path.dirname(os.path.dirname(path))}, or prepare the store again.")


def open_store(directory: str) -> tuple[dict, dict[str, ShardedTokens]]:
  """(manifest, {"train": ShardedTokens, "val": ...}) of a finished store; every shard file present
  at its recorded size."""
  directory = paths.expand(directory)
  manifest_path = os.path.join(directory, MANIFEST)
  if not paths.path(manifest_path).is_file():
    raise ValueError(f"data.source: {directory} is an unfinished token store (no {MANIFEST}); finish it with "
                     f"python -m latent_jax.prepare --config CONFIG --out {directory} (it resumes).")
  manifest = read_json(manifest_path)
  if manifest.get("format") != FORMAT:
    raise ValueError(f"data.source: {manifest_path} is not a {FORMAT!r} manifest; prepare the store again.")
  for shard in manifest["shards"]:
    for file, expected in shard["files"].items():
      path = os.path.join(directory, SHARDS, file)
      size = paths.size(path) if paths.path(path).is_file() else None
      if size != expected["bytes"]:
        state = "is missing" if size is None else f"has {size} bytes, not {expected['bytes']}"
        raise ValueError(f"{path} {state}: the token store is damaged; prepare it again (delete "
                         f"{manifest_path} and {os.path.join(directory, SHARDS, shard['name'] + '.json')}, then rerun "
                         f"prepare with --out {directory}: it rewrites that shard).")
  dtype = np.dtype(manifest["dtype"])
  streams = {split: ShardedTokens([os.path.join(directory, SHARDS, s["name"] + f".{split}.npy")
                                   for s in manifest["shards"]], [s[f"{split}_tokens"] for s in manifest["shards"]],
                                  dtype) for split in SPLITS}
  return manifest, streams
