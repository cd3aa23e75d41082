"""Cross-entropy of an LM head without materialising the [tokens, vocab] logits.

Per row i with bag labels y_i1..y_is (negative = ignored) and z = hidden @ weight:
    loss_i = lse(z_i) - sum_v w_iv z_iv,   w_iv = count(v in bag_i) / #non-ignored labels,
i.e. the mean over the bag of CE(z_i, y_ik) (REFERENCE.md section 4; s=1 is plain CE,
s>1 the TST multi-hot loss). A row whose labels are all ignored has loss 0 and no gradient.
The gradient w.r.t. the logits is softmax(z) - w, which the chunked and Pallas versions
recompute tile by tile instead of storing.

Three versions, one chooser (`fused_cross_entropy`):
  naive   all logits at once; JAX autodiff. The reference.
  xla     token chunks (full vocab per chunk) under lax.scan with a custom VJP; only one
          [chunk, vocab] block of logits is ever alive. Under jax.grad the forward also
          builds the gradient of sum(loss), which the backward rescales when the cotangent
          allows (a mean, masked mean or sum of the loss) and recomputes chunks otherwise.
          The logits come out of the matmul in the operands' dtype (bf16 for bf16 inputs,
          as in PyTorch autocast and MaxText) and everything after it is fp32: half the
          bytes of fp32 logits on every pass over a chunk.
  pallas  tokens x vocab tiles with an online logsumexp (cross_entropy_pallas.py; on TPU
          the BlockSpec-tiled kernels of cross_entropy_tpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import PRECISION, backend, matmul, pad_to, resolve_impl, round_up
from pallas_kernels.cross_entropy_pallas import pallas_cross_entropy

# One chunk of logits in the xla path is at most about CHUNK_BYTES (fp32: 512 tokens at
# V=100k on CPU), and at most MAX_CHUNK tokens, by backend. Measured on CPU (docs/kernels.md):
# 128-token chunks ran ~30% slower than 512 or 1024, probably because h_c^T dz contracts over
# the chunk only (a poor GEMM) and every chunk rewrites the whole fp32 d_weight accumulator.
# On a GPU that rewrite costs d * V * 8 bytes of HBM traffic a chunk, so chunks are larger
# there (docs/kernels.md, "On a GPU"). Still a fraction of naive's memory.
CHUNK_BYTES = {"gpu": 2 * 2**30}
MAX_CHUNK = {"gpu": 8192}
DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNK = 256 * 2**20, 1024


# ---------------------------------------------------------------------------- math
def soft_cap(z: jax.Array, cap: float | None) -> jax.Array:
  """z -> cap * tanh(z / cap) (Gemma-style logit soft cap); identity when cap is None."""
  return z if cap is None else cap * jnp.tanh(z / cap)


def bag(labels: jax.Array):
  """labels [n, s] -> (safe labels, valid mask, has-any-label [n] f32, 1/#valid or 0 [n])."""
  valid = labels >= 0
  count = valid.sum(-1)
  has = (count > 0).astype(jnp.float32)
  inv = has / jnp.maximum(count, 1).astype(jnp.float32)
  return jnp.where(valid, labels, 0), valid, has, inv


def rows_loss(z: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Capped fp32 logits [r, V], labels [r, s] -> (loss [r], lse [r])."""
  m = lax.stop_gradient(z.max(-1))  # the shift cancels in value and gradient
  lse = m + jnp.log(jnp.exp(z - m[:, None]).sum(-1))
  safe, valid, has, inv = bag(labels)
  target = jnp.where(valid, jnp.take_along_axis(z, safe, axis=1), 0.0).sum(-1)
  # has * lse: an all-ignored row gives exactly 0 (and, differentiated, no gradient).
  return has * lse - inv * target, lse


def rows_dlogits(u, labels, lse, g_loss, g_lse, cap):
  """d(sum g_loss*loss + g_lse*lse) / d(pre-cap logits u [r, V]) = (softmax(z) - w) scaled."""
  z = soft_cap(u, cap)
  safe, valid, has, inv = bag(labels)
  dz = (g_loss * has + g_lse)[:, None] * jnp.exp(z - lse[:, None])
  rows = jnp.arange(z.shape[0])[:, None]
  # Scatter-add, so a label repeated in a bag is subtracted once per occurrence.
  dz = dz.at[rows, safe].add(-(g_loss * inv)[:, None] * valid)
  if cap is not None:  # d(cap * tanh(u / cap)) / du = 1 - tanh^2 = 1 - (z / cap)^2
    dz = dz * (1.0 - jnp.square(z / cap))
  return dz


# --------------------------------------------------------------------------- naive
def naive_cross_entropy(hidden, weight, labels, cap):
  """Reference: the full [n, V] logits in fp32, differentiated by JAX."""
  return rows_loss(soft_cap(matmul(hidden, weight), cap), labels)


# ----------------------------------------------------------------------------- xla
def default_chunk(n: int, vocab: int, itemsize: int = 4) -> int:
  """Tokens per chunk: a power of two within CHUNK_BYTES of logits (`itemsize` bytes each), no
  more than n needs."""
  platform = backend()
  rows = max(1, CHUNK_BYTES.get(platform, DEFAULT_CHUNK_BYTES) // (itemsize * vocab))
  c = 1 << (rows.bit_length() - 1)  # the largest power of two <= rows
  return min(max(c, 16), MAX_CHUNK.get(platform, DEFAULT_MAX_CHUNK), round_up(n, 8))


def chunk_logits(h_c, weight):
  """h_c @ weight stored in the operands' dtype (fp32 accumulation inside the matmul), read as fp32.

  The barrier keeps XLA from folding the fp32 convert back into the matmul's output type."""
  z = lax.dot_general(h_c, weight, (((1,), (0,)), ((), ())), precision=PRECISION if h_c.dtype == jnp.float32
                      else None, preferred_element_type=h_c.dtype)
  return lax.optimization_barrier(z).astype(jnp.float32)


def _split(chunk, *xs):
  """[n, ...] -> [n / chunk, chunk, ...] for each x (n is a multiple of chunk here)."""
  return tuple(x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:]) for x in xs)


