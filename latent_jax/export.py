"""python -m latent_jax.export --workdir DIR --out DIR2 [--step=N] [--dtype=bfloat16]

Writes a params-only Orbax checkpoint in the inference dtype (default: the model's compute
dtype) to DIR2/params, with DIR2/config.json and DIR2/tokenizer.model beside it; generate and
eval load DIR2 like a workdir. Optimiser state and training-only parameters (the NITP projector,
the MTP block) are left out, and the saved config has nitp/mtp disabled to match.
"""
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from latent_jax.config import DTYPES, parse_cli
from latent_jax.infer import load
from latent_jax.train import checkpoint


def export(workdir, out, step=None, dtype=None):
  cfg, step = load.load_config(workdir, step)
  _, params = load.load_params(workdir, cfg, step)  # the inference model's params only
  cfg = load.inference_config(cfg)
  dtype = dtype or cfg.model.dtype
  if dtype not in DTYPES:
    raise ValueError(f"--dtype={dtype}: use one of {DTYPES}.")
  params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
  cfg.model.param_dtype = dtype
  if os.path.exists(out):
    raise FileExistsError(f"--out {out!r} exists; choose a new folder (export never overwrites).")
  os.makedirs(out)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.abspath(os.path.join(out, "params")), params)
  ckptr.wait_until_finished()
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(checkpoint.config_to_json(cfg), f, indent=2)
  shutil.copy(load.load_tokenizer(workdir, cfg).path, os.path.join(out, "tokenizer.model"))
  return out


def main(argv):
  _, _, flags = parse_cli(argv)
  if "workdir" not in flags or "out" not in flags:
    raise SystemExit(__doc__)
  out = export(flags["workdir"], flags["out"], int(flags["step"]) if "step" in flags else None, flags.get("dtype"))
  print(f"exported to {out}")


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad paths and settings: no traceback
    raise SystemExit(f"error: {e}") from None
