"""Train-step memory and time under each model.remat policy and train.microbatches, as ratios to
remat="none" with one microbatch, all measured in one process.

  python -m benchmarks.remat_microbatches --config configs/tiny.py [--config.a.b=v ...] [--steps=3]

Random token batches, the real jitted train step. Memory is XLA's temp allocation of the compiled
step (activations, gradients and scratch; parameters and optimiser state are arguments, not
temp); time is the median of `steps` timed steps. Prints one JSON line per setting.
"""
import copy
import json

import jax
import numpy as np

from benchmarks.train_throughput import step_times
from latent_jax import cli
from latent_jax.config import validate

FLAGS = [cli.CONFIG, cli.Flag("steps", int, 3, "timed steps per setting", lambda n: n >= 1, ">= 1")]
SETTINGS = [(policy, k) for k in (1, 2, 4) for policy in ("none", "full", "matmuls")]


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    base = None
    for policy, k in SETTINGS:
      cfg = copy.deepcopy(args.config)
      cfg.model.remat, cfg.train.microbatches = policy, k
      result = measure(cfg, args.steps)
      base = base or result
      result.update(temp_ratio=round(result["temp_bytes"] / base["temp_bytes"], 3),
                    step_ratio=round(result["step_s"] / base["step_s"], 3))
      print(json.dumps(result), flush=True)


def measure(cfg, n_steps):
  validate(cfg)
  compile_s, times, compiled, m = step_times(cfg, n_steps)
  return {"remat": cfg.model.remat, "microbatches": cfg.train.microbatches, "device": jax.devices()[0].device_kind,
          "compile_s": round(compile_s, 2), "step_s": round(float(np.median(times)), 4),
          "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "loss": round(float(m["loss"]), 6)}


if __name__ == "__main__":
  main()