def _chunk_grads(hidden, weight, labels, lse, g_loss, g_lse, cap, chunk):
  """(d_hidden, d_weight) in fp32, recomputing the logits chunk by chunk."""

  def step(d_weight, xs):
    h_c, lab_c, lse_c, gl_c, gz_c = xs
    dz = rows_dlogits(chunk_logits(h_c, weight), lab_c, lse_c, gl_c, gz_c, cap)
    dz = dz.astype(weight.dtype)  # grads in the input dtype; products still sum in fp32
    d_h = matmul(dz, weight, (1, 1))  # [chunk, V] x [d, V] -> [chunk, d]
    return d_weight + matmul(h_c, dz, (0, 0)), d_h  # += [chunk, d]^T x [chunk, V]

  xs = _split(chunk, hidden, labels, lse, g_loss, g_lse)
  d_weight, d_hidden = lax.scan(step, jnp.zeros(weight.shape, jnp.float32), xs)
  return d_hidden.reshape(hidden.shape), d_weight


# The custom VJP. Recomputing the logits in the backward costs a 4th matmul against the
# naive path's 3 (logits, d_hidden, d_weight), a floor of 4/3 in time. But the backward of
# a mean, masked mean or sum of the loss gets the same cotangent c on every scored row and
# none on lse; for that cotangent the gradient is c times the gradient of sum(loss), which
# the forward can build while each chunk of logits is still alive: 3 matmuls, no recompute.
# So under jax.grad the forward does that, and the backward checks (at run time, the
# cotangent is data) that it got such a cotangent; any other (per-row weights, a z-loss
# through lse) falls back to recomputing, 3 more matmuls. Without jax.grad only the
# primal runs: 1 matmul.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(hidden, weight, labels, cap, chunk):
  def one(xs):
    h_c, lab_c = xs
    return rows_loss(soft_cap(chunk_logits(h_c, weight), cap), lab_c)

  loss, lse = lax.map(one, _split(chunk, hidden, labels))
  return loss.reshape(-1), lse.reshape(-1)


def _chunked_fwd(hidden, weight, labels, cap, chunk):
  ones = jnp.ones((chunk,), jnp.float32)

  def step(d_weight, xs):  # loss, lse and the gradient of sum(loss), one chunk at a time
    h_c, lab_c = xs
    u = chunk_logits(h_c, weight)
    loss, lse = rows_loss(soft_cap(u, cap), lab_c)
    dz = rows_dlogits(u, lab_c, lse, ones, 0 * ones, cap).astype(weight.dtype)
    d_h = matmul(dz, weight, (1, 1))
    return d_weight + matmul(h_c, dz, (0, 0)), (loss, lse, d_h)

  d_weight, (loss, lse, d_hidden) = lax.scan(
      step, jnp.zeros(weight.shape, jnp.float32), _split(chunk, hidden, labels))
  loss, lse = loss.reshape(-1), lse.reshape(-1)
  return (loss, lse), (hidden, weight, labels, lse, d_hidden.reshape(hidden.shape), d_weight)


