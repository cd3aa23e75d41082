"""pallas_kernels against independent NumPy re-derivations (float64), every impl.

The NumPy side re-derives the math from REFERENCE.md section 4 and NCP Eq. 7-10 by hand
(log-sum-exp, bag weights, softmax mixture and their gradients); it never calls the code
under test, and its gradients are themselves checked by finite differences.

Tolerances. fp32 inputs: the kernels compute fp32 logits, so values and gradients agree
with float64 to ~1e-6 relative; we allow 1e-5 of the largest reference magnitude.
bf16 inputs: we feed NumPy the same bf16-rounded numbers, so fp32 logits still agree to
fp32 accuracy (bf16 x bf16 products are exact in fp32) and the loss keeps a 1e-4 bound (the
xla impl stores its logits in bf16, each within 2^-9 of itself, so its loss and lse get 2e-3);
but the gradients are returned in bf16 (8-bit mantissa, relative step 2^-8 = 0.4%) and
dz is rounded to bf16 before the gradient matmuls, so gradients get 2e-2 of the largest
reference magnitude.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels._common import resolve_impl

IMPLS = ("naive", "xla", "pallas_interpret")


# ------------------------------------------------------------ NumPy references
def np_bag_weights(labels, vocab):
  """w[i, v] = count(v in bag_i) / #non-ignored labels of row i (0 for an empty bag)."""
  w = np.zeros((labels.shape[0], vocab))
  for i, row in enumerate(labels):
    kept = [y for y in row if y >= 0]
    for y in kept:  # duplicates add up
      w[i, y] += 1.0 / len(kept)
  return w


