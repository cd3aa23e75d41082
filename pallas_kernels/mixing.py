"""Codebook mixture of the NCP head: chat^s = sum_n pi^s_n e^s_n (NCP Eq. 7-10).

mode="softmax": pi^s = softmax_n(logits^s), the paper's convex mixture.
mode="raw":     pi^s = logits^s unnormalised, the released code's default `raw_logits`.

The plain-JAX einsum serves both "naive" and "xla" (there is nothing to chunk: the
weights are the size of the logits). The Pallas kernel fuses softmax and mixture per
(segment, block of rows); its custom VJP recomputes the weights instead of storing them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (MASK, PRECISION, compiler_params, matmul, next_pow2, pad_to,
                                    resolve_impl, round_up)

MODES = ("softmax", "raw")
BLOCK_M = 64  # rows (concepts) per program


def mix_reference(logits, codebook, mode):
  """[..., S, N] x [S, N, K] -> [..., S, K] in the promoted input dtype, computed in fp32."""
  dtype = jnp.promote_types(logits.dtype, codebook.dtype)
  pi = logits.astype(jnp.float32)
  if mode == "softmax":
    pi = jax.nn.softmax(pi, axis=-1)
  # fp32 operands (exact for bf16 inputs): XLA:CPU has no batched bf16 x bf16 -> f32 dot,
  # and the mixture is ~1/32 of the prediction heads' FLOPs, so fp32 costs nothing that matters.
  out = jnp.einsum("...sn,snk->...sk", pi, codebook.astype(jnp.float32), precision=PRECISION)
  return out.astype(dtype)


# ---------------------------------------------------------------------- Pallas
class _Cfg(NamedTuple):
  mode: str
  n: int  # real codebook size N; columns >= n are padding
  bm: int
  interpret: bool


def _weights(l, cfg):
  """fp32 mixture weights of a [rows, N_pad] logits tile; padded columns get weight 0."""
  l = l.astype(jnp.float32)
  if cfg.mode == "raw":
    return l  # padded logits are 0 (and so are the padded codewords)
  real = lax.broadcasted_iota(jnp.int32, (1, l.shape[1]), 1) < cfg.n
  l = jnp.where(real, l, MASK)
  e = jnp.exp(l - l.max(axis=1, keepdims=True))
  return e / e.sum(axis=1, keepdims=True)


def _fwd_kernel(l_ref, e_ref, o_ref, *, cfg):  # [bm, N], [N, K] -> [bm, K], one segment
  pi = _weights(l_ref[...], cfg)
  o_ref[...] = matmul(pi.astype(e_ref.dtype), e_ref[...]).astype(o_ref.dtype)


def _dlogits_kernel(l_ref, e_ref, g_ref, dl_ref, *, cfg):
  dpi = matmul(g_ref[...], e_ref[...], (1, 1))  # [bm, K] x [N, K] -> [bm, N]
  if cfg.mode == "softmax":  # softmax VJP: pi * (dpi - <pi, dpi>)
    pi = _weights(l_ref[...], cfg)
    dpi = pi * (dpi - (pi * dpi).sum(axis=1, keepdims=True))
  dl_ref[...] = dpi


def _dcodebook_kernel(l_ref, g_ref, de_ref, *, cfg):  # l [M, N], g [M, K] -> de [N, K]
  de_ref[...] = jnp.zeros_like(de_ref)

  def block(i, _):
    rows = pl.ds(pl.multiple_of(i * cfg.bm, cfg.bm), cfg.bm)
    pi = _weights(l_ref[rows, :], cfg).astype(g_ref.dtype)
    de_ref[...] += matmul(pi, g_ref[rows, :], (0, 0))  # [bm, N]^T x [bm, K]

  lax.fori_loop(0, l_ref.shape[0] // cfg.bm, block, None)


def _rows(bm, width):  # block (segment s, row block i) of a [S, M, width] array
  return pl.BlockSpec((None, bm, width), lambda s, i: (s, i, 0))


def _segment(shape):  # all rows of segment s of a [S, a, b] array
  return pl.BlockSpec((None, *shape[1:]), lambda s, *_: (s, 0, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mix(l, e, cfg):  # l [S, M, N], e [S, N, K] -> [S, M, K], all padded to tiles
  (s, m, n), k = l.shape, e.shape[2]
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid=(s, m // cfg.bm),
      in_specs=[_rows(cfg.bm, n), _segment(e.shape)],
      out_specs=_rows(cfg.bm, k),
      out_shape=jax.ShapeDtypeStruct((s, m, k), e.dtype),
      interpret=cfg.interpret,
      compiler_params=compiler_params(cfg.interpret),
  )(l, e)


def _mix_fwd(l, e, cfg):
  return _mix(l, e, cfg), (l, e)


def _mix_bwd(cfg, res, g):
  l, e = res
  (s, m, n), k = l.shape, e.shape[2]
  dl = pl.pallas_call(
      functools.partial(_dlogits_kernel, cfg=cfg),
      grid=(s, m // cfg.bm),
      in_specs=[_rows(cfg.bm, n), _segment(e.shape), _rows(cfg.bm, k)],
      out_specs=_rows(cfg.bm, n),
      out_shape=jax.ShapeDtypeStruct((s, m, n), jnp.float32),
      interpret=cfg.interpret,
      compiler_params=compiler_params(cfg.interpret),
  )(l, e, g)
  de = pl.pallas_call(
      functools.partial(_dcodebook_kernel, cfg=cfg),
      grid=(s,),
      in_specs=[_segment(l.shape), _segment(g.shape)],
      out_specs=_segment(e.shape),
      out_shape=jax.ShapeDtypeStruct(e.shape, jnp.float32),
      interpret=cfg.interpret,
      compiler_params=compiler_params(cfg.interpret),
  )(l, g)
  return dl.astype(l.dtype), de.astype(e.dtype)


_mix.defvjp(_mix_fwd, _mix_bwd)


def mix_pallas(logits, codebook, mode, interpret, *, block_m=BLOCK_M):
  """Pallas version: segment-major layout, every axis padded to a power-of-two tile."""
  *lead, s, n = logits.shape
  k = codebook.shape[2]
  dtype = jnp.promote_types(logits.dtype, codebook.dtype)
  l = logits.reshape(-1, s, n).transpose(1, 0, 2)  # [S, M, N]
  m = l.shape[1]
  bm = min(block_m, max(16, next_pow2(m)))
  n_pad, k_pad = max(16, next_pow2(n)), max(16, next_pow2(k))
  l = pad_to(l, (s, round_up(m, bm), n_pad))
  e = pad_to(codebook.astype(dtype), (s, n_pad, k_pad))
  out = _mix(l, e, _Cfg(mode, n, bm, bool(interpret)))  # [S, M_pad, K_pad]
  return out[:, :m, :k].transpose(1, 0, 2).reshape(*lead, s, k)


# ---------------------------------------------------------------------- public
@functools.partial(jax.jit, static_argnames=("mode", "impl"))
def codebook_mix(logits: jax.Array, codebook: jax.Array, *, mode: str = "softmax",
                 impl: str = "auto") -> jax.Array:
  """NCP Eq. 7-10: chat^s = sum_n pi^s_n e^s_n, pi = softmax(logits) ("softmax") or logits ("raw").

  logits [..., S, N], codebook [S, N, d/S] -> [..., S, d/S] in the promoted input dtype.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if codebook.ndim != 3 or logits.ndim < 2 or logits.shape[-2:] != codebook.shape[:2]:
    raise ValueError(
        f"need logits [..., S, N] and codebook [S, N, d/S] with the same S, N; got "
        f"logits {logits.shape}, codebook {codebook.shape}"
    )
  family, interpret = resolve_impl(impl, "codebook_mix")
  if family == "pallas":
    return mix_pallas(logits, codebook, mode, interpret)
  return mix_reference(logits, codebook, mode)  # "naive" and "xla" are the same einsum
