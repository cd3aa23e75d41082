"""Pure functions of a mixture-of-experts MLP: routing, combine weights, balance losses, the sparse MLP.

Shapes: N tokens (batch and sequence flattened), d model width, E experts, k experts per token,
f an expert's hidden width. Routers (docs/moe.md):
  softmax (OLMoE, Muennighoff et al. 2024; FlexOlmo): p = softmax(x W_r), the top k of p, their
    weights p_i (renormalised to sum 1 with norm_topk_prob);
  sigmoid (DeepSeek-V3, Sec. 2.1.2): s = sigmoid(x W_r), the top k of s + b (b: the bias of
    auxiliary-loss-free balancing, for selection only), weights s_i / sum of the chosen s.
The sparse MLP sorts the N*k (token, expert) pairs by expert and runs each expert's rows through
grouped matmuls (`jax.lax.ragged_dot`, or tiles of one expert each on CPU), so compute is that of the k
chosen experts, not all E.
"""
import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import backend as kernel_backend

def router_scores(logits, router):
  """Router scores of logits [N, E] in float32: softmax over experts (Switch Eq. 1, OLMoE) or sigmoid (DeepSeek-V3 Eq. 15)."""
  logits = logits.astype(jnp.float32)
  return jax.nn.softmax(logits, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits)


def top_k_experts(scores, k, bias=None):
  """The k experts of each token [N, k] int32: the largest scores (+ bias, DeepSeek-V3 Eq. 16: selection only)."""
  if bias is not None:
    scores = scores + jax.lax.stop_gradient(bias.astype(scores.dtype))
  return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def combine_weights(scores, experts, router, norm_topk_prob):
  """Gate weights [N, k] of the chosen experts: softmax scores, renormalised if `norm_topk_prob` (OLMoE: not);
  sigmoid scores always normalised over the chosen ones (DeepSeek-V3 Eq. 13)."""
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  if router == "sigmoid" or norm_topk_prob:
    chosen = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
  return chosen


def expert_load(experts, num_experts):
  """Tokens routed to each expert [E] (float32): counts over all N*k choices."""
  return jnp.zeros(num_experts, jnp.float32).at[experts.reshape(-1)].add(1.0)


def load_balance_loss(scores, experts, num_experts):
  """Load-balancing loss E * sum_e f_e P_e (Switch Transformer Eq. 4, as OLMoE and transformers' load_balancing_loss_func).

  f_e: fraction of tokens that chose expert e among their k (sums to k), P_e: mean router score of e, each
  token's scores normalised to sum 1 (a softmax's do; DeepSeek-V3 Eq. 19 normalises the sigmoid's). With
  uniform routing and scores it is k; the weight is `moe.lb_loss_weight`.
  """
  n = scores.shape[0]
  f = expert_load(experts, num_experts) / n
  p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=0)
  return num_experts * jnp.sum(f * p)


def router_entropy(scores):
  """Entropy of each token's routing distribution [N] (scores normalised over the experts): log E when uniform."""
  p = scores / jnp.sum(scores, axis=-1, keepdims=True)
  return -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)


def router_z_loss(logits):
  """Router z-loss per token [N] (ST-MoE, Zoph et al. 2022, Eq. 5, before its mean): logsumexp(x W_r)^2."""
  return jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


def expert_capacity(num_tokens, k, num_experts, capacity_factor):
  """Rows each expert takes, ceil(cf * N * k / E) (GShard / Switch); 0 (capacity_factor 0) = no limit."""
  return math.ceil(capacity_factor * num_tokens * k / num_experts) if capacity_factor > 0 else 0