def np_cross_entropy(h, w, labels, cap, g_loss, g_lse):
  """(loss, lse, d_hidden, d_weight) for the objective sum(g_loss*loss + g_lse*lse)."""
  u = h.astype(np.float64) @ w.astype(np.float64)
  z = u if cap is None else cap * np.tanh(u / cap)
  m = z.max(axis=1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
  bag = np_bag_weights(labels, w.shape[1])
  has = (labels >= 0).any(axis=1)
  loss = np.where(has, lse - (bag * z).sum(axis=1), 0.0)
  softmax = np.exp(z - lse[:, None])
  dz = (g_loss * has + g_lse)[:, None] * softmax - g_loss[:, None] * bag
  if cap is not None:
    dz *= 1.0 - np.tanh(u / cap) ** 2
  return loss, lse, dz @ w.astype(np.float64).T, h.astype(np.float64).T @ dz


def np_codebook_mix(logits, codebook, mode, g):
  """(out, d_logits, d_codebook) for sum(g * out), out[..s,:] = sum_n pi[..s,n] e[s,n,:]."""
  l, e = logits.astype(np.float64), codebook.astype(np.float64)
  if mode == "softmax":
    pi = np.exp(l - l.max(axis=-1, keepdims=True))
    pi /= pi.sum(axis=-1, keepdims=True)
  else:
    pi = l
  out = np.einsum("...sn,snk->...sk", pi, e)
  dpi = np.einsum("...sk,snk->...sn", g, e)
  dl = pi * (dpi - (pi * dpi).sum(axis=-1, keepdims=True)) if mode == "softmax" else dpi
  S, N, K = e.shape
  de = np.einsum("msn,msk->snk", pi.reshape(-1, S, N), g.reshape(-1, S, K))
  return out, dl, de


def test_numpy_references_match_finite_differences():
  rng = np.random.default_rng(0)
  h, w = rng.normal(size=(3, 4)), rng.normal(size=(4, 6))
  labels = np.array([[1, 1, -1], [-1, -1, -1], [5, 0, 2]])
  g_loss, g_lse = rng.normal(size=3), rng.normal(size=3)
  obj = lambda h, w: (g_loss * np_cross_entropy(h, w, labels, 2.0, g_loss, g_lse)[0]
                      + g_lse * np_cross_entropy(h, w, labels, 2.0, g_loss, g_lse)[1]).sum()
  _, _, dh, dw = np_cross_entropy(h, w, labels, 2.0, g_loss, g_lse)
  np.testing.assert_allclose(dh, _fd(lambda x: obj(x, w), h), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(dw, _fd(lambda x: obj(h, x), w), rtol=1e-6, atol=1e-8)
  l, e, g = rng.normal(size=(2, 3, 5)), rng.normal(size=(3, 5, 2)), rng.normal(size=(2, 3, 2))
  for mode in ("softmax", "raw"):
    _, dl, de = np_codebook_mix(l, e, mode, g)
    f = lambda l, e: (np_codebook_mix(l, e, mode, g)[0] * g).sum()
    np.testing.assert_allclose(dl, _fd(lambda x: f(x, e), l), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(de, _fd(lambda x: f(l, x), e), rtol=1e-6, atol=1e-8)


def _fd(f, x, eps=1e-6):
  grad = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    up, down = x.copy(), x.copy()
    up[idx] += eps
    down[idx] -= eps
    grad[idx] = (f(up) - f(down)) / (2 * eps)
  return grad


# ------------------------------------------------------------------ helpers
def _close(got, ref, tol):
  """|got - ref| <= tol * max|ref| elementwise: a relative bound on the array's scale."""
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert got.shape == ref.shape
  scale = max(np.abs(ref).max(), 1e-30)
  err = np.abs(got - ref).max() / scale
  assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def _labels(rng, n, s, vocab):
  """Bags with ignored slots, a fully ignored row and a forced duplicate."""
  labels = rng.integers(0, vocab, size=(n, s))
  labels[rng.random((n, s)) < 0.25] = -1
  labels[1] = -1  # an all-ignored row
  if s > 1:
    labels[2, :2] = labels[2, 0] if labels[2, 0] >= 0 else 7  # a duplicate in a bag
  return labels


def _run_ce(impl, h, w, labels, cap, g_loss, g_lse, chunk_size=16):
  def f(h, w):
    return pk.fused_cross_entropy(h, w, labels, impl=impl, logit_soft_cap=cap,
                                  return_lse=True, chunk_size=chunk_size)

  (loss, lse), vjp = jax.vjp(f, h, w)
  dh, dw = vjp((g_loss, g_lse))
  return loss, lse, dh, dw


# --------------------------------------------------------------- cross-entropy
# (n, d, vocab, s, cap): n and vocab divide neither the 16-row chunk nor the token / vocab
# tiles, so every impl pads and masks.
CE_CASES = [(37, 24, 300, 1, None), (20, 40, 130, 2, 5.0), (33, 16, 257, 4, None),
            (9, 8, 70, 8, 3.0)]


def _cotangents(rng, kind, labels):
  """(g_loss, g_lse): "random" per row and on lse (a z-loss), or "mean", what a masked
  mean of the loss sends back (the same on every scored row, nothing on lse). The xla
  impl takes a different backward path for each."""
  n = labels.shape[0]
  if kind == "random":
    return rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
  scored = (labels >= 0).any(axis=1)
  return (scored / scored.sum()).astype(np.float32), np.zeros(n, np.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cotangent", ("random", "mean"))
@pytest.mark.parametrize("n,d,vocab,s,cap", CE_CASES)
def test_cross_entropy_fp32(impl, cotangent, n, d, vocab, s, cap):
  rng = np.random.default_rng(n * 1000 + s)
  h = rng.normal(size=(n, d)).astype(np.float32)
  w = (rng.normal(size=(d, vocab)) * 0.5).astype(np.float32)
  labels = _labels(rng, n, s, vocab)
  g_loss, g_lse = _cotangents(rng, cotangent, labels)
  got = _run_ce(impl, jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels), cap, g_loss, g_lse)
  ref = np_cross_entropy(h, w, labels, cap, g_loss, g_lse)
  assert got[0].dtype == jnp.float32 and got[0].shape == (n,)
  for a, b in zip(got, ref):
    _close(a, b, 1e-5)
  assert float(got[0][1]) == 0.0  # the all-ignored row


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cotangent", ("random", "mean"))
def test_cross_entropy_bf16(impl, cotangent):
  rng = np.random.default_rng(1)
  n, d, vocab, s = 21, 48, 200, 2
  h = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(d, vocab)) * 0.3, jnp.bfloat16)
  labels = _labels(rng, n, s, vocab)
  g_loss, g_lse = _cotangents(rng, cotangent, labels)
  got = _run_ce(impl, h, w, jnp.asarray(labels), 4.0, g_loss, g_lse)
  ref = np_cross_entropy(np.asarray(h, np.float64), np.asarray(w, np.float64), labels, 4.0,
                         g_loss, g_lse)
  assert got[0].dtype == jnp.float32 and got[2].dtype == jnp.bfloat16
  value_tol = 2e-3 if impl == "xla" else 1e-4
  for a, b, tol in zip(got, ref, (value_tol, value_tol, 2e-2, 2e-2)):
    _close(a, b, tol)


# The TPU kernels (cross_entropy_tpu.py) run only where jax.default_backend() == "tpu";
# here they are forced through pallas_cross_entropy(..., tpu=True) in interpret mode.
# n and vocab divide neither the 16-row nor the 128-column tile, d is not a multiple of 128.
TPU_CASES = [(37, 24, 300, 1, None), (37, 24, 300, 4, 5.0), (20, 40, 130, 4, None),
             (9, 8, 70, 1, 3.0)]


@pytest.mark.parametrize("cotangent", ("random", "mean"))
@pytest.mark.parametrize("n,d,vocab,s,cap", TPU_CASES)
def test_cross_entropy_tpu_kernels_interpret(cotangent, n, d, vocab, s, cap):
  from pallas_kernels.cross_entropy_pallas import pallas_cross_entropy

  rng = np.random.default_rng(n * 1000 + s)
  h = rng.normal(size=(n, d)).astype(np.float32)
  w = (rng.normal(size=(d, vocab)) * 0.5).astype(np.float32)
  labels = _labels(rng, n, s, vocab)
  g_loss, g_lse = _cotangents(rng, cotangent, labels)
  f = lambda h, w: pallas_cross_entropy(h, w, jnp.asarray(labels), cap, True, tpu=True)
  out, vjp = jax.vjp(f, jnp.asarray(h), jnp.asarray(w))
  got = (*out, *vjp((jnp.asarray(g_loss), jnp.asarray(g_lse))))
  for a, b in zip(got, np_cross_entropy(h, w, labels, cap, g_loss, g_lse)):
    _close(a, b, 1e-5)
  assert float(got[0][1]) == 0.0  # the all-ignored row


def test_cross_entropy_tpu_kernels_several_vocab_tiles():
  """A vocab of 3 full tiles and a partial one, two token tiles: the online logsumexp and
  both backward accumulations run across grid steps (the cases above fit one tile)."""
  from pallas_kernels import cross_entropy_tpu
  from pallas_kernels.cross_entropy_pallas import pallas_cross_entropy

  rng = np.random.default_rng(5)
  n, d, vocab, s = 300, 16, 3 * cross_entropy_tpu.BLOCK_V + 70, 2
  h = rng.normal(size=(n, d)).astype(np.float32)
  w = rng.normal(size=(d, vocab)).astype(np.float32)
  labels = _labels(rng, n, s, vocab)
  g_loss, g_lse = _cotangents(rng, "random", labels)
  f = lambda h, w: pallas_cross_entropy(h, w, jnp.asarray(labels), 4.0, True, tpu=True)
  out, vjp = jax.vjp(f, jnp.asarray(h), jnp.asarray(w))
  got = (*out, *vjp((jnp.asarray(g_loss), jnp.asarray(g_lse))))
  for a, b in zip(got, np_cross_entropy(h, w, labels, 4.0, g_loss, g_lse)):
    _close(a, b, 1e-5)


def test_cross_entropy_tpu_kernels_bf16():
  """bf16 blocks (16-row tiles) and dz rounded to bf16 before the gradient dots, as on GPU."""
  from pallas_kernels.cross_entropy_pallas import pallas_cross_entropy

  rng = np.random.default_rng(1)
  n, d, vocab, s = 21, 48, 200, 2
  h = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(d, vocab)) * 0.3, jnp.bfloat16)
  labels = _labels(rng, n, s, vocab)
  g_loss, g_lse = _cotangents(rng, "random", labels)
  f = lambda h, w: pallas_cross_entropy(h, w, jnp.asarray(labels), 4.0, True, tpu=True)
  out, vjp = jax.vjp(f, h, w)
  got = (*out, *vjp((jnp.asarray(g_loss), jnp.asarray(g_lse))))
  ref = np_cross_entropy(np.asarray(h, np.float64), np.asarray(w, np.float64), labels, 4.0,
                         g_loss, g_lse)
  assert got[2].dtype == jnp.bfloat16
  for a, b, tol in zip(got, ref, (1e-4, 1e-4, 2e-2, 2e-2)):
    _close(a, b, tol)


