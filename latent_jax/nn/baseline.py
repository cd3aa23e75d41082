"""The OLMo-3-style decoder-only baseline: embed -> scanned blocks -> final norm -> LM head."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.nn.layers import BlockStack, RMSNorm, embed_lookup, param, pop_moe_stats


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
  hidden: jax.Array                 # [B, T, d] final-norm hidden states (the LM head's input)
  logits: jax.Array | None = None   # [B, T, vocab], when asked for
  # Extra tensors for objectives: "pre_norm" (the state before the final norm), "nitp_target_state"
  # (the state after layer nitp_layer, when set), ConceptLM's concept tensors, and "moe" (model.moe:
  # the sparse layers' routing statistics, nn.layers.SparseMLP).
  aux: dict[str, Any] = dataclasses.field(default_factory=dict)
  cache: Any = None                 # updated KV cache when decoding


def default_positions(tokens):
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


class BaselineLM(nnx.Module):
  def __init__(self, cfg, rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pd)
    self.blocks = BlockStack(cfg, cfg.num_layers, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    self.nitp_layer = 0  # > 0 (set by nn.auxiliary.add_heads): expose the state after this layer

  def head_weight(self):
    """The LM head as a [d, vocab] matrix (the embedding's transpose when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def embed_tokens(self, tokens):
    """tokens [B, T] int32 -> input embeddings [B, T, d] in the compute dtype."""
    return embed_lookup(self.embed[...], tokens, self.dtype)

  def __call__(self, tokens, segment_ids=None, positions=None, *, logits=True, cache=None, cache_index=None,
               embeddings=None):
    """tokens [B, T] int32 -> ModelOutput; segment_ids mask attention across documents.

    `embeddings` [B, T, d], if given, replaces the token lookup (TST's superposed bags);
    `tokens` is then unused and may be None.
    """
    if embeddings is not None:
      tokens = jnp.zeros(embeddings.shape[:2], jnp.int32)
    if segment_ids is None:
      segment_ids = jnp.zeros_like(tokens)
    if positions is None:
      positions = default_positions(tokens) if cache_index is None else cache_index + default_positions(tokens)
    x = self.embed_tokens(tokens) if embeddings is None else embeddings.astype(self.dtype)
    x, cache, shallow = self.blocks(x, positions, segment_ids, cache, cache_index, tap=self.nitp_layer)
    h = self.final_norm(x)
    out_logits = h @ self.head_weight().astype(self.dtype) if logits else None
    aux = {"pre_norm": x} if shallow is None else {"pre_norm": x, "nitp_target_state": shallow}
    moe = pop_moe_stats(self.blocks)
    if moe:  # model.moe: the sparse layers' routing statistics, {name: [sparse layers, ...]}
      aux["moe"] = moe
    return ModelOutput(hidden=h, logits=out_logits, aux=aux, cache=cache)

  def init_cache(self, batch, length, dtype=None):
    return self.blocks.init_cache(self.cfg, batch, length, dtype or self.dtype)
