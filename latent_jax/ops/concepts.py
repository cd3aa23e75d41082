"""Pure functions of NCP-ArchPreview (arXiv 2609.10715v1): concepts, product quantisation, codebook
mixing, causal injection, intra-/cross-module residuals, and the NCP and VQ losses.

Shapes: B batch, T tokens, k tokens per chunk, M = floor(T/k) concepts, d width, S segments of
d/S, N codewords per segment, L layers of a module, K source depths of a cross-module route.

Index convention (0-indexed everywhere): chunk j holds tokens jk .. jk+k-1 and pools to c_j.
The concept module reads c_0..c_j and its prediction p_j is the paper's chat_{j+2} (1-indexed):
the prediction of chunk j+1. So the NCP loss pairs p_j with c_{j+1}, and input token t receives
p_{(t+1)//k - 1}, built only from chunks that end at or before t (Eq. 11).
"""
import jax
import jax.numpy as jnp

import pallas_kernels
from latent_jax.ops import transformer as T

MIXING = {"softmax": "softmax", "raw_logits": "raw"}  # config name -> pallas_kernels.codebook_mix mode
FUSIONS = ("add", "norm_add")
REDUCTIONS = ("paper", "algorithm1", "released")
CONCEPT_POSITIONS = ("index", "token")
HIGHEST = jax.lax.Precision.HIGHEST
sg = jax.lax.stop_gradient


# ---------------------------------------------------------------- concepts (Eq. 1-2)
def choice(value, name, choices):
  """The pure functions below take modes as strings: reject a typo instead of falling through."""
  if value not in choices:
    raise ValueError(f"{name}={value!r}: use one of {list(choices)}.")
  return value


def num_concepts(seq_len, k):
  """M = floor(T / k) complete chunks (Eq. 2); at least one is needed."""
  if seq_len < k:
    raise ValueError(f"a sequence of {seq_len} tokens holds no complete chunk of model.chunk_size={k}; "
                     f"give at least {k} tokens or lower model.chunk_size.")
  return seq_len // k


def pool_concepts(h, k, segment_ids=None):
  """Eq. 1-2: c_m = mean of the k encoder states of chunk m, for m < M = floor(T/k).

  h [..., T, d] -> [..., M, d]; a trailing partial chunk is dropped (floor). With segment_ids
  [B, T] the mean covers only the chunk's tokens in the document of its last token, so a
  concept never mixes two documents (None: the plain mean of Eq. 2).
  """
  m = num_concepts(h.shape[-2], k)
  x = h[..., :m * k, :].astype(jnp.float32).reshape(*h.shape[:-2], m, k, h.shape[-1])
  if segment_ids is None:
    return x.mean(-2).astype(h.dtype)
  seg = segment_ids[..., :m * k].reshape(*segment_ids.shape[:-1], m, k)
  w = (seg == seg[..., -1:]).astype(jnp.float32)  # a suffix of the chunk, never empty
  return ((x * w[..., None]).sum(-2) / w.sum(-1)[..., None]).astype(h.dtype)


def chunk_segments(segment_ids, k):
  """The document of each chunk, that of its last token: [B, T] -> [B, M]."""
  m = num_concepts(segment_ids.shape[-1], k)
  return segment_ids[..., k - 1:m * k:k]


def concept_positions(positions, k, mode):
  """RoPE positions of the concepts (not settled by the paper): 'index' m, or 'token' m*k.

  Taken from the token position of each chunk's last token, so they restart with documents
  exactly as token positions do: [B, T] -> [B, M].
  """
  index = chunk_segments(positions, k) // k
  return index if choice(mode, "concept_positions", CONCEPT_POSITIONS) == "index" else index * k


