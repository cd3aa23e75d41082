"""python -m latent_jax.export --workdir DIR --out DIR2 [--step=N] [--dtype=bfloat16]

Writes a params-only Orbax checkpoint in the inference dtype (default: the model's compute
dtype) to DIR2/params, with DIR2/config.json and DIR2/tokenizer.model (or .json) beside it; generate
and eval load DIR2 like a workdir. DIR2/export.json records the workdir and step it came from (eval names
them). Optimiser state and training-only parameters (the NITP projector, the MTP block) are left out, and
the saved config has nitp/mtp disabled to match.
"""
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from latent_jax.config import DTYPES
from latent_jax import cli, distributed, paths
from latent_jax import checkpoint
from latent_jax.infer import load


def export(workdir, out, step=None, dtype=None):
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"--dtype={dtype}: use one of {DTYPES}.")
  if paths.path(out).exists():
    raise FileExistsError(f"--out {out!r} exists; choose a new folder (export never overwrites).")
  cli.writable_dir(out, "--out")
  distributed.barrier("export: --out checked")  # before process 0 creates it
  def read(step):
    cfg, step = checkpoint.load_config(workdir, step)
    return cfg, step, load.load_params(workdir, cfg, step)[1]  # the inference model's params only
  cfg, step, params = checkpoint.read_newest(workdir, step, read)
  cfg = load.inference_config(cfg)
  dtype = dtype or cfg.model.dtype
  params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
  cfg.model.param_dtype = dtype
  cfg.model.allow_bf16_params = dtype == "bfloat16"  # an inference copy: no optimiser updates it
  tokenizer = checkpoint.load_tokenizer(workdir, cfg)
  # An export of an export keeps the first one's origin; eval names it.
  origin = load.read_origin(workdir) if checkpoint.is_export(workdir) else {"workdir": paths.absolute(workdir), "step": step}
  distributed.on_primary("export folder", lambda: paths.path(out).mkdir(parents=True), OSError)
  ckptr = ocp.StandardCheckpointer()  # every process saves its shards; Orbax writes each array once
  ckptr.save(paths.absolute(os.path.join(out, "params")), params)
  ckptr.wait_until_finished()
  distributed.on_primary("export config", lambda: load.write_beside(out, cfg, tokenizer, origin), OSError)
  return out


FLAGS = [cli.Flag("workdir", str, cli.REQUIRED, "a run's workdir"),
         cli.Flag("out", str, cli.REQUIRED, "the export folder, which must not exist yet"), cli.STEP,
         cli.Flag("dtype", str, None, "the parameters' dtype; the model's compute dtype when not given",
                  lambda d: d in DTYPES, f"one of {', '.join(DTYPES)}")] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    out = export(args.workdir, args.out, args.step, args.dtype)
    if distributed.is_primary():
      print(f"exported to {out}")


if __name__ == "__main__":
  main()
