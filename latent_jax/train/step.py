"""The train state, its shardings, and the jitted train and eval steps.

The state is a plain pytree {"params", "opt_state", "step"}; the model is rebuilt inside the
step from its graph definition (`nnx.merge`), which keeps the jitted function pure and fast.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from latent_jax import sharding
from latent_jax.config import moe_enabled, trainable_setting
from latent_jax.data import FEATURES
from latent_jax.nn import build_model
from latent_jax.nn.lora import adapt
from latent_jax import objectives
from latent_jax.ops.moe import bias_update
from latent_jax.ops.monitors import monitor_metrics
from latent_jax.train.optim import trainable_mask, skipped_steps


def state_shardings(abstract_params, tx, mesh):
  """NamedShardings of {"params", "opt_state", "step"}: optimiser moments follow their params.

  An optimiser-state leaf shares the sharding of the parameter whose dict path ends its own
  path and whose shape it has (optax nests moments under its own wrappers); others replicate.
  """
  params = nnx.to_pure_dict(sharding.state_shardings(abstract_params, mesh))
  shapes = nnx.to_pure_dict(abstract_params)
  by_path = {tuple(path): (s, shapes_leaf.shape) for (path, s), shapes_leaf in
             zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shapes))}

  def follow(path, leaf):
    for start in range(len(path)):
      hit = by_path.get(tuple(path[start:]))
      if hit and hit[1] == leaf.shape:
        return hit[0]
    return sharding.replicated(mesh)

  opt = jax.tree_util.tree_map_with_path(follow, jax.eval_shape(tx.init, shapes))
  return {"params": params, "opt_state": opt, "step": sharding.replicated(mesh)}


def init_state(cfg, seed, tx, shardings):
  """Initialise params and optimiser state directly into their shardings (jit out_shardings)."""
  def init():
    params = nnx.to_pure_dict(nnx.state(build_model(cfg, nnx.Rngs(seed))))
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
  return jax.jit(init, out_shardings=shardings)()


def abstract_state(cfg, tx, shardings):
  """The train state as ShapeDtypeStructs on `shardings`: to restore into and to compile for, allocating nothing."""
  shapes = jax.eval_shape(lambda: init_state(cfg, cfg.train.seed, tx, shardings))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def batch_shapes(batch_size, seq_len, mesh):
  """A train batch as ShapeDtypeStructs: every feature [batch_size, seq_len] int32, split over the batch axes."""
  row = jax.ShapeDtypeStruct((batch_size, seq_len), np.int32, sharding=sharding.batch_sharding(mesh))
  return {k: row for k in FEATURES}


def make_train_step(graphdef, tx, cfg, shardings, mesh, objective=objectives.lm_objective, monitors=False):
  """The jitted step: gradients of `objective` summed over cfg.train.microbatches splits of the batch's
  rows (one after another, so activations take the memory of one), then one optimiser update. With
  `monitors`, its metrics also hold the gradient and update norms per parameter group (train.monitors:
  the loop runs this twin at log steps only, so that the other steps pay nothing for them)."""
  trains = trainable_mask(shardings["params"], trainable_setting(cfg))
  k = cfg.train.microbatches

  def train_step(state, batch):
    def loss_fn(params, microbatch, counts):
      # Parameters outside optim.trainable are constants here, so XLA computes no weight
      # gradients for them (activation gradients still flow through them).
      params = jax.tree.map(lambda p, train: p if train else jax.lax.stop_gradient(p), params, trains)
      return objective(nnx.merge(graphdef, adapt(params, cfg)), microbatch, cfg, counts)  # LoRA: W + A B

    def accumulate(summed, microbatch):
      (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], microbatch, counts)
      return jax.tree.map(lambda a, b: a + b.astype(a.dtype), summed, (grads, metrics)), None

    # Each microbatch divides its loss terms by the whole batch's counts (objectives.combine), so
    # their sum is the batch's loss. Only the counts (data alone) and shapes of this call are
    # used: jit drops its forward pass.
    with sharding.use_mesh(mesh):  # activations shard like the batch (sharding.constrain)
      _, whole = objective(nnx.merge(graphdef, state["params"]), batch, cfg)
      counts = whole["counts"]
      zero = lambda p, where: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), where)
      zeros = (jax.tree.map(zero, state["params"], shardings["params"]), jax.tree.map(jnp.zeros_like, whole))
      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, split_microbatches(batch, k, mesh))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    loads = grads if moe_enabled(cfg.model) and cfg.model.moe.router == "sigmoid" else None
    if loads is not None:  # the router biases' gradients are expert loads (balance_routers); Adam sees zeros
      grads = jax.tree_util.tree_map_with_path(lambda path, g: jnp.zeros_like(g) if is_router_bias(path) else g, grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    if loads is not None:
      params = balance_routers(params, state["params"], loads, cfg.model.moe.bias_update_rate)
    metrics = objectives.step_metrics(metrics)
    metrics["grad_norm"] = optax.tree.norm(grads)
    if monitors:  # grad_norm/{group}, update_norm/{group}
      metrics.update(monitor_metrics(grads, updates))
    if skipped_steps(opt_state) is not None:  # optim.skip_factor: steps the spike guard did not apply
      metrics["skipped_steps"] = skipped_steps(opt_state)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  return jax.jit(train_step, in_shardings=(shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)


def is_router_bias(path):
  return getattr(path[-1], "key", None) == "router_bias"


def balance_routers(params, old, loads, rate):
  """Auxiliary-loss-free balancing (model.moe.router=sigmoid): each router_bias of `params` moved from its `old`
  value by ops.moe.bias_update. Its gradient in `loads` is its layers' expert load [layers, E] up to a positive
  factor (objectives.moe_terms, the probe term), which the update's sign ignores."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p, b, load: bias_update(b, load, rate) if is_router_bias(path) else p, params, old, loads)


