"""Thin Flax NNX layers over `latent_jax.ops.transformer`; each parameter names its logical axes.

The `axes` metadata of every `nnx.Param` is read by `latent_jax.sharding`, which maps it
to mesh axes through one rules table. Stacked (scanned) parameters carry one extra leading
layer axis that is not named; the sharding code treats it as replicated.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.config import moe_enabled
from latent_jax.sharding import constrain, per_batch_shard
from latent_jax.ops import attention as A
from latent_jax.ops import moe as MoE
from latent_jax.ops import monitors as M
from latent_jax.ops import transformer as T

EMPTY_SLOT = 2**30  # the position of a cache slot not written yet
TOKENS = ("batch", "length", "act_embed")  # logical axes of a [B, T, d] activation

# model.remat -> what the backward pass keeps of a block (docs/performance.md, "Memory"). A scan
# keeps each checkpointed body's input, the block input, so "full" recomputes every block from it.
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat(body, policy):
  """`body` under the model.remat policy: "none" stores all its activations for the backward pass."""
  return body if policy == "none" else jax.checkpoint(body, prevent_cse=False, policy=REMAT_POLICIES[policy])


def param(rngs, shape, axes, std, dtype):
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * std, axes=axes)


def ones(shape, axes, dtype):
  return nnx.Param(jnp.ones(shape, dtype), axes=axes)


def embed_lookup(table, tokens, dtype):
  """Rows of the embedding table [V, d] at tokens [B, T] -> [B, T, d] in the compute dtype.

  The table is gathered whole over fsdp, as FSDP does, in its stored dtype, and the rows are
  cast after the lookup: the gradient's scatter-add then sums each token's rows in float32
  (in bf16 a frequent token's running sum stalls: 4096 ones add up to 256).
  """
  table = constrain(table, ("vocab", "act_embed"))
  return constrain(table[tokens].astype(dtype), TOKENS)


class RMSNorm(nnx.Module):
  def __init__(self, dim, eps, dtype):
    self.scale = ones((dim,), ("norm",), dtype)
    self.eps = eps

  def __call__(self, x):
    return T.rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
  """GQA with RoPE, optional QK-norm and an optional KV cache for decoding.

  `attention_impl` (latent_jax.ops.attention.IMPLS) picks the kernel of the uncached path;
  `build_model` sets it from `kernels.attention`. Decoding with a cache uses the dense one.
  `windows`: the static window sizes the traced `window` takes (set by the stacks; the splash
  kernel needs them). `monitor` (set by the monitors' probe, train/monitors.py): record per-head
  statistics of the q and k that enter q k^T in `self.qk_stats` (an nnx.Intermediate).
  """

  def __init__(self, cfg, rngs):
    d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
    self.q = param(rngs, (d, h * hd), ("embed", "heads"), std, pd)
    self.k = param(rngs, (d, k * hd), ("embed", "kv_heads"), std, pd)
    self.v = param(rngs, (d, k * hd), ("embed", "kv_heads"), std, pd)
    self.o = param(rngs, (h * hd, d), ("heads", "embed"), std, pd)
    self.qk_norm = cfg.qk_norm
    if cfg.qk_norm == "layer":    # OLMo-3: one norm over the whole q (and k) projection
      self.q_norm, self.k_norm = RMSNorm(h * hd, cfg.norm_eps, pd), RMSNorm(k * hd, cfg.norm_eps, pd)
    elif cfg.qk_norm == "head":   # per-head norm over head_dim, shared by heads
      self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps, pd), RMSNorm(hd, cfg.norm_eps, pd)
    self.shape = (h, k, hd)
    self.rope_base = cfg.rope_base
    self.yarn = yarn_settings(cfg)
    self.dtype = jnp.dtype(cfg.dtype)
    self.attention_impl = "auto"
    self.windows = (T.NO_WINDOW,)
    self.monitor = False

  def __call__(self, x, positions, segment_ids, window, cache=None, cache_index=None):
    h, k, hd = self.shape
    b, t, _ = x.shape
    w = lambda p: p[...].astype(self.dtype)
    q, key, val = (T.linear(x, w(p)) for p in (self.q, self.k, self.v))
    if self.qk_norm == "layer":
      q, key = self.q_norm(q), self.k_norm(key)
    q = constrain(q.reshape(b, t, h, hd), ("batch", "length", "heads", "head_dim"))
    key, val = (constrain(a.reshape(b, t, k, hd), ("batch", "length", "kv_heads", "head_dim")) for a in (key, val))
    if self.qk_norm == "head":
      q, key = self.q_norm(q), self.k_norm(key)
    frequencies, scale = self.rotary(window)
    q, key = T.rope(q, positions, frequencies, scale), T.rope(key, positions, frequencies, scale)
    if self.monitor and cache is None:
      self.qk_stats = nnx.Intermediate(M.qk_stats(q, key, positions, positions, segment_ids, segment_ids, window))
    if cache is None:
      out = A.attention(q, key, val, segment_ids, positions, window, self.attention_impl, windows=self.windows)
    else:  # decoding one document: write slots cache_index.., each with the position of its key
      key = jax.lax.dynamic_update_slice(cache["k"], key.astype(cache["k"].dtype), (0, cache_index, 0, 0))
      val = jax.lax.dynamic_update_slice(cache["v"], val.astype(cache["v"].dtype), (0, cache_index, 0, 0))
      pos = jax.lax.dynamic_update_slice(cache["pos"], positions.astype(jnp.int32), (0, cache_index))
      cache = {"k": key, "v": val, "pos": pos}
      mask = T.attention_mask(positions, pos, segment_ids, jnp.zeros_like(pos) + segment_ids[:, :1], window)
      out = T.attention(q, key.astype(self.dtype), val.astype(self.dtype), mask)
    out = constrain(out.reshape(b, t, h * hd), ("batch", "length", "heads"))
    return T.linear(out, w(self.o)), cache


  def rotary(self, window):
    """(frequencies [D/2], scale) of this layer's RoPE: YaRN's on full-attention layers (window ==
    NO_WINDOW) under model.rope_scaling="yarn", plain RoPE's elsewhere, as OLMo-3 does. `window` is
    traced inside the layer scan, so both tables are built and one is picked per layer."""
    plain = T.rope_frequencies(self.shape[2], self.rope_base)
    if self.yarn is None:
      return plain, 1.0
    factor, original_context, beta_fast, beta_slow, attention_factor = self.yarn
    full = window >= T.NO_WINDOW
    yarn = T.yarn_frequencies(self.shape[2], self.rope_base, factor, original_context, beta_fast, beta_slow)
    return jnp.where(full, yarn, plain), jnp.where(full, attention_factor, 1.0)


def yarn_settings(cfg):
  """(factor, original context, beta_fast, beta_slow, attention factor) of model.rope_scaling="yarn", else
  None; model.yarn_attention_factor=0 takes YaRN's 0.1 ln(factor) + 1."""
  if cfg.get("rope_scaling", "none") != "yarn":  # configs saved before the field: plain RoPE
    return None
  factor = cfg.yarn_factor
  return (factor, cfg.yarn_original_context, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
          cfg.yarn_attention_factor or T.yarn_attention_factor(factor))


class MLP(nnx.Module):
  def __init__(self, cfg, rngs):
    d, f, pd, std = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype), cfg.init_std
    self.gate = param(rngs, (d, f), ("embed", "mlp"), std, pd)
    self.up = param(rngs, (d, f), ("embed", "mlp"), std, pd)
    self.down = param(rngs, (f, d), ("mlp", "embed"), std, pd)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x):
    w = lambda p: p[...].astype(self.dtype)
    return T.swiglu(x, w(self.gate), w(self.up), w(self.down))


