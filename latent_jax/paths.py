"""Paths on this machine or in a bucket (`gs://...`), through etils.epath: one code path for both.

Workdirs, data sources, tokenizers, token stores and exports are opened here. A local path
behaves as with os.path (`~` expanded, made absolute where it was); a URL is kept as it is,
where os.path would turn `gs://b/x` into the local `./gs:/b/x`. epath reads `gs://` through
fsspec and gcsfs, without TensorFlow: `pip install "latent_jax[gcs]"` (docs/data.md).

What a bucket cannot do is handled where it is done: token shards read a window at a time
(data/pipeline.py: mount the bucket with Cloud Storage FUSE), the workdir lock (train/workdir.py:
a bucket workdir is not locked) and appends (train/metrics.py).
"""
import glob as glob_lib
import os
import uuid

import fsspec
from etils import epath

SCHEMES = ("gs", "s3", "az", "hf")  # the URLs epath opens through fsspec
_PACKAGES = {"gs": 'gcsfs: pip install "latent_jax[gcs]"', "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}


def is_url(p) -> bool:
  return "://" in os.fspath(p)


def expand(p) -> str:
  """`p` as a str: a local path with `~` expanded, or a URL of SCHEMES whose file system is
  installed (else a one-line error naming the package)."""
  p = os.fspath(p).strip()
  if not is_url(p):
    return os.path.expanduser(p)
  scheme = p.split("://", 1)[0]
  if scheme not in SCHEMES:
    raise ValueError(f"{p}: {scheme}:// is not a path this library opens; use a local path or gs://bucket/... "
                     f"({', '.join(s + '://' for s in SCHEMES)} through etils.epath).")
  try:
    fsspec.get_filesystem_class(scheme)
  except ImportError:
    raise ValueError(f"{p}: {scheme}:// paths need {_PACKAGES[scheme]}.") from None
  return p


def path(p) -> epath.Path:
  """expand(p) as an epath.Path, to open, list, test or remove."""
  return epath.Path(expand(p))


def absolute(p) -> str:
  """A local path absolute and normalised (Orbax wants one), a URL as it is."""
  p = expand(p)
  return p if is_url(p) else os.path.abspath(p)


def glob(pattern: str) -> list[str]:
  """The sorted matches of `pattern`; locally `**` spans folders."""
  if not is_url(pattern):
    return sorted(glob_lib.glob(os.path.expanduser(pattern), recursive=True))
  parts = pattern.split("/")
  first = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
  rest = "/".join(parts[first:])
  if "**" in rest:
    raise ValueError(f"{pattern}: ** is not supported in a bucket (every folder would be a listing request); name "
                     "the folder instead, which is searched at any depth, or use *.")
  return sorted(os.fspath(p) for p in path("/".join(parts[:first])).glob(rest))


def files_under(folder: str) -> list[str]:
  """Every file below `folder`, at any depth."""
  out, top = [], path(folder)
  for root, _, names in top.walk():
    # fsspec's walk yields a bucket's folders without their scheme: put it back.
    root = os.fspath(root)
    if is_url(folder) and not is_url(root):
      root = folder.split("://", 1)[0] + "://" + root
    out += [os.path.join(root, n) for n in names]
  return out


def size(p) -> int:
  """The file's size in bytes. (epath's stat of a local file looks up its owner's user name, which
  fails for a user id without one, as in some containers.)"""
  with path(p).open("rb") as f:
    return f.seek(0, os.SEEK_END)


def mtime_ns(p) -> int:
  """The file's modification time, in ns (a bucket keeps it to the second)."""
  return os.stat(path(p)).st_mtime_ns if not is_url(p) else path(p).stat().mtime * 10**9


def write_atomic(p, write):
  """write(file) into a temporary file beside `p`, then rename: readers (and a resumed prepare)
  see the whole file or none of it. (In a bucket the rename is a copy, and an object appears
  whole or not at all.)"""
  p = path(p)
  tmp = p.parent / f".{p.name}.{uuid.uuid4().hex[:12]}.tmp"
  try:
    with tmp.open("wb") as f:
      write(f)
    tmp.replace(p)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
