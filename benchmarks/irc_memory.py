"""Backward-pass memory of an IRC stack: history_scan (O(L) saved states) against a plain scan (O(L^2)).

    python -m benchmarks.irc_memory [--layers 4,8,16] [--batch 4] [--seq 256] [--d 64]

For each depth L, compiles the gradient of one ResidualStack (IRC on, remat on, as the 8B
config runs) both ways and prints XLA's scratch memory (compiled.memory_analysis()
.temp_size_in_bytes), the same stack without IRC as the floor, and the IRC overhead above
that floor in units of one [B, T, d] state.
"""
import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax import load_config
from latent_jax.nn import concept
from latent_jax.nn.layers import remat


def plain_scan(body, x, history, layers, consts):
  body = remat(body, "full")  # what the stack would do without history_scan
  (x, _), (outs, _) = jax.lax.scan(lambda carry, layer: body(carry, layer, consts), (x, history), layers)
  return x, outs


def scratch_mib(num_layers, a, irc=True, scan=None):
  cfg = load_config("configs/tiny_ncp.py", [f"model.d_model={a.d}", "model.num_heads=4", "model.num_kv_heads=2",
                                             f"model.head_dim={a.d // 4}", f"model.mlp_dim={2 * a.d}",
                                             f"model.irc={irc}", "model.remat=full"]).model
  graphdef, state = nnx.split(concept.ResidualStack(cfg, num_layers, (), nnx.Rngs(0)))
  x = jnp.ones((a.batch, a.seq, a.d))
  positions = jnp.broadcast_to(jnp.arange(a.seq), (a.batch, a.seq))
  segments = jnp.zeros((a.batch, a.seq), jnp.int32)

  def loss(state, x):
    y, outs, _ = nnx.merge(graphdef, state)(x, positions, segments)
    return jnp.square(y).sum() + jnp.square(outs).sum()

  original = concept.history_scan
  concept.history_scan = scan or original
  try:
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
  finally:
    concept.history_scan = original
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", default="4,8,16")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--d", type=int, default=64)
  a = p.parse_args()
  state_mib = a.batch * a.seq * a.d * 4 / 2**20
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; B={a.batch}, T={a.seq}, d={a.d}, fp32, "
        f"one state = {state_mib:.2f} MiB")
  print("| L | no IRC MiB | plain scan MiB | history_scan MiB | IRC overhead, states: plain | history_scan |")
  print("|---|---|---|---|---|---|")
  for num_layers in map(int, a.layers.split(",")):
    floor = scratch_mib(num_layers, a, irc=False)
    plain = scratch_mib(num_layers, a, scan=plain_scan)
    ours = scratch_mib(num_layers, a)
    print(f"| {num_layers} | {floor:.1f} | {plain:.1f} | {ours:.1f} | {(plain - floor) / state_mib:.0f} "
          f"| {(ours - floor) / state_mib:.0f} |", flush=True)


if __name__ == "__main__":
  main()
