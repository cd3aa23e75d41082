"""Training-only heads (docs/aux.md): NITP's projector and one DeepSeek-V3 MTP block; and, in a
drafter run (python -m latent_jax.draft), the block drafter trained on the frozen model.

All are optional submodules of the model, attached by `add_heads` when the whole config
enables them, so one training checkpoint holds them; inference models (built from `cfg.model`
alone) and exports leave them out. The losses live in `latent_jax.ops.auxiliary`.
"""
import jax.numpy as jnp
from flax import nnx

from latent_jax.config import mtp_enabled, nitp_enabled, nitp_layer
from latent_jax.sharding import constrain
from latent_jax.ops import transformer as T
from latent_jax.nn.drafter import BlockDrafter
from latent_jax.nn.layers import TOKENS, Block, RMSNorm, param


class NITPProjector(nnx.Module):
  """NITP's projector P: SwiGLU d -> 4d -> d on the last hidden state h_t."""

  def __init__(self, cfg, rngs):
    d, pd, std = cfg.d_model, jnp.dtype(cfg.param_dtype), cfg.init_std
    self.gate = param(rngs, (d, 4 * d), ("embed", "mlp"), std, pd)
    self.up = param(rngs, (d, 4 * d), ("embed", "mlp"), std, pd)
    self.down = param(rngs, (4 * d, d), ("mlp", "embed"), std, pd)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, h):
    w = lambda p: p[...].astype(self.dtype)
    return T.swiglu(h, w(self.gate), w(self.up), w(self.down))


class MTPBlock(nnx.Module):
  """DeepSeek-V3 MTP, depth 1: RMSNorm(Block(W [RMSNorm(h_t); RMSNorm(Emb(x_{t+1}))])), W: 2d -> d.

  The caller applies the model's shared LM head to predict x_{t+2}. The block attends causally
  over the whole document (no sliding window).
  """

  def __init__(self, cfg, rngs):
    d, pd = cfg.d_model, jnp.dtype(cfg.param_dtype)
    self.h_norm, self.e_norm = RMSNorm(d, cfg.norm_eps, pd), RMSNorm(d, cfg.norm_eps, pd)
    self.proj = param(rngs, (2 * d, d), ("mtp_concat", "embed"), cfg.init_std, pd)
    self.block = Block(cfg, rngs)
    self.norm = RMSNorm(d, cfg.norm_eps, pd)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, h, next_embeddings, positions, segment_ids):
    """h [B, T, d] the main model's last state at t, next_embeddings [B, T, d] Emb(x_{t+1}) -> [B, T, d]."""
    x = T.linear(jnp.concatenate([self.h_norm(h), self.e_norm(next_embeddings)], -1), self.proj[...].astype(self.dtype))
    x = constrain(x, TOKENS)
    x, _ = self.block(x, positions, segment_ids, T.NO_WINDOW)
    return self.norm(x)


def add_heads(model, cfg, rngs):
  """Attach the heads the whole config `cfg` enables. They draw their init after the model's own
  parameters, so turning them on leaves the model's init unchanged."""
  if nitp_enabled(cfg):
    model.nitp_layer = nitp_layer(cfg)  # the model then exposes the state after this layer
    if cfg.nitp.projector:
      model.nitp_projector = NITPProjector(cfg.model, rngs)
  if mtp_enabled(cfg):
    model.mtp = MTPBlock(cfg.model, rngs)
  if "drafter" in cfg:
    model.drafter = BlockDrafter(cfg.model, cfg.drafter, rngs)
  return model
