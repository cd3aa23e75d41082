"""ConceptLM (NCP-ArchPreview): token encoder -> concepts -> concept module -> codebook -> token decoder.

    tokens --embed--> encoder (E layers, token rate) --h--> pool (Eq. 2) --c--> [norm] --> concept
    module (C layers, concept rate, causal over concepts) --u--> norm --> S heads of N logits
    --> codebook mixture (Eq. 9-10) --p--> causal injection into h (Eq. 11-12) --> decoder
    (D layers, token rate) --> final norm --> LM head

Every module is a scanned stack of the baseline's Blocks (window pattern, QK-norm) with
intra-module residuals (IRC) and, into the concept module and the decoder, cross-module
residual routes (CRC). The math lives in `latent_jax.ops.concepts`; this file holds parameters.

Decoding (`init_cache`, then calls with `cache`) runs a token at a time with a KV cache per
module; the concept module advances only when a chunk of k tokens completes.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.sharding import constrain, per_batch_shard
from latent_jax.ops import concepts as C
from latent_jax.ops import transformer as T
from latent_jax.nn.baseline import ModelOutput, default_positions
from latent_jax.config import moe_enabled
from latent_jax.nn.layers import (TOKENS, RMSNorm, embed_lookup, keep_moe_stats, keep_qk_stats, kv_cache, moe_stats,
                                     param, pop_moe_stats, qk_stats, remat, stacked_blocks)

CODEBOOK_INIT_STD = 0.02  # released code: codebook [S, N, d/S] ~ N(0, 0.02)
# What the NCP paper's VQ adaptation (Sec. 5.1) trains: the codebook and the concept prediction heads
# (with the norm in front of them); optim.trainable="vq" (train/optim.py) and lora.rank="auto" (nn/lora.py).
VQ_PARAMS = r"codebook|heads|head_norm/.*"


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
    self.blocks = stacked_blocks(cfg, num_layers, rngs, sparse=moe_enabled(cfg))  # model.moe: every layer sparse
    d, h, pd = cfg.d_model, cfg.residual_hidden, jnp.dtype(cfg.param_dtype)
    if cfg.irc:
      self.irc_w1 = param(rngs, (num_layers, d, h), ("embed", "residual"), cfg.init_std, pd)
      self.irc_w2 = const((num_layers, h, num_layers + 1), 0.0, ("residual", "depth"), pd)  # plain residual at init
    self.routes = nnx.List([CrossModuleRoute(cfg, num_layers, k, rngs) for k in source_depths])
    window = cfg.window * window_unit if cfg.window > 0 else 0
    self.windows = (num_layers, window, cfg.full_attention_every)
    self.blocks.set_attributes(windows=T.window_sizes(*self.windows))
    self.num_layers, self.irc, self.irc_softmax = num_layers, cfg.irc, cfg.irc_softmax
    self.remat, self.dtype = cfg.remat, jnp.dtype(cfg.dtype)
    self.unroll = cfg.get("scan_unroll", 1)

  def __call__(self, x, positions, segment_ids, sources=(), cache=None, cache_index=None):
    """x [B, T, d]; sources: one [K, B, T, d] array per route, aligned to these positions.

    With a KV cache (`init_cache`) the blocks attend to the cached keys as well; IRC and CRC
    mix depths at one position, so they need no cache. Returns (final state, block outputs, cache).
    """
    graphdef, state = nnx.split(self.blocks)
    w = lambda p: p[...].astype(self.dtype)
    normed = [constrain(route.norm(s.astype(self.dtype)), TOKENS) for route, s in zip(self.routes, sources)]  # LN(S_j), once
    layers = {"block": state, "window": T.layer_windows(*self.windows), "l": jnp.arange(self.num_layers),
              "crc": [(w(r.w1), w(r.w2), w(r.scale)) for r in self.routes], "cache": cache}
    if self.irc:
      layers["irc"] = (w(self.irc_w1), w(self.irc_w2))

    def body(carry, layer, consts):
      x, history = carry
      normed, positions, segment_ids = consts
      for s, p in zip(normed, layer["crc"]):  # routes apply in turn: encoder, then concept
        x = C.cross_module_residual(x, s, *p)
      block = nnx.merge(graphdef, layer["block"])
      out, layer_cache = block(constrain(x, TOKENS), positions, segment_ids, layer["window"], layer["cache"],
                               cache_index)
      out, layer_cache = constrain(out, TOKENS), (layer_cache, qk_stats(block), moe_stats(block))
      if not self.irc:
        return (out, history), (out, layer_cache)
      latest = layer["l"] + 1
      history = constrain(jax.lax.dynamic_update_index_in_dim(history, out, latest, 0), TOKENS)
      x = C.intra_module_residual(history, out - x, *layer["irc"], latest, self.irc_softmax)
      return (constrain(x, TOKENS), history), (out, layer_cache)

    consts, history = (normed, positions, segment_ids), None
    if self.irc:  # slot 0 of the history is the module input H_1, slot l+1 the output of layer l
      history = constrain(jnp.zeros((self.num_layers + 1, *x.shape), x.dtype).at[0].set(x), TOKENS)
    if self.irc and self.remat != "none" and cache is None:
      # Recompute rather than store: O(L) states, not O(L^2). history_scan keeps each layer's input
      # and recomputes the whole layer, so under IRC "matmuls" recomputes as much as "full".
      x, outs = history_scan(body, x, history, layers, consts)
      return x, outs, None
    body = remat(body, self.remat)
    (x, _), (outs, (cache, stats, moe)) = jax.lax.scan(lambda carry, layer: body(carry, layer, consts), (x, history),
                                                       layers, unroll=self.unroll)
    keep_qk_stats(self, stats)
    if cache is None:  # decoding (a cache, maybe inside lax.cond) keeps no routing statistics
      keep_moe_stats(self, moe)
    return x, outs, cache

  def init_cache(self, cfg, batch, length, dtype):
    return kv_cache(cfg, self.num_layers, batch, length, dtype)


def history_scan(body, x, history, layers, consts):
  """jax.lax.scan of an IRC stack -> (x, outs), whose backward pass stores O(L) states, not O(L^2).

  A plain scan saves its carry, the whole [L+1, B, T, d] history, at every layer. But layer l
  only writes slot l+1, so the history it read is the final history with the slots after l
  zeroed: the backward pass rebuilds it from there and from each layer's input x, and
  recomputes the layer. `body(carry, layer, consts)` is the scan body; integer inputs (windows,
  positions) pass through undifferentiated.
  """
  return _history_scan(body, x, history, *split_ints((layers, consts)))


def split_ints(tree):
  """(floats, ints): the pytree twice, with None in place of its integer / its float leaves."""
  is_int = lambda a: not jnp.issubdtype(jnp.result_type(a), jnp.inexact)
  keep = lambda want: jax.tree.map(lambda a: a if is_int(a) == want else None, tree)
  return keep(False), keep(True)


def join(floats, ints):
  return jax.tree.map(lambda f, i: i if f is None else f, floats, ints, is_leaf=lambda a: a is None)


def _forward(body, x, history, floats, ints):
  (layers, consts), (layer_ints, const_ints) = floats, ints
  consts = join(consts, const_ints)

  def step(carry, layer):
    new, (out, _) = body(carry, join(*layer), consts)
    return new, (out, carry[0])

  (x, history), (outs, inputs) = jax.lax.scan(step, (x, history), (layers, layer_ints))
  return (x, outs), (inputs, history, floats, ints)


def _backward(body, saved, cotangent):
  inputs, history, (layers, consts), (layer_ints, const_ints) = saved
  slots = jnp.arange(history.shape[0]).reshape(-1, *[1] * (history.ndim - 1))

  def step(carry, layer):
    g_x, g_history, g_consts = carry
    floats, ints, x, l, g_out = layer
    read = jnp.where(slots <= l, history, jnp.zeros((), history.dtype))  # the history layer l saw

    def layer_fn(carry, floats, consts):  # the forward step again: (new carry, block output)
      new, (out, _) = body(carry, join(floats, ints), join(consts, const_ints))
      return new, out

    _, vjp = jax.vjp(layer_fn, (x, read), floats, consts)
    (g_x, g_history), g_floats, g_k = vjp(((g_x, g_history), g_out))
    return (g_x, g_history, jax.tree.map(jnp.add, g_consts, g_k)), g_floats

  g_x, g_outs = cotangent
  start = (g_x, jnp.zeros_like(history), jax.tree.map(jnp.zeros_like, consts))
  (g_x, g_history, g_consts), g_layers = jax.lax.scan(
      step, start, (layers, layer_ints, inputs, jnp.arange(inputs.shape[0]), g_outs), reverse=True)
  return g_x, g_history, (g_layers, g_consts), None


_history_scan = jax.custom_vjp(lambda body, *args: _forward(body, *args)[0], nondiff_argnums=(0,))
_history_scan.defvjp(_forward, _backward)


class ConceptLM(nnx.Module):
  """NCP-ArchPreview. Same interface as BaselineLM; `.aux` holds what the NCP and VQ losses need."""

  def __init__(self, cfg, rngs):
    d, pd = cfg.d_model, jnp.dtype(cfg.param_dtype)
    s, n = cfg.num_segments, cfg.codebook_size
    if d % s:  # load_config checks this too; a model built from a hand-made config must as well
      raise ValueError(f"model.num_segments={s} does not divide model.d_model={d}; pick a divisor of it.")
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
    return embed_lookup(self.embed[...], tokens, self.dtype)

  def __call__(self, tokens, segment_ids=None, positions=None, *, logits=True, impl="auto", cache=None,
               cache_index=None):
    """tokens [B, T] int32 -> ModelOutput; `impl` picks the codebook-mixing kernel.

    With a `cache` (`init_cache`), tokens continue one document from position `cache_index`
    (segment_ids and positions are implied) and the output carries the updated cache.
    """
    if cache is not None:
      if segment_ids is not None or positions is not None:
        raise ValueError("ConceptLM decodes one document: with a cache, pass no segment_ids or positions.")
      return self.extend(tokens, cache, cache_index, logits, impl)
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

    h, enc_states, _ = self.encoder(self.embed_tokens(tokens), positions, segment_ids)
    c = constrain(C.pool_concepts(h, k, docs), TOKENS)                     # [B, M, d]
    if cfg.concept_norm:
      c = self.concept_norm(c)
    code_logits, predicted, con_states, _ = self.predict(
        c, C.concept_positions(token_pos, k, cfg.concept_positions), concept_seg,
        [C.pool_concepts(enc_states, k, docs)] if cfg.crc_encoder_concept else [], impl)
    codes, quantized = C.pq_assign(c, self.codebook[...])

    valid = C.same_document(segment_ids, k) if cfg.document_mask else None
    x = C.inject_concepts(h, predicted, k, valid=valid, **self.fusion())
    pre_norm, hidden, out_logits, _ = self.run_decoder(x, enc_states, C.align_to_tokens(con_states, t, k, valid),
                                                       positions, segment_ids, logits)
    aux = {"concepts": c, "predicted": predicted, "quantized": quantized, "codes": codes,
           "code_logits": code_logits, "ncp_mask": concept_seg[:, :-1] == concept_seg[:, 1:], "pre_norm": pre_norm}
    if self.nitp_layer:  # NITP's target: a shallow encoder state; its prediction reads the decoder (docs/aux.md)
      aux["nitp_target_state"] = enc_states[self.nitp_layer - 1]
    moe = [m for m in (pop_moe_stats(s) for s in (self.encoder, self.concept, self.decoder)) if m]
    if moe:  # model.moe: every module's sparse layers' routing statistics, in layer order
      aux["moe"] = jax.tree.map(lambda *a: jnp.concatenate(a), *moe)
    return ModelOutput(hidden=hidden, logits=out_logits, aux=aux)

  def predict(self, c, positions, segment_ids, sources, impl, cache=None, cache_index=None):
    """Concept module and heads (Eq. 7-10): concepts c [B, M, d] -> (code logits [B, M, S, N],
    predictions p [B, M, d], the module's layer states [C, B, M, d], its updated cache)."""
    u, states, cache = self.concept(c, positions, segment_ids, sources, cache, cache_index)
    code_logits = self.head_norm(u) @ self.heads[...].astype(self.dtype)
    code_logits = constrain(code_logits.reshape(*u.shape[:2], self.cfg.num_segments, self.cfg.codebook_size),
                            ("batch", "length", "segments", "codes"))
    mix = lambda logits, codebook: C.mix_codebook(logits, codebook, self.cfg.mixing, impl)  # a kernel: per shard
    # The codebook enters in its stored dtype: the mixture is 1/S of the heads' FLOPs, and its
    # gradient, summed over the batch shards, then sums in float32.
    predicted = constrain(per_batch_shard(mix, code_logits, self.codebook[...]).astype(self.dtype), TOKENS)
    return code_logits, predicted, states, cache

  def fusion(self):
    """Keyword arguments of the Eq. 12 fusion (`C.fuse_concepts`)."""
    if self.cfg.fusion == "add":
      return {"fusion": "add"}
    return dict(fusion="norm_add", h_scale=self.fuse_h_norm.scale[...], c_scale=self.fuse_c_norm.scale[...],
                a=self.fuse_scale[...], eps=self.cfg.norm_eps)

  def run_decoder(self, x, enc_states, con_states, positions, segment_ids, logits, cache=None, cache_index=None):
    """Token decoder on x = htilde [B, T, d], with the CRC sources aligned to the tokens, then the
    final norm and LM head -> (state before the final norm, hidden, logits or None, updated cache)."""
    sources = {"encoder": enc_states, "concept": con_states}
    x, _, cache = self.decoder(x, positions, segment_ids, [sources[r] for r in self.decoder_routes], cache,
                               cache_index)
    hidden = self.final_norm(x)
    return x, hidden, hidden @ self.head_weight().astype(self.dtype) if logits else None, cache

  # ---------------------------------------------------------------- incremental decoding
  def init_cache(self, batch, length, dtype=None):
    """Decoding state for `length` tokens of one document.

    KV caches of the encoder and decoder (one slot per token) and of the concept module (one
    slot per chunk); the encoder outputs and layer states of the current chunk, pooled when it
    completes; and the newest prediction p_j with the concept module's layer states, which
    every token receives (Eq. 11, and the Concept->Decoder route) until the next chunk
    completes. They start at zero: no concept before the first complete chunk.
    """
    cfg, k, d = self.cfg, self.cfg.chunk_size, self.cfg.d_model
    kv = dtype or self.dtype
    zeros = lambda *shape: jnp.zeros(shape, self.dtype)
    return {"encoder": self.encoder.init_cache(cfg, batch, length, kv),
            "concept": self.concept.init_cache(cfg, batch, max(length // k, 1), kv),
            "decoder": self.decoder.init_cache(cfg, batch, length, kv),
            "chunk": zeros(batch, k, d), "chunk_states": zeros(cfg.encoder_layers, batch, k, d),
            "predicted": zeros(batch, 1, d), "concept_states": zeros(cfg.concept_layers, batch, 1, d)}

  def extend(self, tokens, cache, cache_index, logits=True, impl="auto"):
    """Continue one document by tokens [B, L] from position `cache_index`, a token at a time
    (a prompt too: concepts advance only at chunk ends) -> ModelOutput with the new cache."""
    def step(cache, inputs):
      hidden, out_logits, cache = self.step(inputs[0][:, None], inputs[1], cache, logits, impl)
      return cache, (hidden[:, 0], None if out_logits is None else out_logits[:, 0])

    indices = cache_index + jnp.arange(tokens.shape[1])
    cache, (hidden, out_logits) = jax.lax.scan(step, cache, (tokens.T, indices))
    swap = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    return ModelOutput(hidden=swap(hidden), logits=swap(out_logits), cache=cache)

  def step(self, token, index, cache, logits=True, impl="auto"):
    """One token [B, 1] at position `index` (may be traced) -> (hidden, logits, cache).

    The encoder runs on the token; when it completes chunk j = index // k, the chunk is pooled
    and the concept module runs one position to give p_j. That comes before the decoder: under
    Eq. 11 the token completing chunk j already receives p_j.
    """
    cfg, k = self.cfg, self.cfg.chunk_size
    b = token.shape[0]
    positions, segment_ids = jnp.full((b, 1), index, jnp.int32), jnp.zeros((b, 1), jnp.int32)
    h, enc_states, enc_cache = self.encoder(self.embed_tokens(token), positions, segment_ids,
                                            (), cache["encoder"], index)
    chunk = jax.lax.dynamic_update_slice_in_dim(cache["chunk"], h, index % k, axis=1)
    chunk_states = jax.lax.dynamic_update_slice_in_dim(cache["chunk_states"], enc_states, index % k, axis=2)

    def advance():  # the same pooling and positions as the full forward, on one chunk
      docs = jnp.zeros((b, k), jnp.int32) if cfg.document_mask else None
      c = C.pool_concepts(chunk, k, docs)
      if cfg.concept_norm:
        c = self.concept_norm(c)
      chunk_pos = index + 1 - k + jnp.broadcast_to(jnp.arange(k), (b, k))
      _, predicted, states, concept_cache = self.predict(
          c, C.concept_positions(chunk_pos, k, cfg.concept_positions), segment_ids,
          [C.pool_concepts(chunk_states, k, docs)] if cfg.crc_encoder_concept else [], impl,
          cache["concept"], index // k)
      return predicted, states, concept_cache

    keep = lambda: (cache["predicted"], cache["concept_states"], cache["concept"])
    predicted, con_states, concept_cache = jax.lax.cond((index + 1) % k == 0, advance, keep)
    x = C.fuse_concepts(h, predicted, **self.fusion())
    _, hidden, out_logits, dec_cache = self.run_decoder(x, enc_states, con_states, positions, segment_ids, logits,
                                                     cache["decoder"], index)
    cache = {"encoder": enc_cache, "concept": concept_cache, "decoder": dec_cache, "chunk": chunk,
             "chunk_states": chunk_states, "predicted": predicted, "concept_states": con_states}
    return hidden, out_logits, cache