# ---------------------------------------------------------------- product quantisation (Eq. 3-10)
def split_segments(x, num_segments):
  if x.shape[-1] % num_segments:
    raise ValueError(f"model.num_segments={num_segments} does not divide the concept width {x.shape[-1]} "
                     "(model.d_model); pick a divisor of it.")
  return x.reshape(*x.shape[:-1], num_segments, x.shape[-1] // num_segments)


def pq_assign(concepts, codebook):
  """Eq. 3-6: per segment s, n^s = argmin_n ||c^s - e^s_n||^2 and d^s = e^s_{n^s}.

  concepts [..., d], codebook [S, N, d/S] -> (codes [..., S] int32, quantized [..., d]).
  The codes carry no gradient; `quantized` is a gather of the codebook, so it does.
  """
  s = codebook.shape[0]
  c = split_segments(sg(concepts).astype(jnp.float32), s)           # [..., S, d/S]
  e = sg(codebook).astype(jnp.float32)
  dist = ((c * c).sum(-1)[..., None] - 2 * jnp.einsum("...sk,snk->...sn", c, e, precision=HIGHEST)
          + (e * e).sum(-1))                                          # [..., S, N]
  codes = jnp.argmin(dist, axis=-1).astype(jnp.int32)
  quantized = codebook[jnp.arange(s), codes]                        # [..., S, d/S]
  return codes, quantized.reshape(concepts.shape).astype(concepts.dtype)


def mix_codebook(logits, codebook, mode="softmax", impl="auto"):
  """Eq. 7-10: chat^s = sum_n pi^s_n e^s_n, pi = softmax(logits) ('softmax', paper) or the raw logits ('raw_logits', released code).

  logits [..., S, N], codebook [S, N, d/S] -> [..., d] (segments concatenated, Eq. 10).
  """
  out = pallas_kernels.codebook_mix(logits, codebook, mode=MIXING[choice(mode, "mixing", MIXING)], impl=impl)
  return out.reshape(*out.shape[:-2], -1)


# ---------------------------------------------------------------- causal injection (Eq. 11-12)
def injection_index(seq_len, k):
  """Eq. 11: input token t (0-indexed) reads p_{(t+1)//k - 1}; -1 means no complete chunk yet."""
  return (jnp.arange(seq_len) + 1) // k - 1


def same_document(segment_ids, k):
  """[B, T] True where token t and the chunk it reads under Eq. 11 belong to one document."""
  idx = jnp.maximum(injection_index(segment_ids.shape[-1], k), 0)
  return jnp.take(chunk_segments(segment_ids, k), idx, axis=-1) == segment_ids


def align_to_tokens(x, seq_len, k, valid=None):
  """Concept-rate states x [..., M, d] to token rate [..., T, d] by the Eq. 11 index map.

  Zero before the first complete chunk and where `valid` [B, T] is False (another document).
  Used for the injected concepts and, identically, for the Concept->Decoder residual route.
  """
  idx = injection_index(seq_len, k)
  out = jnp.take(x, jnp.maximum(idx, 0), axis=-2)
  keep = idx >= 0 if valid is None else (idx >= 0) & valid
  return jnp.where(keep[..., None], out, jnp.zeros((), x.dtype))


def inject_concepts(h, predicted, k, *, fusion="add", valid=None, h_scale=None, c_scale=None, a=None,
                    eps=1e-6):
  """Eq. 11-12: htilde_t = h_t + b_t ('add', paper) or LN(h_t) + a LN(b_t) ('norm_add', released code).

  h [B, T, d], predicted [B, M, d]; b_t is `align_to_tokens(predicted)`. LN is RMSNorm with
  scales h_scale, c_scale (the backbone's norm); a is the released code's scalar gate.
  """
  b = align_to_tokens(predicted.astype(h.dtype), h.shape[-2], k, valid)
  return fuse_concepts(h, b, fusion=fusion, h_scale=h_scale, c_scale=c_scale, a=a, eps=eps)


def fuse_concepts(h, b, *, fusion="add", h_scale=None, c_scale=None, a=None, eps=1e-6):
  """Eq. 12 on concepts already aligned to the tokens: h, b [B, T, d]. A zero b (no concept yet)
  leaves h under 'add' and gives LN(h) under 'norm_add', as RMSNorm maps zero to zero."""
  if choice(fusion, "fusion", FUSIONS) == "add":
    return h + b
  return T.rms_norm(h, h_scale, eps) + a.astype(h.dtype) * T.rms_norm(b, c_scale, eps)


# ---------------------------------------------------------------- residual connections (Eq. 14-20)
def irc_weights(update, w1, w2, latest, softmax=False):
  """Eq. 17: w_l = MLP_l(R_l) over the history slots, plus one-hot(latest) so that a zero w2 is the plain residual.

  update R_l [B, T, d], w1 [d, h], w2 [h, L+1] -> [B, T, L+1]; slots after `latest` weigh 0.
  No softmax by default (the paper: weights may be negative); softmax=True normalises over the
  slots up to `latest` (the released decoder's option, which is not an exact residual at init).
  """
  logits = T.linear(jax.nn.gelu(T.linear(update, w1), approximate=False), w2)
  slots = jnp.arange(w2.shape[-1])
  logits = logits + (slots == latest).astype(logits.dtype)
  if softmax:
    return jax.nn.softmax(jnp.where(slots <= latest, logits, -jnp.inf), axis=-1)
  return jnp.where(slots <= latest, logits, 0)


def intra_module_residual(history, update, w1, w2, latest, softmax=False):
  """Eq. 14-18: H_{l+1} = sum_j w_{l,j} X_{l,j}, X_l = {H_1, H_1+R_1, ..., H_l+R_l} in history [L+1, B, T, d]."""
  w = irc_weights(update, w1, w2, latest, softmax).astype(history.dtype)
  return jnp.einsum("btj,jbtd->btd", w, history)


def cross_module_residual(target, sources, w1, w2, scale):
  """Eq. 19-20: T + D * sum_j alpha_j LN(S_j), alpha = softmax(MLP(T)) over the K source depths.

  target [B, T, d]; sources [K, B, T, d] already normalised (LN(S_j)) and aligned to the
  target's positions; w1 [d, h], w2 [h, K], scale D [d].
  """
  alpha = jax.nn.softmax(T.linear(jax.nn.gelu(T.linear(target, w1), approximate=False), w2), axis=-1)  # [B, T, K]
  return target + scale * jnp.einsum("btk,kbtd->btd", alpha.astype(sources.dtype), sources)


# ---------------------------------------------------------------- losses (Eq. 21-22)
def _per_concept(sq_norms, num_segments, width, reduction, per_segment):
  """Per-concept squared norms divided by S or d as the reduction asks: the losses are their mean."""
  choice(reduction, "reduction", REDUCTIONS)
  if reduction == "released":
    return sq_norms / width             # elementwise mean squared error
  return sq_norms / num_segments if per_segment else sq_norms


def _mean(x, mask):
  mask = jnp.ones_like(x) if mask is None else mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1)


