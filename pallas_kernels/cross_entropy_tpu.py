"""TPU (Mosaic) form of the fused_cross_entropy kernels: BlockSpec tiles, grid reductions.

Same math as cross_entropy_pallas.py, laid out for a TPU core instead of a GPU. A TPU runs
the grid as a sequential loop (split over cores along "parallel" axes only), and a kernel
sees only the blocks its BlockSpecs copy into VMEM; so the reductions run over the last
grid axis ("arbitrary"), into VMEM scratch or into an output block that stays resident
while its block index does not change. Blocks hold the whole (padded) d axis, so one dot
makes a [bn, bv] logits tile.

  forward   grid (token tiles, vocab tiles): online logsumexp (running max m, sum l) and
            the bag term sum_v count_v z_v in [bn, 1] scratch; loss and lse written on
            the last vocab tile.
  d_hidden  grid (token tiles, vocab tiles): recompute the tile, dz = softmax - w scaled
            by the cotangents, dh_i += dz @ W_j^T into the resident fp32 [bn, d] block.
  d_weight  grid (vocab tiles, token tiles): recompute, dW_j += h_i^T @ dz into the
            resident fp32 [d, bv] block.

Per-row vectors (lse, cotangents, outputs) are [n, 1]: a (bn, 1) block is legal on TPU
(last dim = full dim) where a 1-D (bn,) block would need bn % 128 == 0 and a relayout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import MASK, matmul, round_up

# Default tiles: MXU-sized (multiples of 128 / 256). bv shrinks for a wide d (see tiles()).
BLOCK_N, BLOCK_V = 256, 512
# VMEM the kernels may use: under v7x's 64 MiB per core, above the 16/32 MiB scoped default.
VMEM_BUDGET = 48 * 2**20


def _vmem_bytes(bn, bv, d, itemsize):
  """Footprint of the largest kernel (d_weight): double-buffered h, W and fp32 dW blocks,
  plus a few fp32 [bn, bv] temporaries (logits, softmax, dz)."""
  return 2 * (bn * d + d * bv) * itemsize + 2 * d * bv * 4 + 4 * bn * bv * 4


def tiles(n, d, vocab, dtype):
  """(bn, bv, d_pad). bn a multiple of 16 (bf16 packs 16 rows per vreg), bv and d_pad of
  128 (lanes); bv about halves (down to 128) until the blocks fit VMEM_BUDGET."""
  itemsize = jnp.dtype(dtype).itemsize
  bn, bv = min(BLOCK_N, round_up(n, 16)), min(BLOCK_V, round_up(vocab, 128))
  d_pad = round_up(d, 128)
  while bv > 128 and _vmem_bytes(bn, bv, d_pad, itemsize) > VMEM_BUDGET:
    bv = round_up(bv // 2, 128)  # e.g. 384 -> 256, never off the lane multiple
  return bn, bv, d_pad


def _soft_cap(z, cap):
  return z if cap is None else cap * jnp.tanh(z / cap)


def _tile(h_ref, w_ref, lab_ref, col0, cfg):
  """(capped fp32 logits z [bn, bv], real-column mask [1, bv], bag counts [bn, bv])."""
  z = _soft_cap(matmul(h_ref[...], w_ref[...]), cfg.cap)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (1, cfg.bv), 1)
  labels = lab_ref[...]
  counts = jnp.zeros(z.shape, jnp.float32)
  for k in range(labels.shape[1]):  # s is small and static; ignored labels (< 0) never match
    counts += (labels[:, k:k + 1] == cols).astype(jnp.float32)
  return z, cols < cfg.vocab, counts


def _bag_scale(lab_ref):
  """(has any label [bn, 1], 1/#non-ignored labels or 0 [bn, 1])."""
  n_valid = (lab_ref[...] >= 0).astype(jnp.float32).sum(axis=1, keepdims=True)
  has = (n_valid > 0).astype(jnp.float32)
  return has, has / jnp.maximum(n_valid, 1.0)


def _dlogits(h_ref, w_ref, lab_ref, lse_ref, gl_ref, gz_ref, col0, cfg):
  """d(sum g_loss*loss + g_lse*lse)/d(pre-cap logits) on one tile: scaled softmax - w."""
  z, real, counts = _tile(h_ref, w_ref, lab_ref, col0, cfg)
  has, inv = _bag_scale(lab_ref)
  g_loss, g_lse = gl_ref[...], gz_ref[...]
  p = jnp.exp(jnp.where(real, z, MASK) - lse_ref[...])
  dz = (g_loss * has + g_lse) * p - (g_loss * inv) * counts
  if cfg.cap is not None:  # through cap * tanh(u / cap): times 1 - (z / cap)^2
    dz = dz * (1.0 - jnp.square(z / cfg.cap))
  return dz


# ----------------------------------------------------------------------- kernels
def _fwd_kernel(h_ref, w_ref, lab_ref, loss_ref, lse_ref, m_ref, l_ref, t_ref, *, cfg):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    t_ref[...] = jnp.zeros(t_ref.shape, jnp.float32)

  z, real, counts = _tile(h_ref, w_ref, lab_ref, j * cfg.bv, cfg)
  z = jnp.where(real, z, MASK)  # every vocab tile has a real column: m is finite after it
  m = m_ref[...]
  m_new = jnp.maximum(m, z.max(axis=1, keepdims=True))
  l_ref[...] = l_ref[...] * jnp.exp(m - m_new) + jnp.exp(z - m_new).sum(axis=1, keepdims=True)
  m_ref[...] = m_new
  t_ref[...] += (counts * z).sum(axis=1, keepdims=True)  # counts are 0 on masked columns

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    lse = m_ref[...] + jnp.log(l_ref[...])
    has, inv = _bag_scale(lab_ref)
    loss_ref[...] = has * lse - inv * t_ref[...]  # an all-ignored row: exactly 0
    lse_ref[...] = lse


def _dhidden_kernel(h_ref, w_ref, lab_ref, lse_ref, gl_ref, gz_ref, dh_ref, *, cfg):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

  dz = _dlogits(h_ref, w_ref, lab_ref, lse_ref, gl_ref, gz_ref, j * cfg.bv, cfg)
  dh_ref[...] += matmul(dz.astype(w_ref.dtype), w_ref[...], (1, 1))  # [bn, bv] x [d, bv]^T


def _dweight_kernel(h_ref, w_ref, lab_ref, lse_ref, gl_ref, gz_ref, dw_ref, *, cfg):
  @pl.when(pl.program_id(1) == 0)
  def _init():
    dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

  dz = _dlogits(h_ref, w_ref, lab_ref, lse_ref, gl_ref, gz_ref, pl.program_id(0) * cfg.bv, cfg)
  dw_ref[...] += matmul(h_ref[...], dz.astype(h_ref.dtype), (0, 0))  # [bn, d]^T x [bn, bv]


# ------------------------------------------------------------------------ calls
def _specs(cfg, d, s, vocab_major):
  """BlockSpecs (h, W, labels, one [n, 1] row vector) on a (token, vocab) grid, or on a
  (vocab, token) grid when vocab_major."""
  tok = (lambda a, b: b) if vocab_major else (lambda a, b: a)
  voc = (lambda a, b: a) if vocab_major else (lambda a, b: b)
  return (pl.BlockSpec((cfg.bn, d), lambda a, b: (tok(a, b), 0)),
          pl.BlockSpec((d, cfg.bv), lambda a, b: (0, voc(a, b))),
          pl.BlockSpec((cfg.bn, s), lambda a, b: (tok(a, b), 0)),
          pl.BlockSpec((cfg.bn, 1), lambda a, b: (tok(a, b), 0)))


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, scratch, *args):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      interpret=cfg.interpret,
      # The reduction axis (last) must run in order on one core; the other may be split.
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_BUDGET + 8 * 2**20),
  )(*args)


