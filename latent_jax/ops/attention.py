"""Causal, sliding-window, document-masked GQA self-attention, one function and a chooser `impl`.

    attention(q, k, v, segment_ids, positions, window, impl="auto", block=None, windows=(NO_WINDOW,))
    q [B, T, H, D], k/v [B, T, K, D], segment_ids/positions [B, T] int, window int (may be traced)

A query sees a key iff both are in the same segment, the key's position is <= the query's and
closer than `window` (`transformer.attention_mask`). Implementations (IMPLS):

  dense        the [B, T, T] mask and [B, K, G, T, T] fp32 scores; the reference.
  xla_blocked  online softmax over key blocks (flash attention in plain JAX): memory
               O(T * block) forward and backward (custom VJP recomputing each block), key
               blocks wholly outside the causal window skipped. Any backend.
  pallas_tpu   Pallas splash attention (TPU; interpreted elsewhere): causal local-window mask
               and segment ids, one kernel per static window size in `windows`.
  pallas_gpu   full-causal layers: jax's Pallas (Triton) flash attention with segment ids;
               windowed layers: xla_blocked (that kernel has no window; docs/kernels.md).
  cudnn        cuDNN's fused flash attention (jax.nn.dot_product_attention), causal and
               windowed layers alike; packed documents through a mask (GPU, bf16/fp16 only).
  auto         dense when T <= BLOCK; beyond it by backend and compute dtype (AUTO, from the
               measurements in docs/kernels.md), xla_blocked where nothing was measured. (On CPU
               xla_blocked already runs in 0.70x dense's time at T = 128, but compiles 1.1-1.7 s
               slower for the tiny configs' steps, more than a short run at that size gains.)

The Pallas kernels mask by sequence index; they run only where that equals the mask by
position (`index_masks_exact`, checked on the traced batch), and xla_blocked runs otherwise.

KV-cache decoding (queries against a cache of other positions) uses the dense path directly.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from latent_jax.config import ATTENTION_IMPLS
from latent_jax.sharding import per_head_shard
from latent_jax.ops import transformer as T
from pallas_kernels._common import backend as kernel_backend, device_kind as kernel_device_kind

IMPLS = ATTENTION_IMPLS
BLOCK = 128  # xla_blocked's block from T = 512 on, within noise of the best on CPU (docs/kernels.md)
MIN_BLOCK = 64  # ... and the smallest it takes for shorter rows (block_size)
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite -inf: exp underflows to 0, 0 * MASK is 0


def dense_attention(q, k, v, segment_ids, positions, window):
  """softmax(q k^T / sqrt(D) + mask) v with the whole [B, T, T] mask: the reference."""
  mask = T.attention_mask(positions, positions, segment_ids, segment_ids, window)
  return T.attention(q, k, v, mask)


# ---------------------------------------------------------------------------- xla_blocked
# Block skipping with a traced window: the loops run over every (query block, key block) pair
# with a static length (scan, so reverse mode works), and `lax.cond` on a scalar computed from
# the two block indices and the window skips a pair wholly above the diagonal or wholly
# further back than the window. The predicate depends on indices only, not on the batch's
# data, so it costs nothing and needs no cross-device reduction when the batch is sharded.
# Inside a block the mask is the dense one (positions and segments), so the result equals
# dense whenever positions grow by at least one per token inside a document (packed rows,
# TST bags, concept positions): then a key later in the sequence, or more than `window`
# indices back, is masked anyway. Padding (segment 0, every position 0) breaks that and its
# rows may differ from dense; no loss reads them.
def block_visible(i, j, block, window):
  """Whether query block i may see any key of key block j (causal, within the window)."""
  return (j <= i) & ((i - j - 1) * block + 1 < window)


def block_scores(q, k, seg_q, seg_k, pos_q, pos_k, window):
  """Scaled fp32 scores [B, K, G, bq, bk] of one block pair and its mask [B, 1, 1, bq, bk]."""
  s = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  mask = T.attention_mask(pos_q, pos_k, seg_q, seg_k, window)[:, None, None]
  return jnp.where(mask, s, MASK), mask


def split_blocks(x, block, axis):
  """Split `axis` (n * block long) into blocks, the block index first: [n, ..., block, ...]."""
  return jnp.moveaxis(x.reshape(*x.shape[:axis], -1, block, *x.shape[axis + 1:]), axis, 0)


def merge_blocks(x, axis):
  """The inverse of split_blocks: [n, ..., block, ...] -> [..., n * block, ...] at `axis`."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