def split_microbatches(batch, k, mesh):
  """Rows [B, ...] -> k microbatches [k, B/k, ...]; microbatch i holds rows i, i+k, i+2k, ..., so that
  every device's rows split evenly over the k and no row moves (sharding.check_batch)."""
  split = lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
  return jax.lax.with_sharding_constraint(jax.tree.map(split, batch), sharding.microbatch_sharding(mesh))


def make_eval_step(graphdef, cfg, param_shardings, mesh, token_bytes):
  """The jitted (summed NLL, scored tokens, their UTF-8 bytes) of one global batch. The bytes
  (`token_bytes`: the tokenizer's bytes per id) are summed on the devices, over the whole batch,
  like the loss: the same figures whatever the number of hosts."""
  table = np.asarray(token_bytes, np.int32)

  def eval_step(params, batch):
    with sharding.use_mesh(mesh):
      nll, labels = objectives.eval_sums(nnx.merge(graphdef, adapt(params, cfg)), batch, cfg)
    scored = jnp.where(labels >= 0, jnp.asarray(table)[jnp.maximum(labels, 0)], 0)
    return nll, jnp.sum(labels >= 0), jnp.sum(scored)
  return jax.jit(eval_step, in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def evaluate(eval_step, params, batches, mesh, batch_size):
  """Mean next-token loss (nats), bits per byte and the scored tokens over `batches` (this host's
  rows of global batches of `batch_size` rows)."""
  nll, count, num_bytes = 0.0, 0, 0
  for b in batches:
    s, n, nb = eval_step(params, sharding.global_batch(b, mesh, batch_size))
    nll, count, num_bytes = nll + float(s), count + int(n), num_bytes + int(nb)
  return {"val_loss": nll / max(count, 1), "val_bpb": nll / math.log(2) / max(num_bytes, 1), "val_tokens": count}


def make_terms_step(graphdef, cfg, param_shardings, mesh):
  """ConceptLM's own terms on one validation batch: (sums and counts of ncp_loss and vq_loss, the code
  histogram), which `eval` reports beside the validation loss (evaluate_terms)."""
  cfg = cfg.copy_and_resolve_references()
  for head in ("nitp", "mtp"):  # the inference model has no training-only heads
    if head in cfg:
      cfg[head].enabled = False

  def terms_step(params, batch):
    with sharding.use_mesh(mesh):
      _, metrics = objectives.ncp_objective(nnx.merge(graphdef, adapt(params, cfg)), batch, cfg)
    counts = metrics["counts"]
    return ({k: metrics[k] * counts[k] for k in TERMS}, {k: counts[k] for k in TERMS}, metrics["code_histogram"])
  return jax.jit(terms_step, in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


TERMS = ("ncp_loss", "vq_loss")


def evaluate_terms(terms_step, params, batches, mesh, batch_size):
  """NCP and VQ losses over `batches` (each term's sum over its count) and the codebook's usage."""
  sums, counts, histogram = {k: 0.0 for k in TERMS}, {k: 0.0 for k in TERMS}, 0
  for b in batches:
    s, n, h = terms_step(params, sharding.global_batch(b, mesh, batch_size))
    for k in TERMS:
      sums[k], counts[k] = sums[k] + float(s[k]), counts[k] + float(n[k])
    histogram = histogram + np.asarray(h)
  usage = {k: float(v) for k, v in objectives.C.codebook_usage(jnp.asarray(histogram)).items()}
  return {**{k: sums[k] / max(counts[k], 1.0) for k in TERMS}, **usage}