def vq_errors(concepts, quantized, num_segments, reduction="paper"):
  """Eq. 21 per concept, 1/S sum_s ||sg(c^s_m) - d^s_m||^2: [B, M, d] x2 -> [B, M]; L_VQ is their mean."""
  err = jnp.sum(jnp.square(sg(concepts).astype(jnp.float32) - quantized.astype(jnp.float32)), -1)
  return _per_concept(err, num_segments, concepts.shape[-1], reduction, per_segment=True)


def vq_loss(concepts, quantized, num_segments, reduction="paper", mask=None):
  """Eq. 21: L_VQ = 1/(MS) sum_m sum_s ||sg(c^s_m) - d^s_m||^2; reaches the codebook only.

  concepts, quantized [B, M, d]; 'released' is the elementwise mean mse(q, sg(c)); 'algorithm1'
  equals 'paper' here (Algorithm 1 differs from the paper only in the NCP term).
  """
  return _mean(vq_errors(concepts, quantized, num_segments, reduction), mask)


def ncp_errors(predicted, concepts, num_segments, reduction="paper"):
  """Eq. 22 per pair, ||chat_{j+1} - sg(c_{j+1})||^2 (/S 'algorithm1', /d 'released'): [B, M, d] x2 -> [B, M-1]."""
  err = jnp.sum(jnp.square(predicted[:, :-1].astype(jnp.float32) - sg(concepts[:, 1:]).astype(jnp.float32)), -1)
  return _per_concept(err, num_segments, concepts.shape[-1], reduction, per_segment=reduction == "algorithm1")


def ncp_loss(predicted, concepts, num_segments, reduction="paper", mask=None):
  """Eq. 22: L_NCP = 1/(M-1) sum_{m>=2} ||chat_m - sg(c_m)||^2: p_j is scored against c_{j+1}.

  predicted, concepts [B, M, d]; mask [B, M-1] keeps the pairs (j, j+1) to score. 'paper' is
  Eq. 22 as written, 'algorithm1' divides by S again, 'released' is the elementwise mean.
  """
  return _mean(ncp_errors(predicted, concepts, num_segments, reduction), mask)


def code_histogram(codes, codebook_size):
  """How often each code is chosen, per segment: codes [..., S] -> counts [S, N] (adds up over batches)."""
  return jax.nn.one_hot(codes.reshape(-1, codes.shape[-1]), codebook_size, dtype=jnp.float32).sum(0)


def codebook_usage(counts):
  """Codebook health from a code histogram [S, N], averaged over segments: fraction of codes used,
  perplexity exp(H) of the histogram, unused (dead) codes; and the least-used segment's fraction
  (one segment can collapse while the mean looks healthy)."""
  p = counts / jnp.maximum(counts.sum(-1, keepdims=True), 1)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1)), 0), -1)
  used = jnp.mean(counts > 0, -1)  # [S]
  return {"code_usage": jnp.mean(used), "code_usage_min": jnp.min(used), "code_perplexity": jnp.mean(jnp.exp(entropy)),
          "dead_codes": jnp.mean(jnp.sum(counts == 0, -1).astype(jnp.float32))}
