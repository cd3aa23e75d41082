"""Pallas kernels for fused_cross_entropy: tokens x vocab tiles, online logsumexp, recompute.

Written in the Triton (GPU) style of jax.experimental.pallas.ops.gpu.attention: the grid
runs over the axis a program owns (token blocks, or vocab tiles for d_weight) and the
reduction runs as a fori_loop inside the kernel, because GPU programs run concurrently
and must not accumulate into a shared output block. Operands are passed whole and sliced
with pl.ds; every tile is a power of two (>= 16) and every dot accumulates in fp32.

  forward   grid over token blocks; loop over vocab tiles: z = h_i @ W_j (the d axis in
            slices of block_d), online logsumexp (running max m, running sum l), and the
            bag term sum_v count_v z_v from one-hot compares of the labels with the tile.
  d_hidden  grid over token blocks; loop over vocab tiles: recompute z, dz = softmax - w
            scaled by the cotangents, dh_i += dz @ W_j^T.
  d_weight  grid over vocab tiles; loop over token blocks: recompute z, dW_j += h_i^T @ dz.

The two backward kernels each recompute the logits (5 matmuls in all against 3 for the
naive path): the price of writing every output block from exactly one program, without
atomics. Inputs are padded to whole tiles; padded vocab columns are masked out of the
logsumexp, padded rows carry ignored labels and zero cotangents.

Whole operands cannot sit in a TPU core's VMEM, so on TPU the custom VJP below runs the
BlockSpec-tiled kernels of cross_entropy_tpu.py instead (same math, same padding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import cross_entropy_tpu
from pallas_kernels._common import MASK, compiler_params, matmul, next_pow2, pad_to, round_up

# Default tiles, sized for a GPU program: a [64, 128] fp32 logits tile plus [64, 64] and
# [64, 128] operand slices stay in registers / shared memory.
BLOCK_N, BLOCK_V, BLOCK_D = 64, 128, 64


class _Cfg(NamedTuple):  # static (hashable) kernel parameters
  vocab: int  # real vocab size; columns >= vocab are padding
  cap: float | None
  bn: int
  bv: int
  bd: int  # on TPU: the whole padded d
  interpret: bool
  tpu: bool  # the kernels of cross_entropy_tpu.py


# ------------------------------------------------------------------ tile helpers
def _d_slice(k, cfg):
  """The k-th slice of bd along d. Values are only ever made bd wide along d: Triton wants
  every array a power of two, and d (padded to a multiple of bd) need not be one."""
  return pl.ds(pl.multiple_of(k * cfg.bd, cfg.bd), cfg.bd)


def _tile_logits(h_ref, w_ref, rows, col0, cfg):
  """Pre-cap fp32 logits h[rows] @ W[:, col0:col0+bv], the d axis taken bd at a time."""

  def step(k, acc):
    ks = _d_slice(k, cfg)
    return acc + matmul(h_ref[rows, ks], w_ref[ks, pl.ds(col0, cfg.bv)])

  zero = jnp.zeros((cfg.bn, cfg.bv), jnp.float32)
  return lax.fori_loop(0, h_ref.shape[1] // cfg.bd, step, zero)


def _soft_cap(z, cap):
  return z if cap is None else cap * jnp.tanh(z / cap)


def _counts(label_refs, rows, col0, cfg):
  """[bn, bv] fp32: how often each column of the tile occurs in each row's bag."""
  cols = col0 + lax.broadcasted_iota(jnp.int32, (1, cfg.bv), 1)
  counts = jnp.zeros((cfg.bn, cfg.bv), jnp.float32)
  for lab_ref in label_refs:  # one ref per bag slot; s is small and static
    counts += (lab_ref[rows][:, None] == cols).astype(jnp.float32)  # ignored (<0) never match
  return counts


def _bag_scale(label_refs, rows):
  """(has any label [bn], 1/#non-ignored labels or 0 [bn]) of a row block."""
  n_valid = sum((lab_ref[rows] >= 0).astype(jnp.float32) for lab_ref in label_refs)
  has = (n_valid > 0).astype(jnp.float32)
  return has, has / jnp.maximum(n_valid, 1.0)


