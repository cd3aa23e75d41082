"""NumPy re-derivations of NCP-ArchPreview, written from the paper's equations (1-indexed where
the paper is), independently of latent_jax.ops.concepts. float64 loops; small sizes only."""
import math

import numpy as np

import numpy_ref as ref

erf = np.vectorize(math.erf)


def gelu(x):
  return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def softmax(z, axis=-1):
  z = z - z.max(axis, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis, keepdims=True)


def pool(h, k, seg=None):
  """Eq. 2 for m = 1..floor(T/k); with seg, only the chunk's tokens in its last token's document."""
  *lead, t, d = h.shape
  out = np.zeros((*lead, t // k, d))
  for m in range(1, t // k + 1):
    idx = list(range((m - 1) * k, m * k))
    if seg is None:
      out[..., m - 1, :] = h[..., idx, :].mean(-2)
    else:
      for b in range(seg.shape[0]):
        mine = [i for i in idx if seg[b, i] == seg[b, idx[-1]]]
        out[..., b, m - 1, :] = h[..., b, mine, :].mean(-2)
  return out


def pq(c, codebook):
  """Eq. 3-6: loop over segments and codewords."""
  s, n, w = codebook.shape
  flat = c.reshape(-1, s * w)
  codes = np.zeros((len(flat), s), int)
  quant = np.zeros_like(flat)
  for r, vec in enumerate(flat):
    for j in range(s):
      seg = vec[j * w:(j + 1) * w]
      dist = [np.sum((seg - codebook[j, i]) ** 2) for i in range(n)]
      codes[r, j] = int(np.argmin(dist))
      quant[r, j * w:(j + 1) * w] = codebook[j, codes[r, j]]
  return codes.reshape(*c.shape[:-1], s), quant.reshape(c.shape)


def mix(logits, codebook, mode):
  """Eq. 8-10: per segment pi = softmax(logits) (or the raw logits), chat^s = sum_n pi_n e^s_n."""
  s, n, w = codebook.shape
  flat = logits.reshape(-1, s, n)
  out = np.zeros((len(flat), s * w))
  for r in range(len(flat)):
    for j in range(s):
      pi = softmax(flat[r, j]) if mode == "softmax" else flat[r, j]
      out[r, j * w:(j + 1) * w] = sum(pi[i] * codebook[j, i] for i in range(n))
  return out.reshape(*logits.shape[:-2], s * w)


def injected(pred, t_len, k):
  """Eq. 11 as printed, 1-indexed: b_t = 0 for t < k, else chat_{floor((t-k)/k)+2}.

  pred[..., i, :] (0-indexed row i) is the prediction made after chunk i+1, i.e. chat_{i+2}.
  """
  out = np.zeros((*pred.shape[:-2], t_len, pred.shape[-1]))
  for t in range(1, t_len + 1):
    if t >= k:
      m = (t - k) // k + 2
      out[..., t - 1, :] = pred[..., m - 2, :]
  return out


def vq(c, q, s, reduction):
  """Eq. 21 per sequence, averaged over the batch ('released': elementwise mean)."""
  b, m, d = c.shape
  if reduction == "released":
    return np.mean((c - q) ** 2)
  return np.mean([sum(np.sum((c[i, j] - q[i, j]) ** 2) for j in range(m)) / (m * s) for i in range(b)])


def ncp(pred, c, s, reduction):
  """Eq. 22: 1/(M-1) sum_{m=2}^{M} ||chat_m - c_m||^2, chat_m = pred[m-2]; Algorithm 1 adds 1/S."""
  b, m, d = c.shape
  per_seq = [sum(np.sum((pred[i, mm - 2] - c[i, mm - 1]) ** 2) for mm in range(2, m + 1)) / (m - 1)
             for i in range(b)]
  if reduction == "released":
    return np.mean(per_seq) / d
  return np.mean(per_seq) / (s if reduction == "algorithm1" else 1)


def irc(history, update, w1, w2, l, softmax_weights=False):
  """Eq. 14-18 for layer l (1-indexed): X = {H_1, H_1+R_1, .., H_l+R_l} = history[:l+1].

  w = MLP(R_l) + one-hot on the newest state X_{l+1}; slots beyond it do not exist.
  """
  w = gelu(update @ w1) @ w2
  w = w[..., :l + 1].copy()
  w[..., l] += 1.0
  if softmax_weights:
    w = softmax(w)
  return sum(w[..., j, None] * history[j] for j in range(l + 1))


def crc(target, sources, w1, w2, scale, norm_scale, eps):
  """Eq. 19-20: T + D * sum_j softmax(MLP(T))_j LN(S_j) (LN = RMSNorm with a learned scale)."""
  alpha = softmax(gelu(target @ w1) @ w2)
  mixed = sum(alpha[..., j, None] * ref.rms_norm(sources[j], norm_scale, eps) for j in range(len(sources)))
  return target + scale * mixed


# ------------------------------------------------------------------ the whole ConceptLM
def windows(n, window, every):
  return [2**30 if window <= 0 or every <= 1 or (i + 1) % every == 0 else window for i in range(n)]


def block(p, cfg, x, pos, seg, window):
  """Post-norm (OLMo-3) block with layer-wise QK-norm."""
  h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  b, t, _ = x.shape
  a = p["attn"]
  q, key, val = x @ a["q"], x @ a["k"], x @ a["v"]
  q, key = ref.rms_norm(q, a["q_norm"]["scale"], cfg.norm_eps), ref.rms_norm(key, a["k_norm"]["scale"], cfg.norm_eps)
  q, key, val = q.reshape(b, t, h, hd), key.reshape(b, t, kv, hd), val.reshape(b, t, kv, hd)
  q, key = ref.rope(q, pos, cfg.rope_base), ref.rope(key, pos, cfg.rope_base)
  att = ref.attention(q, key, val, pos, seg, window).reshape(b, t, h * hd) @ a["o"]
  x = x + ref.rms_norm(att, p["attn_norm"]["scale"], cfg.norm_eps)
  m = p["mlp"]
  return x + ref.rms_norm(ref.swiglu(x, m["gate"], m["up"], m["down"]), p["mlp_norm"]["scale"], cfg.norm_eps)


def stack(p, cfg, x, pos, seg, wins, sources, irc_on):
  """A module: per layer, CRC routes in turn, the block, then the IRC mixture of the history."""
  history, outs = [x], []
  for l in range(len(wins)):
    for r, src in enumerate(sources):
      rp = p["routes"][r]
      x = crc(x, src, rp["w1"][l], rp["w2"][l], rp["scale"][l], rp["norm"]["scale"], cfg.norm_eps)
    layer = {name: _index(v, l) for name, v in p["blocks"].items()}
    out = block(layer, cfg, x, pos, seg, wins[l])
    history.append(out)
    outs.append(out)
    x = irc(history, out - x, p["irc_w1"][l], p["irc_w2"][l], l + 1, cfg.irc_softmax) if irc_on else out
  return x, outs


def _index(tree, l):
  return {k: _index(v, l) for k, v in tree.items()} if isinstance(tree, dict) else tree[l]


def concept_lm(p, cfg, tokens, plain=False):
  """ConceptLM logits for one document per row (positions 0..T-1), every CRC route on.

  plain=True: the standard residual hierarchy (no IRC, no CRC), whatever p holds for them.
  """
  on = lambda sources: [] if plain else sources
  b, t = tokens.shape
  k, s, n = cfg.chunk_size, cfg.num_segments, cfg.codebook_size
  m = t // k
  pos, seg = np.tile(np.arange(t), (b, 1)), np.zeros((b, t), int)
  cpos = np.tile(np.arange(m) * (k if cfg.concept_positions == "token" else 1), (b, 1))
  unit = k if cfg.concept_positions == "token" else 1
  h, enc = stack(p["encoder"], cfg, p["embed"][tokens], pos, seg,
                 windows(cfg.encoder_layers, cfg.window, cfg.full_attention_every), [], not plain)
  c = pool(h, k)
  if cfg.concept_norm:
    c = ref.rms_norm(c, p["concept_norm"]["scale"], cfg.norm_eps)
  u, con = stack(p["concept"], cfg, c, cpos, np.zeros((b, m), int),
                 windows(cfg.concept_layers, cfg.window * unit, cfg.full_attention_every),
                 on([[pool(e, k) for e in enc]]), not plain)
  logits = (ref.rms_norm(u, p["head_norm"]["scale"], cfg.norm_eps) @ p["heads"]).reshape(b, m, s, n)
  pred = mix(logits, p["codebook"], "softmax" if cfg.mixing == "softmax" else "raw")
  bt = injected(pred, t, k)
  if cfg.fusion == "add":
    x = h + bt
  else:
    x = (ref.rms_norm(h, p["fuse_h_norm"]["scale"], cfg.norm_eps)
         + p["fuse_scale"] * ref.rms_norm(bt, p["fuse_c_norm"]["scale"], cfg.norm_eps))
  x, _ = stack(p["decoder"], cfg, x, pos, seg, windows(cfg.decoder_layers, cfg.window, cfg.full_attention_every),
               on([enc, [injected(o, t, k) for o in con]]), not plain)
  return ref.rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps) @ p["lm_head"], c, pred
