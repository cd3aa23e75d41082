"""Mixture of experts: tokens/s of a train step, the sparse MLP against the dense MLP of equal active width and
against the all-experts computation, side by side in one run.

  python -m benchmarks.moe --config configs/tiny_moe.py [--config.a.b=v ...] [--rounds=5] [--steps=4]

Three train steps of the same config (random token batches, the real jitted step, benchmarks/train_throughput):
  moe      model.moe as configured (top-2 of 8 in configs/tiny_moe.py): tokens sorted by expert, grouped matmuls
  dense    model.moe off, model.mlp_dim = (top_k + shared_experts) * expert_dim: the same active parameters
  all      the MoE with every expert run on every token and the unchosen ones weighted 0 (the tests' reference)
The rounds interleave the three (each round `steps` timed steps of each), so that a busy machine slows all
alike; each figure is the median step. Prints one JSON line with the ratios. docs/performance.md records it.
"""
import datetime
import json
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.train_throughput import run_steps, setup
from latent_jax import cli
from latent_jax.config import moe_enabled
from latent_jax.ops import moe
from latent_jax.train import flops

FLAGS = [cli.CONFIG,
         cli.Flag("rounds", int, 5, "interleaved rounds", lambda n: n >= 1, ">= 1"),
         cli.Flag("steps", int, 4, "timed steps of each step per round", lambda n: n >= 1, ">= 1")]


def all_experts_swiglu(x, experts, weights, w_gate, w_up, w_down, capacity=0, impl="auto"):
  """Every expert on every token [E, N, d], summed with a dense [N, E] gate (0 for the unchosen): E/k the work."""
  del capacity, impl
  gates = jnp.zeros((x.shape[0], w_gate.shape[0]), x.dtype).at[jnp.arange(x.shape[0])[:, None], experts].add(
      weights.astype(x.dtype))
  h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, w_gate)) * jnp.einsum("nd,edf->enf", x, w_up)
  return jnp.einsum("enf,efd,ne->nd", h, w_down, gates), jnp.zeros((), jnp.float32)


def variants(cfg):
  """{name: config} of the three steps."""
  e = cfg.model.moe
  dense = cfg.copy_and_resolve_references()
  dense.model.moe.enabled = False
  dense.model.mlp_dim = (e.top_k + e.shared_experts) * e.expert_dim
  return {"moe": cfg, "dense": dense, "all": cfg}


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    cfg = args.config
    if not moe_enabled(cfg.model):
      raise ValueError("--config: needs model.moe.enabled=True, e.g. configs/tiny_moe.py.")
  steps, compile_s = {}, {}
  for name, c in variants(cfg).items():
    original = moe.sparse_swiglu
    if name == "all":
      moe.sparse_swiglu = all_experts_swiglu
    try:
      compiled, state, batch, compile_s[name] = setup(c)
    finally:
      moe.sparse_swiglu = original
    state, _, _ = run_steps(compiled, state, batch, 1)  # warm
    steps[name] = [compiled, state, batch, []]
  for _ in range(args.rounds):
    for name, s in steps.items():
      s[1], times, _ = run_steps(s[0], s[1], s[2], args.steps)
      s[3].extend(times)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  rate = {name: tokens / float(np.median(s[3])) for name, s in steps.items()}
  e = cfg.model.moe
  print(json.dumps({
      "argv": argv, "experts": f"top-{e.top_k} of {e.num_experts}, expert_dim {e.expert_dim}",
      "tokens_per_step": tokens, "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
      "moe_over_dense": round(rate["moe"] / rate["dense"], 3), "moe_over_all": round(rate["moe"] / rate["all"], 3),
      "train_flops_per_token": {"moe": flops.flops_per_token(cfg, cfg.data.seq_len),
                                "dense": flops.flops_per_token(variants(cfg)["dense"], cfg.data.seq_len)},
      "compile_s": {k: round(v, 1) for k, v in compile_s.items()},
      "machine": flops.processor(), "backend": jax.default_backend(), "jax": jax.__version__,
      "python": platform.python_version(), "date": datetime.date.today().isoformat()}))


if __name__ == "__main__":
  main()
