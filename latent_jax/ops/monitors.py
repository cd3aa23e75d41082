"""Training monitors as pure functions (train.monitors): attention statistics and per-group norms.

The NCP paper's stability analysis (Sec. 4.6, Fig. 5-6) traces loss spikes under Muon to single
heads whose query and key norms and attention logits grow; `qk_stats` measures those per head,
on the q and k that enter q k^T (after QK-norm and RoPE). `monitor_metrics` gives the gradient
and update norms of each parameter group (`param_group`). The probe that runs the model to get
q and k at log steps is `latent_jax.train.monitors`.

Shapes: B batch, T query positions, S key positions, H query heads, K key/value groups, D head dim.
"""
import jax
import jax.numpy as jnp

from latent_jax.ops import transformer as T

MODULES = ("encoder", "concept", "decoder")  # ConceptLM's stacks: their groups and layers carry the module's name
HEADS = ("mtp", "nitp_projector", "drafter")  # training-only heads: one group each
QUERY_BLOCK = 512  # queries per block of scores in qk_stats: [B, H, 512, S] fp32 at a time


def qk_stats(q, k, q_pos, k_pos, q_seg, k_seg, window, block=QUERY_BLOCK):
  """Per-head maxima of softmax(q k^T / sqrt(D))'s inputs: q [B,T,H,D], k [B,S,K,D] -> {"logit_max": [H] (the
  largest scaled logit over the pairs the causal/window/document mask shows), "q_norm_max": [H], "k_norm_max":
  [K] (the largest L2 norm of a head's vector over the tokens)}; scores formed `block` queries at a time."""
  b, t, h, d = q.shape
  groups = k.shape[2]
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)

  def block_max(q_block, pos_block, seg_block):  # [B, c, H, D] -> [K, G]
    scores = jnp.einsum("btkgd,bskd->bkgts", q_block.reshape(b, -1, groups, h // groups, d), k) * d ** -0.5
    mask = T.attention_mask(pos_block, k_pos, seg_block, k_seg, window)
    return jnp.max(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=(0, 3, 4))

  if t <= block:
    logit_max = block_max(q, q_pos, q_seg)
  else:  # pad the queries to whole blocks with positions no key is visible from (segment -1)
    pad = -t % block
    widths = lambda x, v=0: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=v)
    split = lambda x: jnp.moveaxis(x.reshape(b, -1, block, *x.shape[2:]), 1, 0)
    blocks = (split(widths(q)), split(widths(q_pos)), split(widths(q_seg, -1)))
    logit_max = jnp.max(jax.lax.map(lambda a: block_max(*a), blocks), axis=0)
  return {"logit_max": logit_max.reshape(h), "q_norm_max": jnp.max(jnp.linalg.norm(q, axis=-1), axis=(0, 1)),
          "k_norm_max": jnp.max(jnp.linalg.norm(k, axis=-1), axis=(0, 1))}


def layer_metrics(stats, module=""):
  """Metrics of one stack's stacked qk_stats ({name: [L, heads]}): per layer i the largest logit and its head,
  and the largest q and k norms, named attn_logit_max/{module}layer{i}, attn_logit_head/..., q_norm_max/...,
  k_norm_max/... (`module`: "" or ConceptLM's "encoder/", "concept/", "decoder/")."""
  out = {}
  for i in range(stats["logit_max"].shape[0]):
    name = f"{module}layer{i}"
    out[f"attn_logit_max/{name}"] = jnp.max(stats["logit_max"][i])
    out[f"attn_logit_head/{name}"] = jnp.argmax(stats["logit_max"][i])
    out[f"q_norm_max/{name}"] = jnp.max(stats["q_norm_max"][i])
    out[f"k_norm_max/{name}"] = jnp.max(stats["k_norm_max"][i])
  return out


def param_group(path):
  """The group of a parameter path "a/b/c": attn, mlp or norms (every RMSNorm scale, QK-norm's too) of the
  baseline's layers or of a ConceptLM module ("encoder/attn", "concept/residual": its IRC and CRC weights),
  else the top-level name (embed, lm_head, heads, codebook, ...); a training-only head (HEADS) is one group."""
  parts = path.split("/")
  if parts[0] in HEADS:
    return parts[0]
  module = f"{parts[0]}/" if parts[0] in MODULES else ""
  if any(p.endswith("norm") for p in parts):
    return module + "norms"
  for kind in ("attn", "mlp"):
    if kind in parts:
      return module + kind
  return module + "residual" if module else parts[0]


def group_norms(tree, prefix):
  """{f"{prefix}/{group}": L2 norm of the leaves of `tree` (nested dicts of params' shapes) in each param_group}."""
  squares = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    group = param_group(jax.tree_util.keystr(path, simple=True, separator="/"))
    squares[group] = squares.get(group, 0.0) + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return {f"{prefix}/{group}": jnp.sqrt(s) for group, s in sorted(squares.items())}


def monitor_metrics(grads, updates):
  """The step's gradient and optimiser-update norms per parameter group: grad_norm/{group}, update_norm/{group}."""
  return {**group_norms(grads, "grad_norm"), **group_norms(updates, "update_norm")}
