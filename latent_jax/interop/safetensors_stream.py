"""Safetensors files read and written one tensor at a time, so that converting a checkpoint holds a
tensor in memory, never the model.

The format: an 8-byte little-endian header length N, N bytes of JSON header {name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}} (offsets from the end of the header),
then the tensors' bytes, contiguous. A checkpoint of several files lists them in
`model.safetensors.index.json` ({"weight_map": {name: file}}), as Hugging Face writes them.
"""
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
CHUNK = 1 << 30  # bytes per read or write call (Linux moves at most ~2 GiB in one)


def read_header(path):
  """{name: (dtype, shape, begin, end)} of one file, offsets absolute; an error naming the file when
  it is not a whole safetensors file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 2 <= n <= size - 8:
      raise ValueError(f"{path} is not a safetensors file (no header); copy the checkpoint's files again.")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise ValueError(f"{path} has a damaged safetensors header; copy the checkpoint's files again.") from None
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    if entry["dtype"] not in DTYPES:
      raise ValueError(f"{path}: tensor {name!r} is {entry['dtype']}; only {', '.join(DTYPES)} convert.")
    dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
    begin, end = (8 + n + o for o in entry["data_offsets"])
    if end - begin != math.prod(shape) * dtype.itemsize or end > size:
      raise ValueError(f"{path}: tensor {name!r} {list(shape)} {entry['dtype']} does not fit its bytes "
                       f"({end - begin} at {begin}, file {size}); the file is truncated or damaged.")
    out[name] = (dtype, shape, begin, end)
  return out


class Reader:
  """The tensors of a checkpoint folder: `model.safetensors`, or the files its index names."""

  def __init__(self, folder):
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
      try:
        files = sorted(set(json.load(open(index))["weight_map"].values()))
      except (json.JSONDecodeError, KeyError, AttributeError):
        raise ValueError(f"{index} has no weight_map of tensor names to files; copy the checkpoint again.") from None
    elif os.path.isfile(os.path.join(folder, SINGLE)):
      files = [SINGLE]
    else:
      raise FileNotFoundError(f"{folder} has neither {SINGLE} nor {INDEX}; give a Hugging Face checkpoint folder.")
    self.tensors = {}  # name -> (path, dtype, shape, begin, end)
    for name in files:
      path = os.path.join(folder, name)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{index} names {name}, which is missing from {folder}.")
      self.tensors.update({k: (path, *v) for k, v in read_header(path).items()})

  def shape(self, name):
    return self.tensors[name][2]

  def dtype(self, name):
    return self.tensors[name][1]

  def read(self, name):
    """One tensor, read from its file into a fresh array."""
    path, dtype, shape, begin, end = self.tensors[name]
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb", buffering=0) as f:
      f.seek(begin)
      done = 0
      while done < end - begin:
        got = f.readinto(view[done:done + CHUNK])
        if not got:
          raise ValueError(f"{path}: tensor {name!r} ends early; the file is truncated.")
        done += got
    return out


class Writer:
  """A checkpoint laid out in advance from every tensor's (name, shape, dtype), in files of at most
  `max_file_bytes` (one tensor may exceed it alone); then `write(name, array)` in any order, and `close()`."""

  def __init__(self, folder, specs, max_file_bytes=5 * 2**30):
    groups, size = [[]], 0
    for name, shape, dtype in specs:
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      if groups[-1] and size + nbytes > max_file_bytes:
        groups.append([])
        size = 0
      groups[-1].append((name, tuple(shape), np.dtype(dtype)))
      size += nbytes
    names = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                               for i in range(len(groups))]
    self.folder, self.places, self.pending = folder, {}, set()
    self.weight_map, self.total = {}, 0
    for file, group in zip(names, groups):
      header, offset = {"__metadata__": {"format": "pt"}}, 0
      for name, shape, dtype in group:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
      raw = json.dumps(header, separators=(",", ":")).encode()
      raw += b" " * (-(8 + len(raw)) % 8)  # the tensors start 8-byte aligned
      path = os.path.join(folder, file)
      with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
      for name, shape, dtype in group:
        begin = 8 + len(raw) + header[name]["data_offsets"][0]
        self.places[name] = (path, shape, dtype, begin)
        self.weight_map[name] = file
      self.total += offset
      self.pending |= {name for name, _, _ in group}
    self.files = names

  def write(self, name, array):
    path, shape, dtype, begin = self.places[name]
    if array.shape != shape or array.dtype != dtype:
      raise ValueError(f"tensor {name!r} is {array.shape} {array.dtype}, laid out as {shape} {dtype}")
    view = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    with open(path, "r+b", buffering=0) as f:
      f.seek(begin)
      done = 0
      while done < len(view):
        done += f.write(view[done:done + CHUNK])
    self.pending.discard(name)

  def close(self):
    """The index file (several files); every tensor laid out must have been written."""
    if self.pending:
      raise RuntimeError(f"tensors laid out but never written: {sorted(self.pending)[:5]}")
    if len(self.files) > 1:
      with open(os.path.join(self.folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f, indent=2)