def _tile_dlogits(h_ref, w_ref, lse_ref, gl_ref, gz_ref, label_refs, rows, col0, cfg):
  """d(sum g_loss*loss + g_lse*lse)/d(pre-cap logits) on one tile: scaled softmax - w."""
  z = _soft_cap(_tile_logits(h_ref, w_ref, rows, col0, cfg), cfg.cap)
  real = col0 + lax.broadcasted_iota(jnp.int32, (1, cfg.bv), 1) < cfg.vocab
  counts = _counts(label_refs, rows, col0, cfg)
  has, inv = _bag_scale(label_refs, rows)
  g_loss, g_lse = gl_ref[rows], gz_ref[rows]
  p = jnp.exp(jnp.where(real, z, MASK) - lse_ref[rows][:, None])
  dz = (g_loss * has + g_lse)[:, None] * p - (g_loss * inv)[:, None] * counts
  if cfg.cap is not None:  # through cap * tanh(u / cap): times 1 - (z / cap)^2
    dz = dz * (1.0 - jnp.square(z / cfg.cap))
  return dz


# ----------------------------------------------------------------------- kernels
def _fwd_kernel(h_ref, w_ref, *refs, cfg):
  *label_refs, loss_ref, lse_ref = refs
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * cfg.bn, cfg.bn), cfg.bn)

  def tile(j, carry):
    m, l, t = carry
    col0 = pl.multiple_of(j * cfg.bv, cfg.bv)
    z = _soft_cap(_tile_logits(h_ref, w_ref, rows, col0, cfg), cfg.cap)
    real = col0 + lax.broadcasted_iota(jnp.int32, (1, cfg.bv), 1) < cfg.vocab
    z = jnp.where(real, z, MASK)
    m_new = jnp.maximum(m, z.max(axis=1))
    l = l * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(axis=1)
    counts = _counts(label_refs, rows, col0, cfg)
    return m_new, l, t + (counts * z).sum(axis=1)  # counts are 0 on masked columns

  init = (jnp.full((cfg.bn,), MASK, jnp.float32),) + (jnp.zeros((cfg.bn,), jnp.float32),) * 2
  m, l, t = lax.fori_loop(0, w_ref.shape[1] // cfg.bv, tile, init)
  lse = m + jnp.log(l)
  has, inv = _bag_scale(label_refs, rows)
  loss_ref[...] = has * lse - inv * t  # an all-ignored row: exactly 0
  lse_ref[...] = lse


def _dhidden_kernel(h_ref, w_ref, lse_ref, gl_ref, gz_ref, *refs, cfg):
  *label_refs, dh_ref = refs  # dh_ref: this program's [bn, d] fp32 block
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * cfg.bn, cfg.bn), cfg.bn)
  n_d = h_ref.shape[1] // cfg.bd

  def zero(k, _):
    dh_ref[:, _d_slice(k, cfg)] = jnp.zeros((cfg.bn, cfg.bd), jnp.float32)

  def tile(j, _):
    col0 = pl.multiple_of(j * cfg.bv, cfg.bv)
    dz = _tile_dlogits(h_ref, w_ref, lse_ref, gl_ref, gz_ref, label_refs, rows, col0, cfg)
    dz = dz.astype(w_ref.dtype)

    def acc(k, _):
      ks = _d_slice(k, cfg)
      dh_ref[:, ks] += matmul(dz, w_ref[ks, pl.ds(col0, cfg.bv)], (1, 1))

    lax.fori_loop(0, n_d, acc, None)

  lax.fori_loop(0, n_d, zero, None)
  lax.fori_loop(0, w_ref.shape[1] // cfg.bv, tile, None)


def _dweight_kernel(h_ref, w_ref, lse_ref, gl_ref, gz_ref, *refs, cfg):
  *label_refs, dw_ref = refs  # dw_ref: this program's [d, bv] fp32 block
  col0 = pl.multiple_of(pl.program_id(0) * cfg.bv, cfg.bv)
  n_d = h_ref.shape[1] // cfg.bd

  def zero(k, _):
    dw_ref[_d_slice(k, cfg), :] = jnp.zeros((cfg.bd, cfg.bv), jnp.float32)

  def block(i, _):
    rows = pl.ds(pl.multiple_of(i * cfg.bn, cfg.bn), cfg.bn)
    dz = _tile_dlogits(h_ref, w_ref, lse_ref, gl_ref, gz_ref, label_refs, rows, col0, cfg)
    dz = dz.astype(h_ref.dtype)

    def acc(k, _):
      ks = _d_slice(k, cfg)
      dw_ref[ks, :] += matmul(h_ref[rows, ks], dz, (0, 0))

    lax.fori_loop(0, n_d, acc, None)

  lax.fori_loop(0, n_d, zero, None)
  lax.fori_loop(0, h_ref.shape[0] // cfg.bn, block, None)


# ------------------------------------------------------------- calls and the VJP
def _whole(x):
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _call(kernel, cfg, grid, out_spec, out_shape, *args):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg),
      grid=grid,
      in_specs=[_whole(a) for a in args],
      out_specs=out_spec,
      out_shape=out_shape,
      interpret=cfg.interpret,
      compiler_params=compiler_params(cfg.interpret),
  )(*args)


