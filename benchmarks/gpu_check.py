"""The GPU check of issue 6, in one run: compile the Pallas kernels on the GPU, compare them
with the naive reference, then time them and a train step.

    python3 -m benchmarks.gpu_check [--quick]

On a lent device machine (see docs/kernels.md, "On a GPU"), which has jax, flax, optax and
orbax but not ml-collections: download that wheel here, carry it, install it there first.
Stages, each printed as it finishes, so a run cut short still reports what it reached:
  1. correctness: impl="pallas" (compiled, Triton) against impl="naive" on the same device,
     values and gradients, fp32 and bf16, shapes that do and do not divide the tiles;
  2. benchmarks/cross_entropy.py in bf16: naive vs xla vs pallas (8192 x 1024 x 100278 and
     2048 x 512 x 32000), time of loss + grad and XLA's scratch memory;
  3. benchmarks/codebook_mix.py in bf16 at the 8.94B model's shapes;
  4. benchmarks/train_throughput.py: configs/d512.py in bf16 with kernels.impl = pallas and xla,
     tokens/s, TFLOP/s and MFU against the device's data-sheet bf16 peak (train/flops.py);
  5. attention (latent_jax/ops/attention.py): pallas_gpu (compiled) and xla_blocked against
     dense on the GPU, values and dq/dk/dv, then benchmarks/attention.py in bf16.
Exits 1 if any comparison in stage 1 or 5 fails; the later stages run regardless.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from latent_jax.ops import attention as A
from latent_jax.ops.transformer import NO_WINDOW
from latent_jax.train import flops

# fp32: both impls ask for HIGHEST precision, so only summation order differs.
# bf16: the kernels round dz / softmax weights to bf16 before the gradient matmuls, as the
# tests' bf16 bounds say (tests/test_kernels.py): 2e-2 of the largest gradient entry.
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def check_cross_entropy(dtype, n, d, vocab, s, cap):
  k = jax.random.split(jax.random.key(n + s), 3)
  h = jax.random.normal(k[0], (n, d)).astype(dtype)
  w = (jax.random.normal(k[1], (d, vocab)) * d**-0.5).astype(dtype)
  y = jax.random.randint(k[2], (n, s), 0, vocab).at[::7, 0].set(-1)  # some ignored labels

  def f(impl):
    def loss(h, w):
      l, lse = pk.fused_cross_entropy(h, w, y, impl=impl, logit_soft_cap=cap, return_lse=True)
      return l.mean() + 1e-3 * jnp.square(lse).mean(), l  # lse gets a cotangent too
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  (_, lp), gp = f("pallas")(h, w)
  (_, ln), gn = f("naive")(h, w)
  return max(_rel(lp, ln), *(_rel(a, b) for a, b in zip(gp, gn)))


def check_mix(dtype, m, segments, codes, width, mode):
  k = jax.random.split(jax.random.key(m), 3)
  logits = jax.random.normal(k[0], (m, segments, codes)).astype(dtype)
  codebook = (jax.random.normal(k[1], (segments, codes, width)) * 0.02).astype(dtype)
  cot = jax.random.normal(k[2], (m, segments, width))

  def f(impl):
    def go(l, e):
      out, vjp = jax.vjp(lambda l, e: pk.codebook_mix(l, e, mode=mode, impl=impl), l, e)
      return (out, *vjp(cot.astype(out.dtype)))
    return jax.jit(go)

  return max(_rel(a, b) for a, b in zip(f("pallas")(logits, codebook), f("naive")(logits, codebook)))


def stage_correctness(quick):
  print("## 1. Pallas (compiled) against naive, max |diff| / max |ref| over values and grads\n")
  print("| kernel | case | dtype | rel. error | bound | ok |\n|---|---|---|---|---|---|")
  ok = True
  ce_cases = [(256, 128, 2048, 1, None), (1000, 200, 5003, 1, 30.0), (777, 256, 32000, 4, None),
              (512, 128, 3001, 8, 15.0)]
  mix_cases = [(300, 4, 16, 8), (1000, 32, 128, 128), (2048, 32, 128, 128)]
  for dtype in (jnp.float32, jnp.bfloat16):
    for case in ce_cases[:2] if quick else ce_cases:
      err = check_cross_entropy(dtype, *case)
      ok &= err <= TOL[dtype]
      print(f"| fused_cross_entropy | n,d,V,s,cap={case} | {jnp.dtype(dtype).name} | {err:.2e} "
            f"| {TOL[dtype]:.0e} | {err <= TOL[dtype]} |", flush=True)
    for case in mix_cases[:2] if quick else mix_cases:
      for mode in ("softmax", "raw"):
        err = check_mix(dtype, *case, mode)
        ok &= err <= TOL[dtype]
        print(f"| codebook_mix | M,S,N,d/S={case} {mode} | {jnp.dtype(dtype).name} | {err:.2e} "
              f"| {TOL[dtype]:.0e} | {err <= TOL[dtype]} |", flush=True)
  return ok


def check_attention(impl, dtype, t, window):
  """max relative error of attention and its q, k, v gradients against dense, 3 documents a row."""
  k = jax.random.split(jax.random.key(t), 4)
  q = jax.random.normal(k[0], (2, t, 8, 64)).astype(dtype)
  kv = [jax.random.normal(x, (2, t, 2, 64)).astype(dtype) for x in k[1:3]]
  cot = jax.random.normal(k[3], q.shape).astype(dtype)
  seg = jnp.broadcast_to(1 + (jnp.arange(t) >= t // 3) + (jnp.arange(t) >= t // 2), (2, t)).astype(jnp.int32)
  pos = jnp.arange(t) - jnp.where(jnp.arange(t) >= t // 2, t // 2, jnp.where(jnp.arange(t) >= t // 3, t // 3, 0))
  pos = jnp.broadcast_to(pos, (2, t)).astype(jnp.int32)

  def f(impl):
    def go(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: A.attention(q, k, v, seg, pos, window, impl, windows=(window,)), q, k, v)
      return (out, *vjp(cot))
    return jax.jit(go)

  return max(_rel(a, b) for a, b in zip(f(impl)(q, *kv), f("dense")(q, *kv)))


def stage_attention(quick):
  print("\n## 5. attention against dense, max |diff| / max |ref| over output and dq, dk, dv\n")
  print("| impl | T | window | dtype | rel. error | bound | ok |\n|---|---|---|---|---|---|---|")
  ok = True
  for dtype in (jnp.float32, jnp.bfloat16):
    for impl in ("pallas_gpu", "xla_blocked"):
      for t, window in [(1000, NO_WINDOW), (1000, 100)] + ([] if quick else [(4096, NO_WINDOW)]):
        err = check_attention(impl, dtype, t, window)
        ok &= err <= TOL[dtype]
        print(f"| {impl} | {t} | {window} | {jnp.dtype(dtype).name} | {err:.2e} | {TOL[dtype]:.0e} "
              f"| {err <= TOL[dtype]} |", flush=True)
  return ok


def run(title, cmd):
  print(f"\n## {title}\n\n`{' '.join(cmd)}`\n", flush=True)
  subprocess.run([sys.executable, *cmd], check=False)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="fewer cases, fewer reps")
  a = p.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit(f"benchmarks.gpu_check needs a GPU; jax sees {jax.devices()}")
  print(f"# GPU check: jax {jax.__version__}, {jax.devices()[0].device_kind}\n")
  ok = stage_correctness(a.quick)
  reps = "3" if a.quick else "10"
  run("2. fused_cross_entropy, bf16, loss + grad",
      ["-m", "benchmarks.cross_entropy", "--impls", "naive,xla,pallas", "--dtype", "bfloat16",
       "--no-memory", "--reps", reps])
  run("3. codebook_mix at the 8.94B shapes, bf16",
      ["-m", "benchmarks.codebook_mix", "--impls", "naive,xla,pallas", "--dtype", "bfloat16",
       "--reps", reps])
  print("\n## 4. train step, configs/d512.py, bf16, 64 x 2048 tokens\n")
  print("| kernels.impl | tokens/s | TFLOP/s | MFU (of the data-sheet peak) |\n|---|---|---|---|")
  peak = flops.KNOWN_PEAK_FLOPS.get(jax.devices()[0].device_kind, float("nan"))
  for impl in ("pallas", "xla"):
    cmd = ["-m", "benchmarks.train_throughput", "--config", "configs/d512.py", "--config.model.dtype=bfloat16",
           "--config.data.batch_size=64", "--config.data.seq_len=2048", f"--config.kernels.impl={impl}",
           f"--steps={reps}"]
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if out.returncode:
      print(f"| {impl} | failed: {out.stderr.strip()[-300:]} | | |", flush=True)
      continue
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"| {impl} | {r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e12:.1f} | {r['flops_per_s'] / peak:.3f} |",
          flush=True)
  ok &= stage_attention(a.quick)
  run("5b. attention, bf16, forward + backward",
      ["-m", "benchmarks.attention", "--impls", "dense,xla_blocked,pallas_gpu", "--dtype", "bfloat16",
       "--heads", "16", "--groups", "4", "--dim", "128", "--reps", reps,
       "--shapes", "4x2048x0,4x2048x512,1x8192x0,1x8192x512"])
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