class SparseMLP(nnx.Module):
  """Mixture of experts (model.moe, docs/moe.md): a router, E routed SwiGLU experts, optional shared experts.

  Calls return the MLP output; the routing statistics of the call (`latent_jax.ops.moe`: load-balance
  loss, router z-loss, expert load [E], dropped fraction) are kept in `self.stats` (an nnx.Intermediate)
  for the stack to collect. The sigmoid router's `router_bias` (aux-loss-free balancing) selects experts
  only; the train step moves it (train/step.py), the optimiser does not.
  """

  def __init__(self, cfg, rngs):
    m = cfg.moe
    d, f, e, pd, std = cfg.d_model, m.expert_dim, m.num_experts, jnp.dtype(cfg.param_dtype), cfg.init_std
    self.router = param(rngs, (d, e), ("embed", "expert"), std, pd)
    if m.router == "sigmoid":
      self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), axes=("expert",))
    self.gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std, pd)
    self.up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std, pd)
    self.down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std, pd)
    if m.shared_experts:  # s shared experts of width f are one SwiGLU of width s * f
      w = m.shared_experts * f
      self.shared_gate = param(rngs, (d, w), ("embed", "mlp"), std, pd)
      self.shared_up = param(rngs, (d, w), ("embed", "mlp"), std, pd)
      self.shared_down = param(rngs, (w, d), ("mlp", "embed"), std, pd)
    self.top_k, self.kind, self.norm_topk_prob = m.top_k, m.router, m.norm_topk_prob
    self.capacity_factor, self.impl = m.capacity_factor, m.get("impl", "auto")
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x):
    w = lambda p: p[...].astype(self.dtype)
    rows = x.reshape(-1, x.shape[-1])                                     # [N, d]
    logits = T.linear(rows, w(self.router)).astype(jnp.float32)           # [N, E]
    scores = MoE.router_scores(logits, self.kind)
    bias = self.router_bias[...] if self.kind == "sigmoid" else None
    experts = MoE.top_k_experts(scores, self.top_k, bias)
    weights = MoE.combine_weights(scores, experts, self.kind, self.norm_topk_prob)
    capacity = MoE.expert_capacity(rows.shape[0], self.top_k, self.gate.shape[0], self.capacity_factor)
    experts_w = (w(self.gate), w(self.up), w(self.down))
    if capacity:  # the whole batch's pairs, earlier tokens first: one sort over every batch shard
      y, dropped = MoE.sparse_swiglu(rows, experts, weights, *experts_w, capacity, self.impl)
    else:  # dropless: each batch shard sorts and runs its own tokens; the experts' weights come to it (docs/moe.md)
      y = per_batch_shard(lambda r, *ws: MoE.sparse_swiglu(*r, *ws, 0, self.impl)[0], (rows, experts, weights), *experts_w)
      dropped = jnp.zeros((), jnp.float32)
    if hasattr(self, "shared_gate"):
      y = y + T.swiglu(rows, w(self.shared_gate), w(self.shared_up), w(self.shared_down))
    load = MoE.expert_load(experts, self.gate.shape[0])
    stats = {"lb_loss": MoE.load_balance_loss(scores, experts, self.gate.shape[0]),
             "z_loss": jnp.mean(MoE.router_z_loss(logits)), "load": load, "dropped": dropped,
             "entropy": jnp.mean(MoE.router_entropy(scores))}
    if bias is not None:  # value 0; d/d bias = load: the train step reads the load from the bias's gradient
      stats["bias_probe"] = jnp.sum((bias - jax.lax.stop_gradient(bias)) * load)
    self.stats = nnx.Intermediate(stats)
    return y.reshape(x.shape).astype(x.dtype)


