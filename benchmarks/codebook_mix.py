"""codebook_mix at the 8.94B NCP shapes (S=32, N=128, d=4096): forward + backward time.

    python -m benchmarks.codebook_mix [--concepts 2048] [--impls naive,pallas] [--reps 5]

Default impls: naive and xla (the same einsum) on CPU; naive and pallas on GPU/TPU.
Alongside the mixture it times the prediction heads that feed it (u [M, d] @ [d, S*N]),
the number that decides whether fusing heads and mixture would pay (docs/kernels.md).
Time: median of --reps calls of the compiled value_and_grad after one warm-up call.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

S, N, D = 32, 128, 4096


def _timed(fn, args, reps):
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)), compiled.memory_analysis().temp_size_in_bytes / 2**20


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--concepts", type=int, default=2048, help="rows M (tokens / k)")
  p.add_argument("--impls", default=None)
  p.add_argument("--mode", default="softmax", choices=["softmax", "raw"])
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--reps", type=int, default=5)
  a = p.parse_args()
  cpu = jax.default_backend() == "cpu"
  impls = (a.impls or ("naive,xla" if cpu else "naive,pallas")).split(",")
  dtype = jnp.dtype(a.dtype)
  k = jax.random.split(jax.random.key(0), 3)
  u = jax.random.normal(k[0], (a.concepts, D), dtype)
  heads = (jax.random.normal(k[1], (D, S * N)) * D**-0.5).astype(dtype)
  codebook = (jax.random.normal(k[2], (S, N, D // S)) * 0.02).astype(dtype)
  logits = (u @ heads).reshape(a.concepts, S, N)

  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; M={a.concepts}, S={S}, "
        f"N={N}, d={D}, {a.mode}, {a.dtype}")
  print("| what | impl | fwd+bwd ms | temp MiB |")
  print("|---|---|---|---|")
  for impl in impls:
    def mix_only(l, e):
      return pk.codebook_mix(l, e, mode=a.mode, impl=impl).astype(jnp.float32).sum()

    def heads_and_mix(u, w, e):
      l = (u @ w).reshape(-1, S, N)
      return pk.codebook_mix(l, e, mode=a.mode, impl=impl).astype(jnp.float32).sum()

    for what, fn, args in (
        ("mixture", jax.value_and_grad(mix_only, argnums=(0, 1)), (logits, codebook)),
        ("heads + mixture", jax.value_and_grad(heads_and_mix, argnums=(0, 1, 2)),
         (u, heads, codebook)),
    ):
      t, temp = _timed(fn, args, a.reps)
      print(f"| {what} | {impl} | {1e3 * t:.1f} | {temp:.0f} |", flush=True)


if __name__ == "__main__":
  main()
