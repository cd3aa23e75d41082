"""Pure functions of the OLMo-3-style transformer: norms, rotary positions, masked GQA, SwiGLU.

Shapes: B batch, T query positions, S key positions, H query heads, K key/value groups,
D head dim. Everything here is a function of arrays only; `latent_jax.nn` holds parameters.
"""
import jax
import jax.numpy as jnp

NO_WINDOW = 2**30  # window size that never masks anything


def rms_norm(x, scale, eps):
  """RMSNorm: x / sqrt(mean(x^2) + eps) * scale, computed in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, base):
  """Rotary position embedding (rotate-half form) of x [B, T, H, D] at positions [B, T]."""
  d = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)      # [D/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq           # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
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
