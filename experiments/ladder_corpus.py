"""The CPU ladder's corpus: text that installs offline on any Debian machine, as JSONL documents.

  apt-get install -y dict-gcide python3.11-doc python3.11     # the sources (Debian bookworm)
  python experiments/ladder_corpus.py --out data/ladder_text   # -> gcide.jsonl, pydoc.jsonl, stdlib.jsonl
  python -m latent_jax.prepare --config configs/ladder_cpu.py --out data/ladder_store   # the token store

Three sources (docs/ladder.md):
  gcide   the GNU Collaborative International Dictionary of English (/usr/share/dictd/gcide.dict.dz),
          cut at entry boundaries into documents of about DOC_BYTES
  pydoc   the Python documentation's reStructuredText sources (/usr/share/doc/python3.11/html/_sources),
          one document a page
  stdlib  the Python standard library's source as Debian ships it (/usr/lib/python3.11, *.py, no
          dist-packages), one document a file
Documents are written in a sorted, fixed order, so the same packages give the same files.
"""
import argparse
import glob
import gzip
import json
import os

GCIDE = "/usr/share/dictd/gcide.dict.dz"
PYDOC = "/usr/share/doc/python3.11/html/_sources"
STDLIB = "/usr/lib/python3.11"
DOC_BYTES = 8192  # a dictionary document: whole entries up to about this size


def gcide_documents(path=GCIDE):
  """Dictionary entries (blank-line separated blocks) grouped into documents of about DOC_BYTES."""
  with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
    text = f.read()
  # The database header (00-database-*) and the per-letter licence banners are not entries.
  blocks = [b.strip("\n") for b in text.split("\n\n") if b.strip() and not b.lstrip().startswith("00-database")]
  doc, size = [], 0
  for block in blocks:
    doc.append(block)
    size += len(block) + 2
    if size >= DOC_BYTES:
      yield "\n\n".join(doc)
      doc, size = [], 0
  if doc:
    yield "\n\n".join(doc)


def files_documents(pattern, exclude=()):
  """One document per file matched by `pattern` (sorted), skipping paths containing any of `exclude`."""
  for path in sorted(glob.glob(pattern, recursive=True)):
    if any(x in path for x in exclude) or not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    if text.strip():
      yield text


def write_jsonl(path, documents):
  n = size = 0
  with open(path, "w", encoding="utf-8") as f:
    for doc in documents:
      f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
      n, size = n + 1, size + len(doc.encode("utf-8"))
  print(f"{path}: {n:,} documents, {size / 1e6:.1f} MB")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder for gcide.jsonl, pydoc.jsonl and stdlib.jsonl")
  args = parser.parse_args()
  missing = [p for p in (GCIDE, PYDOC, STDLIB) if not os.path.exists(p)]
  if missing:
    raise SystemExit(f"error: {', '.join(missing)} not found; install them with "
                     "apt-get install -y dict-gcide python3.11-doc python3.11")
  os.makedirs(args.out, exist_ok=True)
  write_jsonl(os.path.join(args.out, "gcide.jsonl"), gcide_documents())
  write_jsonl(os.path.join(args.out, "pydoc.jsonl"), files_documents(os.path.join(PYDOC, "**", "*.txt")))
  write_jsonl(os.path.join(args.out, "stdlib.jsonl"),
              files_documents(os.path.join(STDLIB, "**", "*.py"), exclude=("dist-packages", "site-packages")))


if __name__ == "__main__":
  main()
