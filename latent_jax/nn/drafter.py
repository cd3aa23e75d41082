"""A block drafter for speculative decoding, with optional concept injection (NCP Sec. 5.3, Eq. 26).

The drafter is a small stack of the baseline's Blocks over one short sequence per anchor a:

    [ W target states h_{a-W..a-1}, projected | Emb(x_a), mask, ..., mask ]  (W + K positions)

causal, at the target's width. Its outputs at the K block positions go through its final norm
and the target's LM head to propose x_{a+1..a+K}. The token embedding and LM head are the
target's (frozen); the drafter owns the rest. With a concept signal, before every layer the
block positions get Eq. 26's tanh(g) * RMSNorm(c), g zero at init, so that a fresh
concept-injected drafter computes exactly what the baseline drafter computes.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.ops import concepts as C
from latent_jax.ops import drafting as D
from latent_jax.ops import transformer as T
from latent_jax.nn.layers import RMSNorm, param, stacked_blocks

CONCEPT_SIGNALS = ("none", "predicted", "pooled")


def drafter_model_config(target_cfg, num_layers):
  """The drafter's block config: the target's blocks (width, heads, norms) at another depth, full attention."""
  cfg = target_cfg.copy_and_resolve_references()
  cfg.num_layers, cfg.window, cfg.remat = num_layers, 0, "none"
  return cfg


class BlockDrafter(nnx.Module):
  def __init__(self, target_cfg, dcfg, rngs):
    """target_cfg: the target's `model` section; dcfg: the `drafter` section (configs/tiny_drafter.py)."""
    cfg = drafter_model_config(target_cfg, dcfg.num_layers)
    d, pd, std = cfg.d_model, jnp.dtype(cfg.param_dtype), cfg.init_std
    self.context_proj = param(rngs, (d, d), ("embed", "mlp"), std, pd)
    self.mask = param(rngs, (d,), ("embed",), std, pd)
    self.blocks = stacked_blocks(cfg, dcfg.num_layers, rngs)
    if dcfg.concept != "none":  # Eq. 26's per-layer gate g (zero) and RMSNorm scale: 2d per layer
      self.gate = nnx.Param(jnp.zeros((dcfg.num_layers, d), pd), axes=("embed",))  # stacked: layer axis unnamed
      self.concept_scale = nnx.Param(jnp.ones((dcfg.num_layers, d), pd), axes=("norm",))
    self.final_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.block_size, self.window, self.concept, self.eps = dcfg.block_size, dcfg.context, dcfg.concept, cfg.norm_eps
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, context, valid, anchor_embedding, concept, head):
    """context [N, W, d] target states before the anchor, valid [N, W], anchor_embedding [N, d] = Emb(x_a),
    concept [N, d] (None without injection), head [d, V] the target's LM head -> logits [N, K, V]."""
    n, w, d = context.shape
    k = self.block_size
    mask = jnp.broadcast_to(self.mask[...].astype(self.dtype), (n, k - 1, d))
    block = jnp.concatenate([anchor_embedding.astype(self.dtype)[:, None], mask], axis=1)
    x = jnp.concatenate([context.astype(self.dtype) @ self.context_proj[...].astype(self.dtype), block], axis=1)
    positions = jnp.broadcast_to(jnp.arange(w + k, dtype=jnp.int32), (n, w + k))  # RoPE only sees offsets
    # Context slots outside the anchor's document get their own segment: the block never sees them.
    segment_ids = jnp.concatenate([jnp.where(valid, 0, 1), jnp.zeros((n, k), jnp.int32)], axis=1)
    graphdef, state = nnx.split(self.blocks)
    layers = {"block": state}
    if concept is not None:
      layers["gate"], layers["scale"] = self.gate[...], self.concept_scale[...]

    def body(x, layer):
      if concept is not None:
        x = x.at[:, w:].set(D.concept_gate(x[:, w:], concept, layer["gate"], layer["scale"], self.eps))
      x, _ = nnx.merge(graphdef, layer["block"])(x, positions, segment_ids, T.NO_WINDOW)
      return x, None

    x, _ = jax.lax.scan(body, x, layers)
    return self.final_norm(x[:, w:]) @ head.astype(self.dtype)


def target_features(target, tokens, segment_ids=None, positions=None, concept="none", logits=True):
  """One target pass -> (logits [B, T, V] (None unless asked), hidden [B, T, d], concept signal per
  token [B, T, d] or None).

  The concept signal at token t is what Eq. 26 reads once t is the last position the target has
  processed: 'predicted', the mixture p_{(t+1)//k - 1} that ConceptLM injects at t (Eq. 11), or
  'pooled', the mean-pooled concept of that same last complete chunk; zero before it completes.
  """
  if concept not in CONCEPT_SIGNALS:
    raise ValueError(f"drafter.concept={concept!r} is not one of {CONCEPT_SIGNALS}.")
  if concept != "none" and target.cfg.name != "concept":
    raise ValueError(f"drafter.concept={concept!r} needs a ConceptLM target (model.name='concept'), "
                     f"not {target.cfg.name!r}; use drafter.concept='none' for this target.")
  out = target(tokens, segment_ids, positions, logits=logits)
  if concept == "none":
    return out.logits, out.hidden, None
  k = target.cfg.chunk_size
  valid = C.same_document(segment_ids, k) if segment_ids is not None and target.cfg.document_mask else None
  source = out.aux["predicted"] if concept == "predicted" else out.aux["concepts"]
  return out.logits, out.hidden, C.align_to_tokens(source, tokens.shape[1], k, valid)


def draft(drafter, target, hidden, concepts, tokens, segment_ids, anchors):
  """The drafter's logits [B, A, K, V] for x_{a+1..a+K} at anchors [B, A], from a target pass
  (`target_features` with `drafter.concept`) over tokens [B, T] whose states are valid before each anchor."""
  if (concepts is None) != (drafter.concept == "none"):
    raise ValueError(f"this drafter was built with drafter.concept={drafter.concept!r} but was given "
                     f"{'no' if concepts is None else 'a'} concept signal; call target_features with "
                     f"concept={drafter.concept!r}.")
  b, a = anchors.shape
  context, valid = D.draft_context(hidden, segment_ids, anchors, drafter.window)
  anchor_tokens, _ = D.gather_offsets(tokens, anchors, jnp.zeros((1,), jnp.int32))
  signal = None
  if concepts is not None:  # the signal at the last processed position a-1, if in the anchor's document
    signal, ok = D.draft_context(concepts, segment_ids, anchors, 1)
    signal = jnp.where(ok[..., None], signal, 0).reshape(b * a, -1)
  flat = lambda x: x.reshape(b * a, *x.shape[2:])
  logits = drafter(flat(context), flat(valid), target.embed_tokens(anchor_tokens[..., 0]).reshape(b * a, -1),
                   signal, target.head_weight())
  return logits.reshape(b, a, *logits.shape[1:])