def _chunked_bwd(cap, chunk, res, cts):
  hidden, weight, labels, lse, d_hidden_sum, d_weight_sum = res
  g_loss, g_lse = cts
  scored = (labels >= 0).any(-1)  # rows with no label have zero gradient whatever g_loss
  c = g_loss[jnp.argmax(scored)]
  uniform = jnp.all((g_loss == c) | ~scored) & jnp.all(g_lse == 0)
  d_hidden, d_weight = lax.cond(
      uniform,
      lambda: (g_loss[:, None] * d_hidden_sum, c * d_weight_sum),
      lambda: _chunk_grads(hidden, weight, labels, lse, g_loss, g_lse, cap, chunk),
  )
  return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def xla_cross_entropy(hidden, weight, labels, cap, chunk):
  """Chunked over tokens; padded rows carry ignored labels, so they add nothing."""
  n = hidden.shape[0]
  n_pad = round_up(n, chunk)
  hidden = pad_to(hidden, (n_pad, hidden.shape[1]))
  labels = pad_to(labels, (n_pad, labels.shape[1]), value=-1)
  loss, lse = _chunked(hidden, weight, labels, cap, chunk)
  return loss[:n], lse[:n]


# -------------------------------------------------------------------------- public
def _check(hidden, weight, labels, cap, chunk_size):
  if hidden.ndim != 2:
    raise ValueError(f"hidden must be [n, d], got shape {hidden.shape}")
  if weight.ndim != 2 or weight.shape[0] != hidden.shape[1]:
    raise ValueError(
        f"weight must be [d, vocab] with d={hidden.shape[1]} (hidden's last axis), "
        f"got shape {weight.shape}"
    )
  if labels.ndim != 2 or labels.shape[0] != hidden.shape[0]:
    raise ValueError(
        f"labels must be [n, s] with n={hidden.shape[0]} (use labels[:, None] for plain "
        f"next-token labels), got shape {labels.shape}"
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
  if cap is not None and not cap > 0:
    raise ValueError(f"logit_soft_cap must be None or > 0, got {cap}")
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")


@functools.partial(
    jax.jit, static_argnames=("impl", "logit_soft_cap", "return_lse", "chunk_size")
)
def fused_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    impl: str = "auto",
    logit_soft_cap: float | None = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
):
  """Per-row (multi-hot) CE of softmax(hidden @ weight): lse(z) - sum_v w_v z_v, REFERENCE.md s.4.

  hidden [n, d], weight [d, vocab], labels [n, s] int (s=1 plain CE, s>1 bag mean,
  negative = ignored, must be < vocab). The loss math is fp32 whatever the input dtype; the
  logits are fp32 in naive and pallas, and the operands' dtype (then fp32) in xla.
  Returns loss [n] float32, or (loss, lse) with return_lse (lse is differentiable too,
  for a z-loss). chunk_size: tokens per chunk for impl="xla" (default: <= 256 MiB of logits).
  impl: one of IMPLS; "auto" is the one measured fastest on this backend (_common.AUTO), else "xla".
  """
  _check(hidden, weight, labels, logit_soft_cap, chunk_size)
  family, interpret = resolve_impl(impl, "cross_entropy")
  labels = labels.astype(jnp.int32)
  # One compute dtype for both matmul operands (bf16 stays bf16, mixed goes up).
  dtype = jnp.promote_types(hidden.dtype, weight.dtype)
  hidden, weight = hidden.astype(dtype), weight.astype(dtype)
  if family == "naive":
    loss, lse = naive_cross_entropy(hidden, weight, labels, logit_soft_cap)
  elif family == "xla":
    chunk = chunk_size or default_chunk(hidden.shape[0], weight.shape[1], jnp.dtype(dtype).itemsize)
    loss, lse = xla_cross_entropy(hidden, weight, labels, logit_soft_cap, chunk)
  else:
    tpu = backend() == "tpu"  # VMEM-tiled kernels there, Triton-style elsewhere
    loss, lse = pallas_cross_entropy(hidden, weight, labels, logit_soft_cap, interpret, tpu)
  return (loss, lse) if return_lse else loss