class Block(nnx.Module):
  """One transformer block. `post` (OLMo-3): x + norm(f(x)); `pre`: x + f(norm(x)). `sparse`: the MLP is a
  SparseMLP (model.moe)."""

  def __init__(self, cfg, rngs, sparse=False):
    pd = jnp.dtype(cfg.param_dtype)
    self.attn, self.mlp = Attention(cfg, rngs), (SparseMLP(cfg, rngs) if sparse else MLP(cfg, rngs))
    self.attn_norm, self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd), RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.post_norm = cfg.block_order == "post"

  def __call__(self, x, positions, segment_ids, window, cache=None, cache_index=None):
    if self.post_norm:
      a, cache = self.attn(x, positions, segment_ids, window, cache, cache_index)
      x = x + self.attn_norm(a)
      return x + self.mlp_norm(self.mlp(x)), cache
    a, cache = self.attn(self.attn_norm(x), positions, segment_ids, window, cache, cache_index)
    x = x + a
    return x + self.mlp(self.mlp_norm(x)), cache


def moe_stats(block):
  """The routing statistics a block's SparseMLP recorded in this call, or None for a dense block."""
  return block.mlp.stats.get_value() if isinstance(block.mlp, SparseMLP) else None


def qk_stats(block):
  """The per-head statistics a block's attention recorded in this call (`Attention.monitor`), or None."""
  return block.attn.qk_stats.get_value() if block.attn.monitor else None


