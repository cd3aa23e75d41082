"""Train-step throughput: tokens/s, FLOP/s, and MFU against the device's peak.

  python -m benchmarks.train_throughput --config configs/tiny.py [--config.a.b=v ...] [--steps=10]

Random token batches (no data pipeline), the real jitted train step with its shardings.
Reports compile time, then the median over `steps` timed steps. The peak is the one training
reports its MFU against (train/flops.py's peak_flops): the data sheet's for a known device
(bf16 dense), else a large matmul measured in this process in the model's compute dtype.
"""
import json
import sys
import time

import jax
import numpy as np

from latent_jax import cli, objectives, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import flops
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer


FLAGS = [cli.CONFIG, cli.Flag("steps", int, 10, "timed steps", lambda n: n >= 1, ">= 1")]


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    measure(args.config, args.steps, sys.argv[1:] if argv is None else argv)


def measure(cfg, n_steps, argv):
  compile_s, times, _, _ = step_times(cfg, n_steps)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  step_s = float(np.median(times))
  flops_per_token = flops.flops_per_token(cfg, t)
  peak, source = flops.peak_flops(cfg.train.peak_flops, jax.numpy.dtype(cfg.model.dtype))
  result = {
      "argv": argv, "device": jax.devices()[0].device_kind,
      "devices": jax.device_count(), "compile_s": round(compile_s, 2), "step_s": round(step_s, 4),
      "tokens_per_s": round(b * t / step_s, 1), "train_flops_per_token": flops_per_token,
      "flops_per_s": b * t * flops_per_token / step_s, "peak_flops_per_s": peak * jax.device_count(),
      "peak_source": source,
  }
  result["mfu"] = round(result["flops_per_s"] / result["peak_flops_per_s"], 4)
  print(json.dumps(result))


def setup(cfg):
  """(the compiled train step, a train state, a random batch, compile seconds) of cfg."""
  mesh = sharding.make_mesh(cfg.mesh)
  sharding.check_batch(cfg.data.batch_size, mesh, cfg.train.microbatches)
  graphdef, abstract = abstract_model(cfg)  # with the NITP / MTP heads the config enables
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  train_step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg))

  b, t, v = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  tokens = np.random.default_rng(0).integers(0, v, size=(b, t + 1)).astype(np.int32)
  batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                 "segment_ids": np.ones((b, t), np.int32),
                                 "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}, mesh)
  start = time.perf_counter()
  compiled = train_step.lower(state, batch).compile()
  return compiled, state, batch, time.perf_counter() - start


def run_steps(compiled, state, batch, n_steps):
  """(state, [seconds of each of n_steps steps], the last metrics), each step waited for."""
  times, m = [], None
  for _ in range(n_steps):
    start = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - start)
  return state, times, m


def step_times(cfg, n_steps):
  """(compile seconds, [seconds of each of n_steps timed steps], the compiled step, the last step's
  metrics) of cfg's jitted train step on a random batch, after one untimed step."""
  compiled, state, batch, compile_s = setup(cfg)
  state, _, _ = run_steps(compiled, state, batch, 1)
  _, times, m = run_steps(compiled, state, batch, n_steps)
  return compile_s, times, compiled, m


if __name__ == "__main__":
  main()