# Inside the loops q, out and their gradients are head-major [B, K, G, T, D] and k, v [B, K, T, D]:
# every block product is then a plain batched matmul over (B, K), with no per-block transposes.
def blocked_forward(q, k, v, seg, pos, window, block):
  """Flash-attention forward: out [B, K, G, T, D] and lse [B, K, G, T] (fp32)."""
  qs, ks, vs = split_blocks(q, block, 3), split_blocks(k, block, 2), split_blocks(v, block, 2)
  segs, poss = split_blocks(seg, block, 1), split_blocks(pos, block, 1)
  b, kh, g, _, d = q.shape

  def query_block(i):
    qi, seg_i, pos_i = qs[i], segs[i], poss[i]

    def key_block(carry, j):
      def update(carry):
        m, l, acc = carry
        s, mask = block_scores(qi, ks[j], seg_i, segs[j], pos_i, poss[j], window)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vs[j], preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv
      return lax.cond(block_visible(i, j, block, window), update, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, block), MASK, jnp.float32), jnp.zeros((b, kh, g, block), jnp.float32),
            jnp.zeros((b, kh, g, block, d), jnp.float32))
    (m, l, acc), _ = lax.scan(key_block, init, jnp.arange(len(ks)))
    l = jnp.where(l == 0, 1.0, l)  # a row that sees no key (block padding) gets 0
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  out, lse = lax.map(query_block, jnp.arange(len(qs)))
  return merge_blocks(out, 3), merge_blocks(lse, 3)


def blocked_backward(q, k, v, seg, pos, window, block, out, lse, dout):
  """Flash-attention backward, one pass: for each key block, loop over the query blocks that
  see it, accumulating dk, dv for the block and dq for every query block (recomputing p)."""
  scale = q.shape[-1] ** -0.5
  delta = jnp.einsum("bkgqd,bkgqd->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))
  qs, dos, ks, vs = split_blocks(q, block, 3), split_blocks(dout, block, 3), split_blocks(k, block, 2), split_blocks(v, block, 2)
  segs, poss, lses, deltas = split_blocks(seg, block, 1), split_blocks(pos, block, 1), split_blocks(lse, block, 3), split_blocks(delta, block, 3)

  def key_block(dq, j):
    kj, vj = ks[j], vs[j]

    def query_block(carry, i):
      def update(carry):
        dk, dv, dq = carry
        s, mask = block_scores(qs[i], kj, segs[i], segs[j], poss[i], poss[j], window)
        p = jnp.where(mask, jnp.exp(s - lses[i][..., None]), 0.0)                         # [b,k,g,q,s]
        dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dos.dtype), dos[i], preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqd,bksd->bkgqs", dos[i], vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - deltas[i][..., None]) * scale).astype(q.dtype)
        dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qs[i], preferred_element_type=jnp.float32)
        dq = dq.at[i].add(jnp.einsum("bkgqs,bksd->bkgqd", ds, kj, preferred_element_type=jnp.float32))
        return dk, dv, dq
      return lax.cond(block_visible(i, j, block, window), update, lambda c: c, carry), None

    zeros = jnp.zeros(kj.shape, jnp.float32)
    (dk, dv, dq), _ = lax.scan(query_block, (zeros, zeros, dq), jnp.arange(len(qs)))
    return dq, (dk, dv)

  dq, (dk, dv) = lax.scan(key_block, jnp.zeros(qs.shape, jnp.float32), jnp.arange(len(ks)))
  return merge_blocks(dq, 3).astype(q.dtype), merge_blocks(dk, 2).astype(k.dtype), merge_blocks(dv, 2).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _blocked(q, k, v, seg, pos, window, block):
  return blocked_forward(q, k, v, seg, pos, window, block)[0]


