"""The GPU tier (`python -m pytest -m gpu`, on a machine with a GPU): kernels compiled for the
GPU against their naive reference on the same GPU, every attention implementation against
dense, and a bf16 train step against float32. Deselected elsewhere (conftest.py says why).

Errors are max |got - want| / max |want| over the output and every gradient. fp32 kernels: both
sides ask for HIGHEST precision, so only summation order differs (1e-4). fp32 attention: XLA's
and Triton's fp32 dots on a GPU run in TF32 (10-bit mantissa) by default, dense's included, so
implementations differ by ~5e-4 (xla_blocked against dense on an H200: 4.2e-4 to 6.9e-4); 2e-3.
bf16: the kernels round softmax weights and dz to bf16 before the gradient matmuls, as the CPU
tests' bf16 bounds say (2e-2).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from conftest import ROOT
from latent_jax.ops import attention as A
from latent_jax.ops.transformer import NO_WINDOW

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
ATTENTION_TOL = {"float32": 2e-3, "bfloat16": 2e-2}


def rel_error(got, want):
  return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                   / max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-6)) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,d,vocab,s,cap", [(256, 128, 2048, 1, None), (1000, 200, 5003, 1, 30.0),
                                              (777, 256, 32000, 4, None)])
def test_cross_entropy_pallas_matches_naive(dtype, n, d, vocab, s, cap):
  k = jax.random.split(jax.random.key(n + s), 3)
  h = jax.random.normal(k[0], (n, d)).astype(dtype)
  w = (jax.random.normal(k[1], (d, vocab)) * d**-0.5).astype(dtype)
  y = jax.random.randint(k[2], (n, s), 0, vocab).at[::7, 0].set(-1)  # some ignored labels

  def run(impl):
    def loss(h, w):
      l, lse = pk.fused_cross_entropy(h, w, y, impl=impl, logit_soft_cap=cap, return_lse=True)
      return l.mean() + 1e-3 * jnp.square(lse).mean(), l  # lse gets a cotangent too
    (_, l), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
    return (l, *g)

  assert rel_error(run("pallas"), run("naive")) <= TOL[dtype]
  assert rel_error(run("xla"), run("naive")) <= TOL[dtype]


# The 8.94B model's S = 32, N = 128 in bf16 only: in fp32 its Triton compile alone took 50 s.
@pytest.mark.parametrize("mode", ["softmax", "raw"])
@pytest.mark.parametrize("dtype,m,segments,codes,width", [("float32", 300, 4, 16, 8), ("bfloat16", 300, 4, 16, 8),
                                                          ("bfloat16", 1000, 32, 128, 128)])
def test_codebook_mix_pallas_matches_naive(dtype, mode, m, segments, codes, width):
  k = jax.random.split(jax.random.key(m), 3)
  logits = jax.random.normal(k[0], (m, segments, codes)).astype(dtype)
  codebook = (jax.random.normal(k[1], (segments, codes, width)) * 0.02).astype(dtype)
  cot = jax.random.normal(k[2], (m, segments, width)).astype(dtype)

  def run(impl):
    out, vjp = jax.vjp(lambda l, e: pk.codebook_mix(l, e, mode=mode, impl=impl), logits, codebook)
    return (out, *vjp(cot))

  assert rel_error(jax.jit(lambda: run("pallas"))(), jax.jit(lambda: run("naive"))()) <= TOL[dtype]


def packed_rows(b, t, docs):
  """Segment ids and positions of b rows of t tokens holding `docs` documents each (1 = unpacked)."""
  cuts = [round(t * i / docs) for i in range(docs + 1)]
  seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
  for i, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
    seg[:, a:e], pos[:, a:e] = i + 1, np.arange(e - a)
  return jnp.asarray(seg), jnp.asarray(pos)


def attention_and_grads(impl, q, k, v, seg, pos, window, cot):
  """Output and d(q, k, v) of <attention, cot>; `window` is static (one of the kernels' windows)."""
  f = lambda q, k, v: A.attention(q, k, v, seg, pos, window, impl, windows=(window, NO_WINDOW))
  out, vjp = jax.vjp(f, q, k, v)
  return (out, *vjp(cot))


IMPLS_BY_DTYPE = {"float32": ["xla_blocked", "pallas_gpu"], "bfloat16": ["xla_blocked", "pallas_gpu", "cudnn"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,window,docs", [(1000, NO_WINDOW, 3), (1024, 100, 3), (1024, NO_WINDOW, 1),
                                           (512, 64, 1), (999, 200, 1)])
def test_attention_matches_dense(dtype, t, window, docs):
  """GQA (8 heads, 2 KV groups), packed documents or one, full causal or a window: each
  implementation against dense, values and dq, dk, dv (cudnn's no-mask and masked branches)."""
  k = jax.random.split(jax.random.key(t + docs), 4)
  q = jax.random.normal(k[0], (2, t, 8, 64)).astype(dtype)
  key, val = (jax.random.normal(x, (2, t, 2, 64)).astype(dtype) for x in k[1:3])
  cot = jax.random.normal(k[3], q.shape).astype(dtype)
  seg, pos = packed_rows(2, t, docs)
  run = lambda impl: jax.jit(lambda *a: attention_and_grads(impl, *a, window, cot))(q, key, val, seg, pos)
  want = run("dense")
  errors = {impl: rel_error(run(impl), want) for impl in IMPLS_BY_DTYPE[dtype]}
  assert all(e <= ATTENTION_TOL[dtype] for e in errors.values()), errors


def test_attention_cudnn_bags():
  """Positions that step by 4 inside a document (TST bags): cuDNN's masked branch, exact."""
  t, window = 512, 64
  k = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(k[0], (2, t, 4, 64), jnp.bfloat16)
  key, val = (jax.random.normal(x, (2, t, 4, 64), jnp.bfloat16) for x in k[1:3])
  cot = jax.random.normal(k[3], q.shape, jnp.bfloat16)
  seg, pos = packed_rows(2, t, 2)
  pos = pos * 4
  run = lambda impl: jax.jit(lambda *a: attention_and_grads(impl, *a, window, cot))(q, key, val, seg, pos)
  assert rel_error(run("cudnn"), run("dense")) <= ATTENTION_TOL["bfloat16"]


def test_bf16_train_step_matches_float32():
  """Three train steps of a small baseline in bf16 with the GPU's auto kernels against the same
  steps in float32 with the naive/dense references: each step's loss and gradient norm agree."""
  from benchmarks.train_throughput import run_steps, setup
  from latent_jax import load_config
  base = ["model.vocab_size=4096", "model.d_model=256", "model.num_layers=2", "model.num_heads=4",
          "model.num_kv_heads=2", "model.head_dim=64", "model.mlp_dim=512", "model.window=128",
          "model.full_attention_every=2", "data.seq_len=512", "data.batch_size=4", "optim.warmup_steps=0",
          "optim.clip_norm=0.0"]
  runs = []
  for extra in (["model.dtype=bfloat16", "kernels.impl=auto", "kernels.attention=auto"],
                ["model.dtype=float32", "kernels.impl=naive", "kernels.attention=dense"]):
    compiled, state, batch, _ = setup(load_config(f"{ROOT}/configs/tiny.py", base + extra))
    runs.append([])
    for _ in range(3):
      state, _, metrics = run_steps(compiled, state, batch, 1)
      runs[-1].append((float(metrics["loss"]), float(metrics["grad_norm"])))
  for (loss16, norm16), (loss32, norm32) in zip(*runs):
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert norm16 == pytest.approx(norm32, rel=5e-2)