def sort_by_expert(experts, num_experts):
  """(order [N*k]: the (token, slot) pairs sorted by expert, stable; group sizes [E] int32)."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


GROUPED_IMPLS = ("auto", "ragged", "tiled")


def tile_layout(group_sizes, num_rows, tile):
  """Where the expert-sorted rows go in a buffer of tiles of `tile` rows, each tile holding one expert's rows.

  Each expert's group starts on a tile boundary. Returns (slot of each row [num_rows], expert of each tile [T]),
  T = ceil(num_rows / tile) + E (static: enough for any group sizes); unused tiles are zeros of the last expert.
  """
  num_experts = group_sizes.shape[0]
  tiles = (group_sizes + tile - 1) // tile                                # tiles per expert
  tile_ends = jnp.cumsum(tiles)
  starts = jnp.cumsum(group_sizes) - group_sizes                          # first sorted row of each expert
  expert = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
  slot = (tile_ends - tiles)[expert] * tile + jnp.arange(num_rows) - starts[expert]
  num_tiles = -(-num_rows // tile) + num_experts
  tile_expert = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(num_tiles), side="right"), num_experts - 1)
  return slot, tile_expert


def default_tile(num_rows, num_experts):
  """Rows per tile: a power of two near a quarter of the mean group (padding <= 1/4 of the rows), in [8, 512]."""
  return int(min(512, max(8, 2 ** math.floor(math.log2(max(1, num_rows // (4 * num_experts)))))))


def grouped_swiglu(rows, group_sizes, w_gate, w_up, w_down, impl="auto"):
  """SwiGLU of expert-sorted rows [M, d], rows of group e through expert e's weights -> [M, d].

  "ragged": three `jax.lax.ragged_dot` grouped matmuls (TPU and GPU have kernels for it). "tiled": the
  rows scattered into tiles of one expert each (`tile_layout`) and multiplied tile by tile with the
  tile's expert weights, one batched matmul: XLA:CPU lowers ragged_dot as a masked dense product over
  all E experts (E times the work), this does ~1.25x the active work. "auto": tiled on CPU, else ragged,
  for the backend traced for (a plan for a TPU slice, compiled on a CPU host, gets ragged).
  """
  if impl == "auto":
    impl = "tiled" if kernel_backend() == "cpu" else "ragged"
  if impl == "ragged":
    h = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes)) * jax.lax.ragged_dot(rows, w_up, group_sizes)
    return jax.lax.ragged_dot(h, w_down, group_sizes)
  m, d = rows.shape
  tile = default_tile(m, w_gate.shape[0])
  slot, tile_expert = tile_layout(group_sizes, m, tile)
  tiles = jnp.zeros(((tile_expert.shape[0]) * tile, d), rows.dtype).at[slot].set(rows, unique_indices=True)
  tiles = tiles.reshape(-1, tile, d)                                      # [T, tile, d]
  mm = lambda a, w: jnp.einsum("tmi,tio->tmo", a, w[tile_expert])
  h = jax.nn.silu(mm(tiles, w_gate)) * mm(tiles, w_up)
  return mm(h, w_down).reshape(-1, d)[slot]


def sparse_swiglu(x, experts, weights, w_gate, w_up, w_down, capacity=0, impl="auto"):
  """The dropless sparse SwiGLU MLP: sum_i g_i SwiGLU_{e_i}(x) over each token's k experts (DeepSeek-V3 Eq. 12's routed part).

  x [N, d], experts [N, k], weights [N, k], w_gate / w_up [E, d, f], w_down [E, f, d]. The N*k pairs are
  sorted by expert, the rows gathered, each expert's rows multiplied by its weights in one grouped matmul
  (`grouped_swiglu`), and the outputs unsorted and summed with their weights. With `capacity` > 0 an
  expert keeps its first `capacity` pairs (earlier tokens first, as Switch) and the rest are dropped
  (contribute 0). Returns (y [N, d], dropped fraction of the N*k pairs).
  """
  n, k = experts.shape
  order, group_sizes = sort_by_expert(experts, w_gate.shape[0])
  out = grouped_swiglu(x[order // k], group_sizes, w_gate, w_up, w_down, impl)   # [N*k, d], sorted by expert
  dropped = jnp.zeros((), jnp.float32)
  if capacity:
    starts = jnp.cumsum(group_sizes) - group_sizes                        # first sorted row of each expert
    sorted_experts = experts.reshape(-1)[order]
    rank = jnp.arange(n * k, dtype=jnp.int32) - starts[sorted_experts]   # row within its expert's group
    keep = rank < capacity
    out = jnp.where(keep[:, None], out, jnp.zeros((), out.dtype))
    dropped = 1.0 - jnp.mean(keep.astype(jnp.float32))
  unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to (token, slot) order
  y = jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1), weights.astype(out.dtype))
  return y, dropped


def bias_update(bias, load, rate):
  """Auxiliary-loss-free balancing (DeepSeek-V3 Sec. 2.1.2): b_e += rate * sign(mean load - load_e)."""
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load).astype(bias.dtype)


def sparse_layers(num_layers, every, first_dense):
  """Which layers have a sparse MLP [num_layers] (bools): i >= first_dense and (i - first_dense) % every == 0."""
  return tuple(i >= first_dense and (i - first_dense) % every == 0 for i in range(num_layers))