def _blocked_fwd(q, k, v, seg, pos, window, block):
  out, lse = blocked_forward(q, k, v, seg, pos, window, block)
  return out, (q, k, v, seg, pos, window, out, lse)


def _blocked_bwd(block, res, dout):
  q, k, v, seg, pos, window, out, lse = res
  dq, dk, dv = blocked_backward(q, k, v, seg, pos, window, block, out, lse, dout)
  return dq, dk, dv, None, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_attention(q, k, v, segment_ids, positions, window, block=BLOCK):
  """Flash attention in plain JAX over blocks of `block` tokens; T is padded to whole blocks
  with keys of segment -1, which no query sees."""
  b, t, h, d = q.shape
  kh = k.shape[2]
  block = min(block, t)
  pad = -t % block
  if pad:
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    q, k, v, positions = (jnp.pad(x, widths(x)) for x in (q, k, v, positions))
    segment_ids = jnp.pad(segment_ids, widths(segment_ids), constant_values=-1)
  q = q.reshape(b, t + pad, kh, h // kh, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
  k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))                   # [B, K, T, D]
  window = jnp.asarray(window, jnp.int32)
  out = _blocked(q, k, v, segment_ids.astype(jnp.int32), positions.astype(jnp.int32), window, block)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t + pad, h, d)[:, :t]


