"""Peak memory of `python -m latent_jax.convert` on a random checkpoint of a recipe's shape (OLMo-3 7B's; a MoE
recipe's as FlexOlmo or OLMoE: docs/interop.md, "Memory").

  python benchmarks/convert_memory.py [--config=configs/olmo3_7b.py] [--dir=/tmp/latent_jax_convert]
      [--dtype=bfloat16] [--keep]

1. write   DIR/hf: a Hugging Face OLMo-3 folder of the recipe's model (config.json as
           latent_jax.interop.olmo3 writes it, a small byte-level BPE tokenizer.json, safetensors
           files of 5 GiB in --dtype). The values are random: windows of one pool of N(0, 0.02)
           draws at random offsets (the conversion moves bytes, it does not look at them).
2. import  python -m latent_jax.convert --hf DIR/hf --config CONFIG --out DIR/ours, in a fresh process.
3. export  python -m latent_jax.convert --workdir DIR/ours --out DIR/hf2 --dtype=DTYPE, in a fresh process.
4. check   a few tensors of DIR/hf2 equal DIR/hf's bit for bit.

One JSON line per step: seconds, and for the conversions the peak RSS of the process (wait4's
ru_maxrss) against the checkpoint's bytes. DIR is removed at the end unless --keep.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from latent_jax import cli, load_config
from latent_jax.config import DTYPES
from latent_jax.interop import hf, olmo3
from latent_jax.interop.safetensors_stream import Reader, Writer

GIB = 2**30
FLAGS = [cli.Flag("config", str, "configs/olmo3_7b.py", "the recipe whose model is converted"),
         cli.Flag("dir", str, os.path.join(tempfile.gettempdir(), "latent_jax_convert"), "the checkpoints"),
         cli.Flag("dtype", str, "bfloat16", "the checkpoint's dtype", lambda d: d in DTYPES, f"one of {DTYPES}"),
         cli.Flag("keep", bool, False, "keep DIR")]


def write_checkpoint(cfg, folder, dtype):
  """A random Hugging Face OLMo-3 folder of cfg's model; returns its tensors' bytes."""
  os.makedirs(folder)
  plan = olmo3.tensors({p: s.shape for p, s in hf.param_shapes(cfg.model).items()}, olmo3.names(cfg.model))
  writer = Writer(folder, [(name, shape, dtype) for name, _, _, _, shape in plan])
  rng = np.random.default_rng(0)
  pool = (rng.standard_normal(1 << 24) * 0.02).astype(dtype)
  for name, _, _, _, shape in plan:
    start = int(rng.integers(0, pool.size))
    writer.write(name, np.resize(np.roll(pool, -start), shape))
  writer.close()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  tok.train_from_iterator(["In the beginning God created the heaven and the earth."] * 10, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.save(os.path.join(folder, "tokenizer.json"))
  config = olmo3.hf_config(cfg.model, 0, -1, 1, np.dtype(dtype).name, cfg.data.seq_len)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return writer.total


def measured(args):
  """(seconds, peak RSS in bytes) of a fresh `python -m latent_jax.convert ARGS`."""
  start = time.time()
  process = subprocess.Popen([sys.executable, "-m", "latent_jax.convert", *args])
  _, status, usage = os.wait4(process.pid, 0)
  if status:
    raise SystemExit(f"convert {' '.join(args)} failed ({status})")
  return time.time() - start, usage.ru_maxrss * 1024


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    if os.path.exists(args.dir):
      raise FileExistsError(f"--dir {args.dir} exists; remove it or choose another.")
  cfg = load_config(args.config)
  dtype = np.dtype(jnp.dtype(args.dtype))
  source, ours, back = (os.path.join(args.dir, d) for d in ("hf", "ours", "hf2"))
  try:
    start = time.time()
    size = write_checkpoint(cfg, source, dtype)
    params = size // dtype.itemsize
    print(json.dumps({"step": "write", "params": params, "gib": round(size / GIB, 2),
                      "seconds": round(time.time() - start)}), flush=True)
    for step, flags in (("import", ["--hf", source, "--config", args.config, "--out", ours]),
                        ("export", ["--workdir", ours, "--out", back, f"--dtype={args.dtype}"])):
      seconds, peak = measured(flags)
      print(json.dumps({"step": step, "peak_rss_gib": round(peak / GIB, 2), "checkpoint_gib": round(size / GIB, 2),
                        "peak_over_checkpoint": round(peak / size, 3), "seconds": round(seconds)}), flush=True)
    a, b = Reader(source), Reader(back)
    last = f"model.layers.{cfg.model.num_layers - 1}."
    names = [n for n in a.tensors if n.startswith(("model.embed", "lm_head", "model.norm", "model.layers.0.", last))]
    assert all(a.read(n).tobytes() == b.read(n).tobytes() for n in names)
    print(json.dumps({"step": "check", "tensors_equal": len(names)}), flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()
