"""Pure functions of the OLMo-3-style transformer: norms, rotary positions, masked GQA, SwiGLU.

Shapes: B batch, T query positions, S key positions, H query heads, K key/value groups,
D head dim. Everything here is a function of arrays only; `latent_jax.nn` holds parameters.
"""
import math

import jax
import jax.numpy as jnp

NO_WINDOW = 2**30  # window size that never masks anything


def rms_norm(x, scale, eps):
  """RMSNorm: x / sqrt(mean(x^2) + eps) * scale, computed in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(d, base):
  """RoPE's rotation frequencies theta_i = base^(-2i/d) of the d/2 pairs (RoFormer Eq. 15) -> [d/2]."""
  return base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)


def yarn_frequencies(d, base, factor, original_context, beta_fast, beta_slow):
  """YaRN's "NTK-by-parts" frequencies h(theta_i) (Peng et al. 2023, YaRN, Sec. 3.2) -> [d/2].

  Pair i turns r_i = L theta_i / (2 pi) times over the original context L. Pairs with r_i > beta_fast
  keep theta_i, pairs with r_i < beta_slow are interpolated to theta_i / factor, and the ramp
  gamma between them is linear in i; its ends, the i where r_i equals beta_fast and beta_slow,
  are rounded outwards (floor, ceil) as in the paper's code.
  """
  theta = rope_frequencies(d, base)
  pair_at = lambda turns: d * math.log(original_context / (2 * math.pi * turns)) / (2 * math.log(base))  # r_i = turns
  low, high = max(math.floor(pair_at(beta_fast)), 0), min(math.ceil(pair_at(beta_slow)), d - 1)
  interpolated = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / max(high - low, 1e-3), 0, 1)  # 1 - gamma
  return theta * (1 - interpolated) + theta / factor * interpolated


def yarn_attention_factor(factor):
  """YaRN's scale on cos and sin, sqrt(1/t) = 0.1 ln(s) + 1 (YaRN, Sec. 3.4); logits grow by its square."""
  return 0.1 * math.log(factor) + 1.0


def rope(x, positions, frequencies, scale=1.0):
  """Rotary position embedding (rotate-half form) of x [B, T, H, D] at positions [B, T]: pair (x_i,
  x_{i+D/2}) turns by positions * frequencies[i] and is multiplied by `scale` (YaRN's attention factor)."""
  angles = positions.astype(jnp.float32)[..., None] * frequencies       # [B, T, D/2]
  cos = (jnp.cos(angles) * scale)[:, :, None, :]
  sin = (jnp.sin(angles) * scale)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_mask(q_pos, k_pos, q_seg, k_seg, window):
  """Causal, sliding-window, same-document mask [B, T, S].

  A query at position p sees a key at position p' iff p' <= p, p - p' < window and both
  belong to the same segment (document). Positions restart at 0 in each document, so
  comparing positions inside one segment is the same as comparing sequence indices.
  """
  qp, kp = q_pos[:, :, None], k_pos[:, None, :]
  same_doc = q_seg[:, :, None] == k_seg[:, None, :]
  return (kp <= qp) & (qp - kp < window) & same_doc


def attention(q, k, v, mask):
  """Grouped-query attention softmax(q k^T / sqrt(D)) v: q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D]."""
  b, t, h, d = q.shape
  groups = k.shape[2]
  q = q.reshape(b, t, groups, h // groups, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)


def linear(x, w):
  """x [..., d_in] @ w [d_in, d_out], as one 2-D matmul over all leading axes.

  Why: for x [B, T, d_in], XLA:CPU computes the weight gradient (a contraction over B and T)
  by first writing the output gradient transposed, a copy as large as the activation; on the
  flattened [B*T, d_in] it does not (docs/performance.md: 0.83x the CPU time of a step).
  """
  return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def swiglu(x, w_gate, w_up, w_down):
  """SwiGLU MLP: (silu(x W_gate) * x W_up) W_down."""
  return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def window_list(num_layers, window, full_attention_every):
  """Per-layer window sizes (Python ints): every `full_attention_every`-th layer (1-indexed) is full."""
  sizes = []
  for i in range(num_layers):
    full = window <= 0 or full_attention_every <= 1 or (i + 1) % full_attention_every == 0
    sizes.append(NO_WINDOW if full else window)
  return sizes


def layer_windows(num_layers, window, full_attention_every):
  """Per-layer window sizes as an int32 array, scanned over with the layers."""
  return jnp.asarray(window_list(num_layers, window, full_attention_every), dtype=jnp.int32)


def window_sizes(num_layers, window, full_attention_every):
  """The distinct window sizes of the layers, static (one splash kernel each), plus NO_WINDOW."""
  return tuple(sorted(set(window_list(num_layers, window, full_attention_every)) | {NO_WINDOW}))
