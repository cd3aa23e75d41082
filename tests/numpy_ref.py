"""NumPy re-derivations of the paper-level equations, written independently of latent_jax.ops."""
import numpy as np


def rms_norm(x, scale, eps):
  x = x.astype(np.float64)
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def rope(x, positions, base, frequencies=None, scale=1.0):
  """Rotate each pair (x_i, x_{i+D/2}) by angle pos * theta_i, theta_i = base^(-2i/D) unless given,
  and multiply by `scale`."""
  d = x.shape[-1]
  out = np.empty_like(x, dtype=np.float64)
  for i in range(d // 2):
    theta = base ** (-2.0 * i / d) if frequencies is None else frequencies[i]
    angle = positions[..., None] * theta  # [B, T, 1]
    a, b = x[..., i], x[..., i + d // 2]
    out[..., i] = scale * (a * np.cos(angle) - b * np.sin(angle))
    out[..., i + d // 2] = scale * (b * np.cos(angle) + a * np.sin(angle))
  return out


def qkv(x, p, cfg, positions, frequencies=None, scale=1.0):
  """q [B,T,H,D], k and v [B,T,K,D] of one attention layer (params p: q, k, v, q_norm, k_norm) on x [B,T,d]:
  QK-norm over the layer's width (cfg.qk_norm "layer") or per head ("head"), then RoPE on q and k."""
  b, t, _ = x.shape
  h, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
  norm = lambda a, name: rms_norm(a, p[name]["scale"], cfg.norm_eps)
  if cfg.qk_norm == "layer":
    q, k = norm(q, "q_norm"), norm(k, "k_norm")
  q, k, v = q.reshape(b, t, h, hd), k.reshape(b, t, kh, hd), v.reshape(b, t, kh, hd)
  if cfg.qk_norm == "head":
    q, k = norm(q, "q_norm"), norm(k, "k_norm")
  return rope(q, positions, cfg.rope_base, frequencies, scale), rope(k, positions, cfg.rope_base, frequencies, scale), v


def yarn_frequencies(d, base, factor, original_context, beta_fast, beta_slow):
  """YaRN (Peng et al. 2023) from its definitions: pair i has wavelength lambda_i = 2 pi / theta_i and
  turns r_i = L / lambda_i times over the original context L; gamma = 0 below alpha = beta_slow turns,
  1 above beta = beta_fast, linear in the pair index between the pairs where r crosses them (the
  paper's code rounds those outwards); h(theta) = (1 - gamma) theta / s + gamma theta."""
  i = np.arange(d // 2)
  theta = base ** (-2.0 * i / d)
  # log r is linear in the pair index: r(x) = L / (2 pi) * base^(-2x/d); solve r(x) = turns for x.
  crossing = lambda turns: np.log(original_context / (2 * np.pi) / turns) / np.log(base) * d / 2
  first, last = max(np.floor(crossing(beta_fast)), 0), min(np.ceil(crossing(beta_slow)), d - 1)
  gamma = 1 - np.clip((i - first) / max(last - first, 1e-3), 0, 1)
  return (1 - gamma) * theta / factor + gamma * theta


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