def _label_columns(labels):
  # One 1-D ref per bag slot: the kernel reads a [bn] vector per slot, which needs no
  # power-of-two s and no slicing of a loaded tile.
  return [labels[:, k] for k in range(labels.shape[1])]


def _forward(h, w, labels, cfg):
  n = h.shape[0]
  vec = jax.ShapeDtypeStruct((n,), jnp.float32)
  spec = pl.BlockSpec((cfg.bn,), lambda i: (i,))
  return _call(
      _fwd_kernel, cfg, (n // cfg.bn,), [spec, spec], [vec, vec], h, w, *_label_columns(labels)
  )


def _backward(h, w, labels, lse, g_loss, g_lse, cfg):
  (n, d), v = h.shape, w.shape[1]
  args = (h, w, lse, g_loss, g_lse, *_label_columns(labels))
  dh = _call(
      _dhidden_kernel, cfg, (n // cfg.bn,), pl.BlockSpec((cfg.bn, d), lambda i: (i, 0)),
      jax.ShapeDtypeStruct((n, d), jnp.float32), *args,
  )
  dw = _call(
      _dweight_kernel, cfg, (v // cfg.bv,), pl.BlockSpec((d, cfg.bv), lambda j: (0, j)),
      jax.ShapeDtypeStruct((d, v), jnp.float32), *args,
  )
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ce(h, w, labels, cfg):
  return _ce_fwd(h, w, labels, cfg)[0]


def _ce_fwd(h, w, labels, cfg):
  loss, lse = (cross_entropy_tpu.forward if cfg.tpu else _forward)(h, w, labels, cfg)
  return (loss, lse), (h, w, labels, lse)


def _ce_bwd(cfg, res, cts):
  h, w, labels, lse = res
  dh, dw = (cross_entropy_tpu.backward if cfg.tpu else _backward)(h, w, labels, lse, *cts, cfg)
  return dh.astype(h.dtype), dw.astype(w.dtype), None


_ce.defvjp(_ce_fwd, _ce_bwd)


def pallas_cross_entropy(hidden, weight, labels, cap, interpret, tpu=False, *,
                         block_n=BLOCK_N, block_v=BLOCK_V, block_d=BLOCK_D):
  """(loss [n], lse [n]) of the Pallas kernels; pads every axis to whole tiles.

  tpu: the TPU kernels (cross_entropy_tpu.py, their own tiles) instead of the Triton-style
  ones with tiles block_*."""
  (n, d), vocab = hidden.shape, weight.shape[1]
  if tpu:
    bn, bv, bd = cross_entropy_tpu.tiles(n, d, vocab, hidden.dtype)
  else:  # shrink a tile to the (power-of-two) problem size when the problem is smaller
    bn, bv, bd = (min(b, max(16, next_pow2(x))) for b, x in
                  ((block_n, n), (block_v, vocab), (block_d, d)))
  n_pad, v_pad, d_pad = round_up(n, bn), round_up(vocab, bv), round_up(d, bd)
  h = pad_to(hidden, (n_pad, d_pad))
  w = pad_to(weight, (d_pad, v_pad))
  labels = pad_to(labels, (n_pad, labels.shape[1]), value=-1)
  cfg = _Cfg(vocab, cap, bn, bv, bd, bool(interpret), bool(tpu))
  loss, lse = _ce(h, w, labels, cfg)
  return loss[:n], lse[:n]
