"""ConceptLM (NCP-ArchPreview): token encoder -> concepts -> concept module -> codebook -> token decoder.

    tokens --embed--> encoder (E layers, token rate) --h--> pool (Eq. 2) --c--> [norm] --> concept
    module (C layers, concept rate, causal over concepts) --u--> norm --> S heads of N logits
    --> codebook mixture (Eq. 9-10) --p--> causal injection into h (Eq. 11-12) --> decoder
    (D layers, token rate) --> final norm --> LM head

Every module is a scanned stack of the baseline's Blocks (window pattern, QK-norm) with
intra-module residuals (IRC) and, into the concept module and the decoder, cross-module
residual routes (CRC). The math lives in `latent_jax.ops.concepts`; this file holds parameters.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.nn.baseline import ModelOutput, default_positions
from latent_jax.nn.layers import RMSNorm, param, stacked_blocks
from latent_jax.ops import concepts as C
from latent_jax.ops import transformer as T

CODEBOOK_INIT_STD = 0.02  # released code: codebook [S, N, d/S] ~ N(0, 0.02)
NO_CACHE = ("ConceptLM has no incremental decoding yet (it needs a concept cache, docs/ncp.md); "
            "call it on whole sequences.")


def const(shape, value, axes, dtype):
  return nnx.Param(jnp.full(shape, value, dtype), axes=axes)


class CrossModuleRoute(nnx.Module):
  """CRC parameters of one route (Eq. 19-20) into every layer of a target module: MLP, D, LN."""

  def __init__(self, cfg, num_layers, num_sources, rngs):
    d, h, pd = cfg.d_model, cfg.residual_hidden, jnp.dtype(cfg.param_dtype)
    self.w1 = param(rngs, (num_layers, d, h), ("embed", "residual"), cfg.init_std, pd)
    self.w2 = const((num_layers, h, num_sources), 0.0, ("residual", "depth"), pd)  # uniform alpha at init
    self.scale = const((num_layers, d), cfg.crc_scale_init, ("embed",), pd)        # D, small at init
    self.norm = RMSNorm(d, cfg.norm_eps, pd)


class ResidualStack(nnx.Module):
  """`num_layers` scanned Blocks with optional IRC (Eq. 14-18) and CRC routes (Eq. 19-20).

  Layer l: x += D_l * mix(LN(sources)) for each route; out = Block(x); with IRC the next
  state is the Eq. 17 mixture of the history {input, out_0, ..., out_l}, else out. The
  history is carried through the scan as one stacked array. Returns the final state and the
  stacked block outputs [L, B, T, d] (the depths other modules read through CRC).
  """

  def __init__(self, cfg, num_layers, source_depths, rngs, window_unit=1):
    self.blocks = stacked_blocks(cfg, num_layers, rngs)
    d, h, pd = cfg.d_model, cfg.residual_hidden, jnp.dtype(cfg.param_dtype)
    if cfg.irc:
      self.irc_w1 = param(rngs, (num_layers, d, h), ("embed", "residual"), cfg.init_std, pd)
      self.irc_w2 = const((num_layers, h, num_layers + 1), 0.0, ("residual", "depth"), pd)  # plain residual at init
    self.routes = nnx.List([CrossModuleRoute(cfg, num_layers, k, rngs) for k in source_depths])
    window = cfg.window * window_unit if cfg.window > 0 else 0
    self.windows = (num_layers, window, cfg.full_attention_every)
    self.num_layers, self.irc, self.irc_softmax = num_layers, cfg.irc, cfg.irc_softmax
    self.remat, self.dtype = cfg.remat, jnp.dtype(cfg.dtype)

  def __call__(self, x, positions, segment_ids, sources=()):
    """x [B, T, d]; sources: one [K, B, T, d] array per route, aligned to these positions."""
    graphdef, state = nnx.split(self.blocks)
    w = lambda p: p[...].astype(self.dtype)
    normed = [route.norm(s.astype(self.dtype)) for route, s in zip(self.routes, sources)]  # LN(S_j), once
    layers = {"block": state, "window": T.layer_windows(*self.windows), "l": jnp.arange(self.num_layers),
              "crc": [(w(r.w1), w(r.w2), w(r.scale)) for r in self.routes]}
    if self.irc:
      layers["irc"] = (w(self.irc_w1), w(self.irc_w2))

    def body(carry, layer):
      x, history = carry
      for s, p in zip(normed, layer["crc"]):  # routes apply in turn: encoder, then concept
        x = C.cross_module_residual(x, s, *p)
      out, _ = nnx.merge(graphdef, layer["block"])(x, positions, segment_ids, layer["window"])
      if not self.irc:
        return (out, history), out
      latest = layer["l"] + 1
      history = jax.lax.dynamic_update_index_in_dim(history, out, latest, 0)
      x = C.intra_module_residual(history, out - x, *layer["irc"], latest, self.irc_softmax)
      return (x, history), out

    if self.remat:
      body = jax.checkpoint(body, prevent_cse=False)
    history = None
    if self.irc:  # slot 0 is the module input H_1, slot l+1 the output of layer l
      history = jnp.zeros((self.num_layers + 1, *x.shape), x.dtype).at[0].set(x)
    (x, _), outs = jax.lax.scan(body, (x, history), layers)
    return x, outs


class ConceptLM(nnx.Module):
  """NCP-ArchPreview. Same interface as BaselineLM; `.aux` holds what the NCP and VQ losses need."""

  def __init__(self, cfg, rngs):
    d, pd = cfg.d_model, jnp.dtype(cfg.param_dtype)
    s, n = cfg.num_segments, cfg.codebook_size
    e_layers, c_layers, d_layers = cfg.encoder_layers, cfg.concept_layers, cfg.decoder_layers
    self.embed = param(rngs, (cfg.vocab_size, d), ("vocab", "embed"), cfg.init_std, pd)
    self.encoder = ResidualStack(cfg, e_layers, (), rngs)
    if cfg.concept_norm:  # released code: the pooled concept is normalised before every use
      self.concept_norm = RMSNorm(d, cfg.norm_eps, pd)
    # In 'token' mode concept positions are m*k, so the window (counted in concepts) scales by k.
    unit = cfg.chunk_size if cfg.concept_positions == "token" else 1
    self.concept = ResidualStack(cfg, c_layers, (e_layers,) if cfg.crc_encoder_concept else (), rngs, unit)
    self.head_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.heads = param(rngs, (d, s * n), ("embed", "codes"), cfg.init_std, pd)  # S heads of N logits
    self.codebook = param(rngs, (s, n, d // s), ("segments", "codes", "segment_dim"), CODEBOOK_INIT_STD, pd)
    if cfg.fusion == "norm_add":
      self.fuse_h_norm, self.fuse_c_norm = RMSNorm(d, cfg.norm_eps, pd), RMSNorm(d, cfg.norm_eps, pd)
      self.fuse_scale = const((), cfg.fusion_scale_init, (), pd)
    self.decoder_routes = tuple(name for name, on in [("encoder", cfg.crc_encoder_decoder),
                                                      ("concept", cfg.crc_concept_decoder)] if on)
    depths = {"encoder": e_layers, "concept": c_layers}
    self.decoder = ResidualStack(cfg, d_layers, tuple(depths[r] for r in self.decoder_routes), rngs)
    self.final_norm = RMSNorm(d, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (d, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    self.nitp_layer = 0  # > 0 (set by nn.auxiliary.add_heads): expose encoder layer k's output

  def head_weight(self):
    """The LM head as a [d, vocab] matrix (the embedding's transpose when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def embed_tokens(self, tokens):
    """tokens [B, T] int32 -> input embeddings [B, T, d] in the compute dtype."""
    return self.embed[...].astype(self.dtype)[tokens]

  def init_cache(self, *args, **kwargs):
    raise NotImplementedError(NO_CACHE)

  def __call__(self, tokens, segment_ids=None, positions=None, *, logits=True, impl="auto", cache=None,
               cache_index=None):
    """tokens [B, T] int32 -> ModelOutput; `impl` picks the codebook-mixing kernel."""
    if cache is not None or cache_index is not None:
      raise NotImplementedError(NO_CACHE)
    cfg, k = self.cfg, self.cfg.chunk_size
    b, t = tokens.shape
    if segment_ids is None:
      segment_ids = jnp.zeros_like(tokens)
    if positions is None:
      positions = default_positions(tokens)
    # Document masking of the concept path: off means one document per row, concept positions
    # from the row index (positions that restart per document would break causality unmasked).
    docs = segment_ids if cfg.document_mask else None
    concept_seg = C.chunk_segments(segment_ids, k) if cfg.document_mask else jnp.zeros((b, t // k), jnp.int32)
    token_pos = positions if cfg.document_mask else default_positions(tokens)

    h, enc_states = self.encoder(self.embed_tokens(tokens), positions, segment_ids)
    c = C.pool_concepts(h, k, docs)                                        # [B, M, d]
    if cfg.concept_norm:
      c = self.concept_norm(c)
    u, con_states = self.concept(c, C.concept_positions(token_pos, k, cfg.concept_positions), concept_seg,
                                 [C.pool_concepts(enc_states, k, docs)] if cfg.crc_encoder_concept else [])
    code_logits = self.head_norm(u) @ self.heads[...].astype(self.dtype)
    code_logits = code_logits.reshape(*u.shape[:2], cfg.num_segments, cfg.codebook_size)
    predicted = C.mix_codebook(code_logits, self.codebook[...], cfg.mixing, impl).astype(self.dtype)
    codes, quantized = C.pq_assign(c, self.codebook[...])

    valid = C.same_document(segment_ids, k) if cfg.document_mask else None
    fuse = {}
    if cfg.fusion == "norm_add":
      fuse = dict(h_scale=self.fuse_h_norm.scale[...], c_scale=self.fuse_c_norm.scale[...],
                  a=self.fuse_scale[...], eps=cfg.norm_eps)
    x = C.inject_concepts(h, predicted, k, fusion=cfg.fusion, valid=valid, **fuse)
    sources = {"encoder": enc_states, "concept": C.align_to_tokens(con_states, t, k, valid)}
    x, _ = self.decoder(x, positions, segment_ids, [sources[r] for r in self.decoder_routes])

    hidden = self.final_norm(x)
    out_logits = hidden @ self.head_weight().astype(self.dtype) if logits else None
    aux = {"concepts": c, "predicted": predicted, "quantized": quantized, "codes": codes,
           "code_logits": code_logits, "ncp_mask": concept_seg[:, :-1] == concept_seg[:, 1:], "pre_norm": x}
    if self.nitp_layer:  # NITP's target: a shallow encoder state; its prediction reads the decoder (docs/aux.md)
      aux["nitp_target_state"] = enc_states[self.nitp_layer - 1]
    return ModelOutput(hidden=hidden, logits=out_logits, aux=aux)