def test_cross_entropy_auto_and_default_chunk():
  rng = np.random.default_rng(2)
  h, w = rng.normal(size=(50, 8)).astype(np.float32), rng.normal(size=(8, 40)).astype(np.float32)
  labels = rng.integers(-1, 40, size=(50, 1))
  assert resolve_impl("auto", "cross_entropy") == ("xla", False)  # tests run on CPU
  with pk.target_backend("gpu"):  # the choices measured on an H200 (docs/kernels.md)
    assert resolve_impl("auto", "cross_entropy") == ("xla", False)
    assert resolve_impl("auto", "codebook_mix") == ("naive", False)
  with pk.target_backend("tpu"):  # nothing measured on a TPU: the XLA paths
    assert resolve_impl("auto", "cross_entropy") == resolve_impl("auto", "codebook_mix") == ("xla", False)
  got = pk.fused_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels))
  _close(got, np_cross_entropy(h, w, labels, None, np.ones(50), np.zeros(50))[0], 1e-5)


def test_cross_entropy_errors():
  h, w, y = jnp.zeros((4, 3)), jnp.zeros((3, 10)), jnp.zeros((4, 1), jnp.int32)
  with pytest.raises(ValueError, match="naive"):
    pk.fused_cross_entropy(h, w, y, impl="cuda")
  with pytest.raises(ValueError, match="hidden"):
    pk.fused_cross_entropy(h[None], w, y)
  with pytest.raises(ValueError, match="weight"):
    pk.fused_cross_entropy(h, w.T, y)
  with pytest.raises(ValueError, match="labels"):
    pk.fused_cross_entropy(h, w, y[:, 0])
  with pytest.raises(ValueError, match="labels"):
    pk.fused_cross_entropy(h, w, y.astype(jnp.float32))


