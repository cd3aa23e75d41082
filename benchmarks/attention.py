"""Dense vs blocked attention, forward + backward: time (interleaved calls) and XLA temp memory.

    python -m benchmarks.attention [--shapes 16x128x64,1x2048x64,...] [--blocks 128] [--reps 5]
                                   [--impls dense,xla_blocked] [--dtype float32]

A shape is BxTxWINDOW (WINDOW 0 = full causal); heads 4, KV groups 2, head dim 32 unless
--heads/--groups/--dim say otherwise. Rows hold --docs documents each (2 unless said). xla_blocked runs once per
block size in --blocks; the first impl is the one the ratios divide by. The impls run call by
call in turn, so a noisy shared machine slows them alike; read the ratios (docs/kernels.md).
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from latent_jax.ops import attention as A
from latent_jax.ops.transformer import NO_WINDOW


def inputs(b, t, h, kh, d, dtype, docs=2):
  """q, k, v and the segment ids and positions of rows of `docs` equal documents."""
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, h, d), dtype)
  k, v = (jax.random.normal(x, (b, t, kh, d), dtype) for x in ks[1:])
  starts = np.arange(t) // -(-t // docs) * -(-t // docs)
  seg = np.broadcast_to(1 + np.arange(t) // -(-t // docs), (b, t))
  pos = np.broadcast_to(np.arange(t) - starts, (b, t))
  return q, k, v, jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)


def step(impl, block, windows):
  """jit of d/d(q, k, v) sum(attention * r), the work of one layer's forward + backward."""
  def loss(q, k, v, seg, pos, window):
    out = A.attention(q, k, v, seg, pos, window, impl, block, windows)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(q.astype(jnp.float32)))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default="16x128x64,16x128x0,1x2048x64,1x2048x0,1x8192x64,1x8192x0")
  p.add_argument("--impls", default="dense,xla_blocked")
  p.add_argument("--blocks", default="128")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--groups", type=int, default=2)
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--docs", type=int, default=2, help="documents per row")
  a = p.parse_args()
  first = a.impls.split(",")[0]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, heads {a.heads}, groups {a.groups}, "
        f"dim {a.dim}, {a.dtype}, {a.docs} document(s) a row")
  print(f"| B x T | window | impl | block | ms | / {first} | temp MiB | / {first} |\n|---|---|---|---|---|---|---|---|")
  for shape in a.shapes.split(","):
    b, t, w = map(int, shape.split("x"))
    window = w or NO_WINDOW
    args = (*inputs(b, t, a.heads, a.groups, a.dim, jnp.dtype(a.dtype), a.docs), jnp.int32(window))
    impls = [(i, int(bl)) for i in a.impls.split(",") for bl in (a.blocks.split(",") if i == "xla_blocked" else [A.BLOCK])]
    fns = [step(i, bl, (window, NO_WINDOW)) for i, bl in impls]
    temps = [f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20 for f in fns]
    for f in fns:
      jax.block_until_ready(f(*args))
    times = [[] for _ in fns]
    for _ in range(a.reps):
      for f, ts in zip(fns, times):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - start)
    ms = [1e3 * float(np.median(ts)) for ts in times]
    for (impl, bl), m, temp in zip(impls, ms, temps):
      print(f"| {b} x {t} | {w or 'full'} | {impl} | {bl} | {m:.1f} | {m / ms[0]:.2f} | {temp:.1f} | {temp / temps[0]:.3f} |",
            flush=True)


if __name__ == "__main__":
  main()