def forward(h, w, labels, cfg):
  """(loss [n], lse [n]) of padded h [n, d], w [d, V], labels [n, s]."""
  (n, d), (v, s) = h.shape, (w.shape[1], labels.shape[1])
  h_spec, w_spec, lab_spec, row = _specs(cfg, d, s, vocab_major=False)
  vec = jax.ShapeDtypeStruct((n, 1), jnp.float32)
  loss, lse = _call(_fwd_kernel, cfg, (n // cfg.bn, v // cfg.bv), [h_spec, w_spec, lab_spec],
                    [row, row], [vec, vec], [pltpu.VMEM((cfg.bn, 1), jnp.float32)] * 3,
                    h, w, labels)
  return loss[:, 0], lse[:, 0]


def backward(h, w, labels, lse, g_loss, g_lse, cfg):
  """(d_hidden, d_weight) in fp32 for the cotangents g_loss, g_lse [n] of (loss, lse)."""
  (n, d), (v, s) = h.shape, (w.shape[1], labels.shape[1])
  args = (h, w, labels, lse[:, None], g_loss[:, None], g_lse[:, None])
  h_spec, w_spec, lab_spec, row = _specs(cfg, d, s, vocab_major=False)
  dh = _call(_dhidden_kernel, cfg, (n // cfg.bn, v // cfg.bv),
             [h_spec, w_spec, lab_spec, row, row, row], h_spec,
             jax.ShapeDtypeStruct((n, d), jnp.float32), [], *args)
  h_spec, w_spec, lab_spec, row = _specs(cfg, d, s, vocab_major=True)
  dw = _call(_dweight_kernel, cfg, (v // cfg.bv, n // cfg.bn),
             [h_spec, w_spec, lab_spec, row, row, row], w_spec,
             jax.ShapeDtypeStruct((d, v), jnp.float32), [], *args)
  return dh, dw