# ---------------------------------------------------------------- codebook mix
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ("softmax", "raw"))
def test_codebook_mix_fp32(impl, mode):
  rng = np.random.default_rng(3)
  lead, S, N, K = (3, 5), 4, 12, 6  # M = 15 rows, N and K not powers of two
  logits = rng.normal(size=(*lead, S, N)).astype(np.float32)
  codebook = rng.normal(size=(S, N, K)).astype(np.float32)
  g = rng.normal(size=(*lead, S, K)).astype(np.float32)
  f = lambda l, e: pk.codebook_mix(l, e, mode=mode, impl=impl)
  out, vjp = jax.vjp(f, jnp.asarray(logits), jnp.asarray(codebook))
  got = (out, *vjp(jnp.asarray(g)))
  for a, b in zip(got, np_codebook_mix(logits, codebook, mode, g)):
    _close(a, b, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_codebook_mix_bf16(impl):
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(20, 2, 16)), jnp.bfloat16)
  codebook = jnp.asarray(rng.normal(size=(2, 16, 8)) * 0.1, jnp.bfloat16)
  g = rng.normal(size=(20, 2, 8)).astype(np.float32)
  f = lambda l, e: pk.codebook_mix(l, e, mode="softmax", impl=impl)
  out, vjp = jax.vjp(f, logits, codebook)
  got = (out, *vjp(jnp.asarray(g, jnp.bfloat16)))
  ref = np_codebook_mix(np.asarray(logits, np.float64), np.asarray(codebook, np.float64),
                        "softmax", np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64))
  assert out.dtype == jnp.bfloat16
  for a, b in zip(got, ref):  # bf16 outputs and softmax weights rounded to bf16: ~2^-8
    _close(a, b, 2e-2)


