"""Token streams, packing into fixed-length rows, and the Grain input pipeline.

Each split is one stream: every document's tokens followed by EOS, concatenated. Row `i`
of length `seq_len` is cut from the window `stream[i*seq_len : i*seq_len + seq_len + 1]`
(consecutive windows share one token), and becomes

  inputs      = window[:-1]                               int32 [rows, seq_len]
  targets     = window[1:]                                (-1 = not scored)
  segment_ids = 1 for the first document piece in the row, +1 after each EOS input (the
                EOS belongs to the document it ends); 0 = padding
  positions   = position within the segment, 0 at the row start and after each EOS

Attention is meant to stay within a segment, so a document cut by a row boundary
restarts at position 0 in the next row.

Training: `make_train_iterator` builds

  MapDataset.range(windows).shuffle(seed).repeat()   # window indices, reshuffled every epoch
      .batch(batch_size)[start:]                     # the global batches, as indices
      .map(the windows of `rows` only -> pack_rows).to_iter_dataset()

Row r of global batch k is element k*batch_size + r of the shuffled stream, whatever the number
of hosts; a host reads only the rows its devices hold (`rows`, from the batch sharding:
sharding.process_rows), and hosts whose devices hold replicas of the same rows (a tensor
axis across hosts) read the same ones. So the data position is one number, the batches read so
far: a checkpoint needs no iterator state, and a run resumes on any number of hosts and any mesh
(`start` = the steps taken in the current phase).

Validation: `make_val_batches` covers the validation stream once, in order; padding
has targets -1, so every real token after the first is scored exactly once. It too builds
only the rows `rows` names.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import grain
import numpy as np

from latent_jax import paths
from latent_jax.data import store
from latent_jax.data.corpus import NAMED_SOURCES, load_documents, resolve_files, split_documents
from latent_jax.data.tokenizer import Tokenizer, load_or_train_tokenizer, store_tokenizer

FEATURES = ("inputs", "targets", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class Data:
  """The tokenised corpus: what the training loop, eval and the README need."""
  tokenizer: Tokenizer
  train_tokens: np.ndarray      # int32 [n_train], documents each followed by EOS; from a store,
  val_tokens: np.ndarray        # [n_val]  a ShardedTokens (lazy, sliceable, uint16 / uint32)
  num_docs: dict[str, int]      # {"train": ..., "val": ...}
  unigram_entropy: float        # nats / token of the training stream's unigram model


# ----------------------------------------------------------------------------- packing


def token_stream(docs_ids: list[list[int]], eos_id: int) -> np.ndarray:
  """Concatenates tokenised documents, each followed by EOS: int32 [sum(len) + n_docs]."""
  lengths = np.array([len(d) + 1 for d in docs_ids], np.int64)
  stream = np.full(int(lengths.sum()), eos_id, np.int32)
  ends = np.cumsum(lengths)
  for ids, end in zip(docs_ids, ends):
    stream[end - 1 - len(ids):end - 1] = ids
  return stream


def num_windows(stream_len: int, seq_len: int) -> int:
  """Full (unpadded) windows of seq_len + 1 tokens with stride seq_len."""
  return max(0, (stream_len - 1) // seq_len)


def pack_rows(windows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
  """windows int [rows, seq_len + 1] -> the four int32 features, each [rows, seq_len]."""
  windows = np.asarray(windows, np.int32)
  inputs, targets = windows[..., :-1], windows[..., 1:]
  is_end = (inputs == eos_id).astype(np.int32)
  # A new segment starts at t = 0 and right after an EOS input.
  segment_ids = 1 + np.cumsum(is_end, axis=-1) - is_end
  idx = np.broadcast_to(np.arange(inputs.shape[-1], dtype=np.int32), inputs.shape)
  starts = np.zeros_like(is_end)
  starts[..., 1:] = is_end[..., :-1]
  starts[..., 0] = 1
  positions = idx - np.maximum.accumulate(np.where(starts == 1, idx, 0), axis=-1)
  return {"inputs": inputs, "targets": targets,
          "segment_ids": segment_ids.astype(np.int32), "positions": positions.astype(np.int32)}


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """Entropy (nats / token) of the empirical unigram distribution: a floor to beat."""
  return count_entropy(np.bincount(tokens, minlength=vocab_size))


def count_entropy(counts: np.ndarray) -> float:
  """Entropy (nats) of the distribution proportional to `counts`."""
  counts = np.asarray(counts, np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------- train


def _check_shape(seq_len: int, batch_size: int, rows=None):
  if seq_len < 2:
    raise ValueError(f"data.seq_len={seq_len} must be at least 2 (an input and a target).")
  if batch_size < 1:
    raise ValueError(f"data.batch_size={batch_size} must be positive: it is the global batch.")
  if rows is not None and not (len(rows) and 0 <= min(rows) and max(rows) < batch_size):
    raise ValueError(f"rows {list(rows)[:8]}... must be row indices in [0, data.batch_size={batch_size}).")


def _local_rows(batch_size, rows):
  return np.arange(batch_size) if rows is None else np.asarray(rows)


def _check_fits(n_tokens: int, seq_len: int, batch_size: int):
  windows = num_windows(n_tokens, seq_len)
  if windows < batch_size:
    raise ValueError(
        f"The training split has {n_tokens} tokens, {windows} rows of data.seq_len="
        f"{seq_len}, fewer than one batch of data.batch_size={batch_size}; lower "
        "data.batch_size or data.seq_len, or add text to data.source.")


def _shuffle_seed(seed: int) -> int:
  # Grain reshuffles epoch e with seed + e; mixing the seed first keeps seed 1's first
  # epoch from being seed 0's second.
  return int(np.random.SeedSequence(int(seed)).generate_state(1)[0])


def make_train_iterator(data: Data, seq_len: int, batch_size: int, seed: int, rows=None, start: int = 0):
  """An endless, seeded iterator of training batches, from batch `start` on: of each global batch
  of `batch_size` rows, the rows `rows` (sorted indices; None = all), which this host's devices hold.

  Yields {"inputs", "targets", "segment_ids", "positions"}: int32 [len(rows), seq_len].
  """
  stream = data.train_tokens
  _check_shape(seq_len, batch_size, rows)
  _check_fits(len(stream), seq_len, batch_size)
  eos_id, rows = data.tokenizer.eos_id, _local_rows(batch_size, rows)

  def windows(indices):
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in indices[rows]])

  ds = grain.MapDataset.range(num_windows(len(stream), seq_len))
  ds = ds.shuffle(seed=_shuffle_seed(seed)).repeat()
  ds = ds.batch(batch_size, drop_remainder=True)[start:]  # window indices: cheap, whatever the batch
  ds = ds.map(lambda indices: pack_rows(windows(indices), eos_id))
  # A couple of threads are plenty (a batch takes microseconds) and leave the CPU cores
  # to the training step.
  read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
  return iter(ds.to_iter_dataset(read_options=read))


# ----------------------------------------------------------------------------- val


def val_batch_count(n_tokens: int, seq_len: int, batch_size: int) -> int:
  """Batches that cover a validation stream of `n_tokens` once (the last one padded)."""
  rows = -(-(n_tokens - 1) // seq_len)  # windows of seq_len + 1 tokens, stride seq_len
  return -(-rows // batch_size)


def make_val_batches(data: Data, seq_len: int, batch_size: int, max_batches: int = 0, rows=None):
  """The validation stream once, in order: a list of batches, of each the rows `rows` (sorted
  indices into the global batch, which this host's devices hold; None = all).

  The last window and the last batch are padded (inputs pad_id, targets -1,
  segment_ids 0, positions 0). `max_batches > 0` keeps only the first batches.
  """
  _check_shape(seq_len, batch_size, rows)
  stream, pad, rows = data.val_tokens, data.tokenizer.pad_id, _local_rows(batch_size, rows)
  n = len(stream)
  n_batches = val_batch_count(n, seq_len, batch_size)
  if max_batches > 0:
    n_batches = min(n_batches, max_batches)
  starts = (np.arange(n_batches)[:, None] * batch_size + rows).reshape(-1, 1) * seq_len
  g = starts + np.arange(seq_len + 1)  # stream position of each window token, this host's rows only
  window = np.append(np.asarray(stream[:min(n, g.max() + 1)], np.int32), pad)  # never empty
  packed = pack_rows(np.where(g < n, window[np.minimum(g, len(window) - 1)], pad), data.tokenizer.eos_id)
  real_input, real_target = g[:, :-1] < n, g[:, 1:] < n
  packed["targets"] = np.where(real_target, packed["targets"], -1).astype(np.int32)
  packed["segment_ids"] = np.where(real_input, packed["segment_ids"], 0).astype(np.int32)
  packed["positions"] = np.where(real_input, packed["positions"], 0).astype(np.int32)
  local = len(rows)
  return [{k: v[b * local:(b + 1) * local] for k, v in packed.items()} for b in range(n_batches)]


# ----------------------------------------------------------------------------- build

MAX_TEXT_GIB = 1.0  # data.max_text_gib of configs saved before it existed


def check_text_source(data_cfg, process_count: int):
  """Refuse text files that training would read and tokenise in memory on every host at every start:
  on several processes (each would hold and tokenise the whole corpus), or above data.max_text_gib.
  The embedded corpora (a few MB) and token stores pass. Stats the files only: nothing is read."""
  source = data_cfg.source.strip()
  if source in NAMED_SOURCES or store.is_store(source):
    return
  prepare = (f"tokenise it once into a token store, python -m latent_jax.prepare --config CONFIG --out DIR "
             f"--config.data.source={source}, then train with --config.data.source=DIR (docs/data.md)")
  if process_count > 1:
    raise ValueError(f"data.source={source} is text, which each of the {process_count} processes would read and "
                     f"tokenise whole at every start; {prepare}, running prepare on every host with the same "
                     "multi-host flags (process 0 writes the store).")
  limit = data_cfg.get("max_text_gib", MAX_TEXT_GIB)
  size = sum(paths.size(f) for f in resolve_files(source))
  if size > limit * 2**30:
    raise ValueError(f"data.source={source} holds {size / 2**30:.3g} GiB of text files, above data.max_text_gib="
                     f"{limit:g}, the most that training tokenises in memory at every start; {prepare}, or raise "
                     "data.max_text_gib.")


def build_data(cfg, workdir: str, source: Tokenizer | None = None) -> Data:
  """Corpus -> document split -> tokenizer (given, the workdir's, train.init_from's `source`, or
  trained) -> token streams; or a token store's streams, opened lazily. Writes nothing:
  `save_tokenizer` does, once the caller's checks pass."""
  d = cfg.data
  _check_shape(d.seq_len, d.batch_size)  # before anything heavy
  if store.is_store(d.source):
    return open_store_data(cfg, workdir, source)
  docs = load_documents(d.source, d.get("doc_separator", ""))
  train_docs, val_docs = split_documents(docs, d.val_fraction)
  tok = load_or_train_tokenizer(d, cfg.model.vocab_size, workdir, train_docs, source)
  # Re-tokenising a small corpus is cheap (the KJV: ~1 s); a large one is prepared once into a store.
  train = token_stream(tok.encode_batch(train_docs), tok.eos_id)
  val = token_stream(tok.encode_batch(val_docs), tok.eos_id)
  _check_fits(len(train), d.seq_len, d.batch_size)
  return Data(tokenizer=tok, train_tokens=train, val_tokens=val,
              num_docs={"train": len(train_docs), "val": len(val_docs)},
              unigram_entropy=unigram_entropy(train, tok.vocab_size))


def open_store_data(cfg, workdir: str, source: Tokenizer | None = None) -> Data:
  """A token store's streams (read on demand) and tokenizer, checked against the config."""
  d, directory = cfg.data, paths.expand(cfg.data.source)
  if paths.is_url(directory):  # a ranged request per window would cost a round trip per row
    raise ValueError(f"data.source: training reads a token store's shards a window at a time (pread), which needs a "
                     f"file system: mount the bucket (e.g. gcsfuse --implicit-dirs BUCKET /mnt/BUCKET, on every host) and set data.source to "
                     f"the store's path under the mount, not {directory} (docs/data.md).")
  manifest, streams = store.open_store(directory)
  for field in ("val_fraction", "doc_separator"):
    if manifest[field] != d.get(field, ""):
      raise ValueError(f"data.{field}={d.get(field, '')!r}, but the store {directory} was prepared with "
                       f"{manifest[field]!r}; set data.{field}={manifest[field]!r}, or prepare the store again.")
  path = os.path.join(directory, manifest["tokenizer"]["file"])
  proto = paths.path(path).read_bytes()
  if hashlib.sha256(proto).hexdigest() != manifest["tokenizer"]["sha256"]:
    raise ValueError(f"{path} is not the tokenizer the store was made with (checksum mismatch); prepare the "
                     "store again.")
  tok = store_tokenizer(proto, directory, d, cfg.model.vocab_size, workdir, source)
  _check_fits(streams["train"].size, d.seq_len, d.batch_size)
  return Data(tokenizer=tok, train_tokens=streams["train"], val_tokens=streams["val"],
              num_docs={split: manifest["splits"][split]["docs"] for split in store.SPLITS},
              unigram_entropy=manifest["unigram_entropy"])


def save_tokenizer(data: Data, workdir: str):
  """Creates the workdir and writes its tokenizer file (tokenizer.model / .json) when the tokenizer is new to it."""
  paths.path(workdir).mkdir(parents=True, exist_ok=True)
  if data.tokenizer.new:
    data.tokenizer.save()
