"""NumPy re-derivations of the paper-level equations, written independently of latent_jax.ops."""
import numpy as np


def rms_norm(x, scale, eps):
  x = x.astype(np.float64)
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def rope(x, positions, base):
  """Rotate each pair (x_i, x_{i+D/2}) by angle pos * base^(-2i/D)."""
  d = x.shape[-1]
  out = np.empty_like(x, dtype=np.float64)
  for i in range(d // 2):
    theta = positions[..., None] * base ** (-2.0 * i / d)  # [B, T, 1]
    a, b = x[..., i], x[..., i + d // 2]
    out[..., i] = a * np.cos(theta) - b * np.sin(theta)
    out[..., i + d // 2] = b * np.cos(theta) + a * np.sin(theta)
  return out


def attention(q, k, v, positions, segments, window):
  """Loop over (batch, head, query): softmax over the keys the query may see."""
  b, t, h, d = q.shape
  groups = k.shape[2]
  out = np.zeros((b, t, h, d))
  for bi in range(b):
    for hi in range(h):
      g = hi // (h // groups)
      for i in range(t):
        keys = [j for j in range(t) if segments[bi, j] == segments[bi, i]
                and positions[bi, j] <= positions[bi, i] and positions[bi, i] - positions[bi, j] < window]
        s = np.array([q[bi, i, hi] @ k[bi, j, g] for j in keys]) / np.sqrt(d)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[bi, i, hi] = sum(pj * v[bi, j, g] for pj, j in zip(p, keys))
  return out


def silu(x):
  return x / (1 + np.exp(-x))


def swiglu(x, w_gate, w_up, w_down):
  return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def logsumexp(z):
  m = z.max(-1, keepdims=True)
  return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