def test_codebook_mix_errors():
  with pytest.raises(ValueError, match="mode"):
    pk.codebook_mix(jnp.zeros((2, 4, 8)), jnp.zeros((4, 8, 3)), mode="hard")
  with pytest.raises(ValueError, match="codebook"):
    pk.codebook_mix(jnp.zeros((2, 4, 8)), jnp.zeros((4, 9, 3)))
  with pytest.raises(ValueError, match="pallas_interpret"):
    pk.codebook_mix(jnp.zeros((2, 4, 8)), jnp.zeros((4, 8, 3)), impl="triton")


# ----------------------------------------------------------- GPU lowering
def test_pallas_kernels_lower_for_gpu(monkeypatch):
  """No GPU here, but JAX can lower for CUDA from a CPU host: this catches kernel code
  that the Triton backend cannot express (shapes, ops), forward and backward."""
  import pallas_kernels.cross_entropy_pallas as ce_pallas
  import pallas_kernels.mixing as mixing
  from jax.experimental.pallas import triton as pl_triton

  params = lambda interpret: pl_triton.CompilerParams(num_warps=4, num_stages=2)
  monkeypatch.setattr(ce_pallas, "compiler_params", params)
  monkeypatch.setattr(mixing, "compiler_params", params)

  def ce(h, w, y):
    f = lambda h, w: ce_pallas.pallas_cross_entropy(h, w, y, 30.0, False)[0].sum()
    return jax.value_and_grad(f, argnums=(0, 1))(h, w)

  def mix(l, e):
    f = lambda l, e: mixing.mix_pallas(l, e, "softmax", False).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1))(l, e)

  sds = jax.ShapeDtypeStruct
  for fn, args in ((ce, (sds((70, 150), jnp.bfloat16), sds((150, 300), jnp.bfloat16),
                         sds((70, 2), jnp.int32))),
                   (mix, (sds((70, 4, 12), jnp.float32), sds((4, 12, 6), jnp.float32)))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # forward and two backward kernels


def test_cross_entropy_tpu_kernels_lower_for_tpu():
  """No TPU here either, but the Pallas -> Mosaic lowering runs on this host: it checks the
  TPU block-shape rules and that every op in the kernels has a Mosaic lowering (not the
  Mosaic compiler passes, which run on a TPU)."""
  from pallas_kernels.cross_entropy_pallas import pallas_cross_entropy

  def ce(h, w, y):
    f = lambda h, w: pallas_cross_entropy(h, w, y, 30.0, False, tpu=True)[0].sum()
    return jax.value_and_grad(f, argnums=(0, 1))(h, w)

  sds = jax.ShapeDtypeStruct
  for dtype in (jnp.float32, jnp.bfloat16):
    args = sds((70, 150), dtype), sds((150, 1100), dtype), sds((70, 2), jnp.int32)
    text = jax.jit(ce).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward and two backward kernels