def keep_qk_stats(stack, stats):
  """Keep a stack's stacked per-layer qk_stats ({name: [L, heads]}) on it for the probe to pop; None: nothing."""
  if stats is not None:
    stack.qk_stats = nnx.Intermediate(stats)


def stacked_blocks(cfg, num_layers, rngs, sparse=False):
  """`num_layers` Blocks whose parameters are stacked on a leading layer axis, for `jax.lax.scan`."""
  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(cfg, rngs, sparse)

  return make(rngs)


def keep_moe_stats(stack, stats):
  """Keep a stack's stacked per-sparse-layer routing statistics ({name: [L_sparse, ...]}) on it; None: nothing."""
  if stats is not None:
    stack.moe_stats = nnx.Intermediate(stats)


def pop_moe_stats(stack):
  """The routing statistics a stack kept in its last call ({} if none), removed from it."""
  if not hasattr(stack, "moe_stats"):
    return {}
  stats = stack.moe_stats.get_value()
  del stack.moe_stats
  return stats


def layer_segments(sparse, tap, period=1):
  """How a stack of layers of two kinds (`sparse`: bools) is scanned: (first layer, pattern, repeats) each, in
  layer order, split at `tap`. A pattern is the kinds of the next `period` layers where they mix both kinds
  (model.moe.every > 1: a sparse layer and its dense ones), repeated as long as the layers repeat it; else
  one layer's kind, repeated over a maximal run of it."""
  segments, bounds = [], [0, tap, len(sparse)] if 0 < tap < len(sparse) else [0, len(sparse)]
  for i, end in zip(bounds[:-1], bounds[1:]):
    while i < end:
      pattern, repeats = tuple(sparse[i:i + period]), 0
      while period > 1 and i + (repeats + 1) * period <= end and \
          tuple(sparse[i + repeats * period:i + (repeats + 1) * period]) == pattern:
        repeats += 1
      if repeats < 1 or len(set(pattern)) < 2:
        pattern, repeats = (sparse[i],), 1
        while i + repeats < end and sparse[i + repeats] == sparse[i]:
          repeats += 1
      segments.append((i, pattern, repeats))
      i += len(pattern) * repeats
  return segments