def block_size(seq_len):
  """xla_blocked's block for rows of seq_len tokens: BLOCK, or seq_len / 4 (at least MIN_BLOCK) if
  smaller, so a short row still has blocks above the diagonal to skip: 16 x 256 tokens took
  0.79x the time in blocks of 64 as in blocks of 128 (docs/kernels.md)."""
  return min(BLOCK, max(MIN_BLOCK, seq_len // 4))


# ------------------------------------------------------------------------- Pallas kernels
# Splash and jax's GPU kernel mask by sequence index (causal, `window - 1` keys back) and
# segment. That is the dense mask by position when positions rise inside each document, by
# exactly one per token under a window: packed rows, but not TST's positions="token" bags or
# ConceptLM's concept_positions="token" (steps of s or k, the window counted in tokens). The
# batch decides at run time, so every caller is exact and no config has to know.
def index_masks_exact(segment_ids, positions, window):
  """Whether the masks by index equal the dense mask on every real (segment > 0) token."""
  step = positions[:, 1:] - positions[:, :-1]
  rises = jnp.where(window >= T.NO_WINDOW, step >= 1, step == 1)
  same_doc = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  return jnp.all(rises | ~same_doc)


# ----------------------------------------------------------------------------- pallas_tpu
# Splash attention's masks are static NumPy-level objects, while the window arrives traced
# (one per scanned layer). A config has few window sizes (a window and NO_WINDOW), so one
# kernel is built per size and lax.switch picks the one equal to the traced window; a window
# outside `windows` runs xla_blocked.
SPLASH_BLOCK = 128  # splash's default block sizes; T is padded to a multiple


def splash_kernel(t, heads, window, interpret):
  """A splash MHA/GQA kernel over [H, T, D] for one static window (NO_WINDOW = plain causal)."""
  mask = splash.CausalMask((t, t)) if window >= t else splash.LocalMask((t, t), (window - 1, 0), 0)
  return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=1,
                                block_sizes=splash.BlockSizes.get_default(), interpret=interpret)


def splash_attention(q, k, v, segment_ids, window, windows, interpret):
  """Splash attention for q [B,T,H,D], k/v [B,T,K,D]; `window` must be one of `windows`."""
  b, t, h, d = q.shape
  pad = -t % SPLASH_BLOCK
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  q, k, v = (jnp.moveaxis(jnp.pad(x, widths(x)), 2, 1) for x in (q * d ** -0.5, k, v))  # [B, heads, T, D]
  seg = jnp.pad(segment_ids.astype(jnp.int32), widths(segment_ids), constant_values=-1)
  ids = splash.SegmentIds(q=seg, kv=seg)
  branches = [lambda w=w: jax.vmap(splash_kernel(t + pad, h, w, interpret))(q, k, v, segment_ids=ids)
              for w in windows]
  index = jnp.argmax(jnp.asarray(windows) == window)
  return jnp.moveaxis(lax.switch(index, branches), 1, 2)[:, :t]


def tpu_attention(q, k, v, segment_ids, positions, window, windows, block, interpret):
  """pallas_tpu: splash where its masks are exact and `window` is one of `windows`, else xla_blocked."""
  window = jnp.asarray(window, jnp.int32)
  known = jnp.any(jnp.asarray(windows, jnp.int32) == window)
  return lax.cond(known & index_masks_exact(segment_ids, positions, window),
                  lambda: splash_attention(q, k, v, segment_ids, window, windows, interpret),
                  lambda: blocked_attention(q, k, v, segment_ids, positions, window, block))


# ----------------------------------------------------------------------------- pallas_gpu
# jax.nn.dot_product_attention(implementation="cudnn") takes is_causal and a static
# local_window_size but no segment ids (only per-row lengths), so it cannot mask packed
# documents; jax's Pallas GPU kernel (ops/gpu/attention.py) masks causal + segments but has no
# window. So full-causal layers run that kernel and windowed layers xla_blocked, picked by
# lax.cond on the traced window (and on `index_masks_exact`).
def pallas_gpu_causal(q, k, v, segment_ids, interpret):
  """jax's Pallas GPU flash attention, causal with segment ids; K/V heads repeated to H."""
  b, t, h, d = q.shape
  pad = -t % 128  # its forward block
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  q, k, v = (jnp.pad(x, widths(x)) for x in (q, k, v))
  seg = jnp.pad(segment_ids.astype(jnp.int32), widths(segment_ids), constant_values=-1)
  out = pallas_gpu.mha(q, k, v, seg, sm_scale=d ** -0.5, causal=True, interpret=interpret)
  return out[:, :t]


def gpu_attention(q, k, v, segment_ids, positions, window, block, interpret):
  """pallas_gpu: the Pallas kernel for full-causal layers, xla_blocked for windowed ones."""
  window = jnp.asarray(window, jnp.int32)
  return lax.cond((window >= T.NO_WINDOW) & index_masks_exact(segment_ids, positions, window),
                  lambda: pallas_gpu_causal(q, k, v, segment_ids, interpret),
                  lambda: blocked_attention(q, k, v, segment_ids, positions, window, block))


# ---------------------------------------------------------------------------------- cudnn
# jax.nn.dot_product_attention(implementation="cudnn") skips the key blocks that its causal
# mask and its static left window (by sequence index) hide, and takes the rest of our mask as
# a [B, 1, T, T] boolean mask (cuDNN reads it as an additive bias). Both cuts are exact
# wherever positions rise by at least one per token inside a document (the index distance
# is then at most the position distance, so every key the index cuts is one the dense mask
# hides too): packed rows, TST bags, concept positions. A row that is one document (padding
# only at its end) with positions equal to indices needs no mask at all, and that branch
# reads no mask from memory. The traced window picks one static window (`windows`), as for
# splash. Anything else (a window not in `windows`, positions that do not rise) takes the
# whole mask without the causal cut: exact, at twice the work.
def one_document(segment_ids):
  """Whether every row is one segment, followed by padding (segment 0) only."""
  seg = segment_ids
  return jnp.all((seg[:, 1:] == seg[:, :-1]) | (seg[:, 1:] == 0))


def cudnn_attention(q, k, v, segment_ids, positions, window, windows, implementation="cudnn"):
  """cuDNN flash attention, exact for any segments and positions (see above).

  implementation="xla" runs the same calls through jax's XLA version of the API (tests, on CPU)."""
  t = q.shape[1]
  pad = t % 2  # cuDNN's backward with a mask wants an even length; a padded key is causally hidden
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  qp, kp, vp, segp, posp = (jnp.pad(x, widths(x)) for x in (q, k, v, segment_ids, positions))
  segp = segp.at[:, t:].set(-1)  # the padded key belongs to no document

  def fused(mask, causal, w=T.NO_WINDOW):
    local = None if w >= T.NO_WINDOW else (w - 1, 0)  # keys (i - w, i]: `window` keys back, itself included
    out = jax.nn.dot_product_attention(qp, kp, vp, mask=mask, is_causal=causal, local_window_size=local,
                                       implementation=implementation)
    return out[:, :t]

  whole_mask = lambda w: T.attention_mask(posp, posp, segp, segp, w)[:, None]
  window = jnp.asarray(window, jnp.int32)
  branches = ([lambda w=w: fused(None, True, w) for w in windows]
              + [lambda w=w: fused(whole_mask(w), True, w) for w in windows]
              + [lambda: fused(whole_mask(window), False)])
  known = jnp.asarray(windows, jnp.int32) == window
  plain = one_document(segment_ids) & index_masks_exact(segment_ids, positions, window)
  rises = index_masks_exact(segment_ids, positions, T.NO_WINDOW)
  index = jnp.where(jnp.any(known) & rises, jnp.argmax(known) + jnp.where(plain, 0, len(windows)), 2 * len(windows))
  return lax.switch(index, branches)


# ----------------------------------------------------------------------------------- public
# auto's choice beyond one block: on a GPU, by device kind and compute dtype, the fastest
# exact implementation measured there (docs/kernels.md, "On a GPU": at 16 x 1,024 tokens and 12
# heads of 64, cuDNN 0.26x dense's time, jax's Pallas kernel 0.38x, xla_blocked 1.55x); a GPU
# without figures (a Colab T4, say) takes xla_blocked, which compiles everywhere. On TPU,
# jax's splash kernel, except on the TPUs before v4 that Pallas does not target.
AUTO_GPU = {("NVIDIA H200", "bfloat16"): "cudnn", ("NVIDIA H200", "float32"): "pallas_gpu"}
OLD_TPUS = ("TPU v2", "TPU v3")


def resolve(impl, seq_len, dtype=jnp.float32, backend=None, device_kind=None):
  """The implementation `impl` names; "auto": dense up to BLOCK tokens, then by backend (AUTO_GPU)."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  if seq_len <= BLOCK:
    return "dense"
  backend = backend or kernel_backend()
  kind = kernel_device_kind() if device_kind is None else device_kind
  if backend == "tpu":
    return "xla_blocked" if kind.startswith(OLD_TPUS) else "pallas_tpu"
  if backend == "gpu":
    return next((v for (k, dt), v in AUTO_GPU.items() if kind.startswith(k) and jnp.dtype(dtype) == dt), "xla_blocked")
  return "xla_blocked"


def attention(q, k, v, segment_ids, positions, window, impl="auto", block=None, windows=(T.NO_WINDOW,)):
  """Causal, windowed, document-masked GQA: q [B,T,H,D], k/v [B,T,K,D] -> [B,T,H,D].

  `block`: xla_blocked's block (block_size(T) if None); `windows` (pallas_tpu only): the static
  sizes the traced `window` can take.
  """
  if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: q must be [B,T,H,D] and k, v [B,T,K,D] with K dividing H, "
                     f"got q {q.shape}, k {k.shape}, v {v.shape}")
  impl = resolve(impl, q.shape[1], q.dtype)
  block = block or block_size(q.shape[1])
  if impl == "dense":
    return dense_attention(q, k, v, segment_ids, positions, window)
  # The kernels run on each device's own rows and heads: a Mosaic or Triton call is not partitioned
  # by XLA. Compiled on their backend; interpreting is the only way they run elsewhere.
  if impl == "pallas_tpu":
    kernel = lambda rows, w: tpu_attention(*rows, w, windows, block, kernel_backend() != "tpu")
  elif impl == "pallas_gpu":
    kernel = lambda rows, w: gpu_attention(*rows, w, block, kernel_backend() != "gpu")
  elif impl == "cudnn":
    kernel = lambda rows, w: cudnn_attention(*rows, w, windows)
  else:
    return blocked_attention(q, k, v, segment_ids, positions, window, block)
  return per_head_shard(kernel, (q, k, v, segment_ids, positions), (2, 2, 2, None, None), window)
