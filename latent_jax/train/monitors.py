"""The monitors' probe (train.monitors): per-layer attention statistics at log steps.

A separate jitted forward pass of the model (no LM head, no backward) on PROBE_ROWS rows of the
step's batch with the current params, in which every attention layer records the per-head
statistics of its q and k (`Attention.monitor`, `latent_jax.ops.monitors.qk_stats`). Run only
at log steps, it costs about rows / batch of a forward pass per log_every steps
(docs/performance.md, "Monitors"). The gradient and update norms per group come from the train
step's twin that the loop runs at log steps (`make_train_step(..., monitors=True)`).

Also the sigmoid router's bias per sparse layer (`router_bias_metrics`, model.moe), read from the params at
log steps (with or without train.monitors) by a small jitted function of its own.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax import sharding
from latent_jax.nn.lora import adapt
from latent_jax.ops import monitors as M

PROBE_ROWS = 2  # rows of each probed batch (rounded up to a multiple of the batch's shards)


def probe_rows(batch_size, mesh, rows=PROBE_ROWS):
  """How many rows the probe reads: `rows`, rounded up to a multiple of the batch shards, at most the batch."""
  shards = sharding.batch_shards(mesh)
  return min(batch_size, -(-rows // shards) * shards)


def attention_metrics(model, batch):
  """Run `model` (monitor set) on a batch {inputs, segment_ids, positions} -> {metric name: value}, from every
  stack's qk_stats (ops/monitors.py, layer_metrics; ConceptLM's layers named after their module)."""
  model(batch["inputs"], batch["segment_ids"], batch["positions"], logits=False)
  out = {}
  for path, stats in nnx.to_flat_state(nnx.pop(model, nnx.Intermediate)):
    if path[-1] == "qk_stats" and len(path) == 2:  # a stack's: blocks/qk_stats, encoder/qk_stats, ...
      out.update(M.layer_metrics(stats.get_value(), "" if path[0] == "blocks" else f"{path[0]}/"))
  return out


def make_probe(graphdef, cfg, shardings, mesh, rows=PROBE_ROWS, compile_for=None):
  """probe(params, batch) -> {name: float}: the per-layer attention metrics (M.layer_metrics) on `rows` rows of a
  global train batch, evenly spaced so that each batch shard gives its share. `shardings`: the train state's."""
  n = probe_rows(cfg.data.batch_size, mesh, rows)
  stride = cfg.data.batch_size // n

  def probe(params, batch):
    with sharding.use_mesh(mesh):
      model = nnx.merge(graphdef, adapt(params, cfg))  # LoRA: W + A B, as the step computes with
      # A forward pass only: no recomputation policy (ConceptLM's IRC stacks would drop the statistics under one).
      model.set_attributes(monitor=True, remat="none", raise_if_not_found=False)
      rows_ = {k: batch[k][::stride][:n] for k in ("inputs", "segment_ids", "positions")}
      return attention_metrics(model, rows_)

  jitted = jax.jit(probe, in_shardings=(shardings["params"], sharding.batch_sharding(mesh)),
                   out_shardings=sharding.replicated(mesh))
  if compile_for is not None:  # (abstract params, batch shapes): compiled now, out of the first rows' throughput
    jitted = jitted.lower(*compile_for).compile()
  return lambda params, batch: {k: float(v) for k, v in jax.device_get(jitted(params, batch)).items()}


MOE_MODULES = ("blocks", "encoder", "concept", "decoder")  # the stacks in the forward's order (aux["moe"]'s)


def router_bias_metrics(params):
  """{router_bias_spread/i: max - min over the experts of sparse layer i's router_bias} (model.moe.router=sigmoid;
  {} otherwise), layers numbered as moe_load_max/i: the baseline's sparse layers, ConceptLM's encoder, concept
  module and decoder in order. Only the spread selects experts (top_k of s + b ignores a shift of b)."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if keys[-1] == "router_bias" and keys[0] in MOE_MODULES:
      found.append((MOE_MODULES.index(keys[0]), leaf.reshape(-1, leaf.shape[-1])))  # [layers, E]
  if not found:
    return {}
  bias = jnp.concatenate([b for _, b in sorted(found, key=lambda f: f[0])]).astype(jnp.float32)
  spread = jnp.max(bias, axis=-1) - jnp.min(bias, axis=-1)
  return {f"router_bias_spread/{i}": spread[i] for i in range(bias.shape[0])}


def make_router_bias_metrics(param_shardings, mesh):
  """params -> {name: float} of router_bias_metrics, jitted (the loop calls it at log steps of a sigmoid-router MoE)."""
  jitted = jax.jit(router_bias_metrics, in_shardings=(param_shardings,), out_shardings=sharding.replicated(mesh))
  return lambda params: {k: float(v) for k, v in jax.device_get(jitted(params)).items()}