class BlockStack(nnx.Module):
  """`num_layers` blocks with stacked parameters, applied with `jax.lax.scan`.

  Scanning keeps compile time flat in depth (model.scan_unroll > 1 unrolls that many layers per
  loop iteration, trading compile time for fewer loop boundaries); `remat` (a model.remat policy) recomputes each
  block, or all but its matmuls, in the backward pass instead of storing its activations.

  With model.moe the sparse layers (ops.moe.sparse_layers) are a second stack, `sparse_blocks`: a scan needs
  layers of one structure. The stack runs as a few scans (`layer_segments`): each over a run of one kind, or,
  with model.moe.every > 1, over groups of `every` layers (a sparse one, then its dense ones), each
  iteration taking its layers' slices of the two stacks. So the number of scans does not grow with depth.
  """

  def __init__(self, cfg, num_layers, rngs):
    moe = moe_enabled(cfg)
    self.sparse = MoE.sparse_layers(num_layers, cfg.moe.every, cfg.moe.first_dense) if moe else (False,) * num_layers
    self.period = cfg.moe.every if moe else 1
    self.num_layers = num_layers
    self.windows = (num_layers, cfg.window, cfg.full_attention_every)
    if sum(self.sparse) < num_layers:
      self.blocks = stacked_blocks(cfg, num_layers - sum(self.sparse), rngs)
      self.blocks.set_attributes(windows=T.window_sizes(*self.windows))
    if any(self.sparse):
      self.sparse_blocks = stacked_blocks(cfg, sum(self.sparse), rngs, sparse=True)
      self.sparse_blocks.set_attributes(windows=T.window_sizes(*self.windows))
    self.remat = cfg.remat
    self.unroll = cfg.get("scan_unroll", 1)

  def __call__(self, x, positions, segment_ids, cache=None, cache_index=None, tap=0):
    """Returns (x, cache, tapped): `tapped` is the state after the first `tap` layers (None if tap=0)."""
    stacks = {kind: nnx.split(getattr(self, name)) for kind, name in ((False, "blocks"), (True, "sparse_blocks"))
              if hasattr(self, name)}
    stack = lambda items: jax.tree.map(lambda *a: jnp.stack(a), *items) if items else None
    merge = lambda a: jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), a)  # [repeats, n, ...] -> layers

    def body(pattern):
      def step(x, layer):  # one repeat of the pattern: its layers in turn
        params, window, layer_cache = layer
        caches, qk, routing = [], [], []
        for j, kind in enumerate(pattern):
          block = nnx.merge(stacks[kind][0], params[j])
          x, c = block(constrain(x, TOKENS), positions, segment_ids, window[j],
                       jax.tree.map(lambda v: v[j], layer_cache), cache_index)
          x = constrain(x, TOKENS)
          caches.append(c)
          qk.append(qk_stats(block))
          routing += [moe_stats(block)] if kind else []
        return x, (stack(caches), stack(qk), stack(routing))
      return remat(step, self.remat)

    windows, before, tapped, outs, moe = T.layer_windows(*self.windows), {False: 0, True: 0}, None, [], []
    for start, pattern, repeats in layer_segments(self.sparse, tap, self.period):
      if tap and start == tap:
        tapped = x
      end = start + len(pattern) * repeats
      params, rank = [], {False: 0, True: 0}
      for kind in pattern:  # layer (r, j) is layer before[kind] + r * n + rank of j of its kind's stack
        n, first = pattern.count(kind), before[kind]
        params.append(jax.tree.map(lambda v: v[first:first + repeats * n].reshape(repeats, n, *v.shape[1:])[:, rank[kind]],
                                   stacks[kind][1]))
        rank[kind] += 1
      for kind in set(pattern):
        before[kind] += repeats * pattern.count(kind)
      group = lambda a: jax.tree.map(lambda v: v[start:end].reshape(repeats, len(pattern), *v.shape[1:]), a)
      x, (layer_cache, stats, routing) = jax.lax.scan(body(pattern), x, (params, group(windows), group(cache)),
                                                       unroll=self.unroll)
      outs.append((merge(layer_cache), merge(stats)))
      if routing is not None:
        moe.append(merge(routing))
    if tap and tapped is None:  # tap = num_layers: the final state
      tapped = x
    cache, stats = jax.tree.map(lambda *a: jnp.concatenate(a), *outs) if len(outs) > 1 else outs[0]
    keep_qk_stats(self, stats)
    if moe and cache is None:  # decoding keeps no routing statistics
      keep_moe_stats(self, jax.tree.map(lambda *a: jnp.concatenate(a), *moe))
    return x, cache, tapped

  def init_cache(self, cfg, batch, length, dtype):
    return kv_cache(cfg, self.num_layers, batch, length, dtype)


def kv_cache(cfg, num_layers, batch, length, dtype):
  """An empty KV cache of `length` slots per layer. `pos` holds the position of each slot's key,
  so slots need not be token positions (ConceptLM's concept m may sit at m*k); empty slots hold
  EMPTY_SLOT, a position after every query, so the causal mask hides them."""
  shape = (num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
          "pos": jnp.full((num_layers, batch, length), EMPTY_SLOT, jnp.int32)}
