"""The device mesh (data, fsdp, expert, tensor) and one rules table from logical axis names to it.

Parameters name their axes in `nnx.Param` metadata; activations name theirs where the model
calls `constrain`, which pins them to the mesh of the step being traced (`use_mesh`).
"""
import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from latent_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")
AXIS_TYPES = (AxisType.Auto,) * 4  # Explicit axes (the jax.make_mesh default) break the embedding gather

# Logical axis -> mesh axes. The batch spreads over data, fsdp and expert (as MaxText and DeepSeek
# spread it); fsdp also splits the model dimension of every matrix, expert splits the experts of a
# sparse MLP (model.moe), tensor splits heads, MLP width and vocabulary. An activation keeps its
# model dimension ("act_embed") whole: the batch axes already split its batch.
RULES = {
    "batch": ("data", "fsdp", "expert"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "mtp_concat": None,  # MTP's [2d, d] input projection: its output dim takes fsdp as "embed"
    "act_embed": None,
    "length": None,
    "head_dim": None,
    "lora": None,  # a LoRA factor's rank dim (nn/lora.py): small, replicated
    "expert": "expert",  # model.moe's expert dim: expert parallelism (docs/moe.md, "Expert parallelism")
}


def mesh_sizes(mesh_cfg):
  """The config's sizes in MESH_AXES order (mesh.expert: 1 in configs saved before it)."""
  return [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.get("expert", 1), mesh_cfg.tensor]


def mesh_shape(mesh_cfg, num_devices):
  """(data, fsdp, expert, tensor) sizes with -1 filled in; an error if they do not use the devices."""
  sizes = mesh_sizes(mesh_cfg)
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"mesh: data*fsdp*expert*tensor without the -1 entry is {known}, which does not divide the "
                        f"{num_devices} devices; choose sizes whose product divides {num_devices}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(f"mesh: data*fsdp*expert*tensor = {'*'.join(map(str, sizes))} = {math.prod(sizes)}, but there are "
                      f"{num_devices} devices; make the product {num_devices} or set one entry to -1.")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None):
  """The (data, fsdp, expert, tensor) mesh. With mesh.slices = S > 1 the sizes are those of one slice
  and the data axis runs S times over them: slice s holds data rows s*data .. (s+1)*data - 1, so only
  the data-parallel gradient reduction crosses slices (DCN); fsdp, expert and tensor stay on ICI."""
  devices = jax.devices() if devices is None else devices
  slices = mesh_cfg.get("slices", 1)
  if len(devices) % slices:
    raise ConfigError(f"mesh.slices={slices} does not divide the {len(devices)} devices; use the number of slices "
                      "the job runs on.")
  shape = mesh_shape(mesh_cfg, len(devices) // slices)
  if slices == 1:
    return jax.make_mesh(shape, MESH_AXES, axis_types=AXIS_TYPES, devices=devices)
  # Each slice laid out by jax for its interconnect, the slices stacked along data.
  grids = [mesh_utils.create_device_mesh(shape, group) for group in slice_groups(devices, slices)]
  return jax.sharding.Mesh(np.concatenate(grids, axis=0), MESH_AXES, axis_types=AXIS_TYPES)


def inference_mesh(mesh_cfg, devices=None):
  """The mesh that eval, generate and export read a trained model on: the training's sizes (one
  slice's) where they fit the devices here, so parameters are split as the training split them;
  else fsdp over all of them, so that no device holds all of what the training sharded."""
  devices = jax.devices() if devices is None else devices
  try:
    shape = mesh_shape(mesh_cfg, len(devices))
  except ConfigError:
    shape = (1, len(devices), 1, 1)
  return jax.make_mesh(shape, MESH_AXES, axis_types=AXIS_TYPES, devices=devices)


def slice_groups(devices, slices):
  """The devices of each slice: TPU slices (slice_index), else runs of processes (hosts: GPU nodes,
  or CPU hosts standing in for slices), else equal runs of devices (one process's fake devices,
  for plans and tests)."""
  for key in ("slice_index", "process_index"):
    ids = sorted({getattr(d, key, 0) for d in devices})
    if len(ids) == 1:
      continue
    if len(ids) % slices:
      raise ConfigError(f"mesh.slices={slices} does not divide the {len(ids)} "
                        f"{'TPU slices' if key == 'slice_index' else 'processes'} of the job; use a divisor of {len(ids)}.")
    per = len(ids) // slices
    return [[d for d in devices if ids.index(getattr(d, key, 0)) // per == s] for s in range(slices)]
  size = len(devices) // slices
  return [list(devices[i * size:(i + 1) * size]) for i in range(slices)]


def logical_spec(axes, shape, mesh):
  """PartitionSpec for an array whose trailing dims are named `axes`; a leading unnamed
  (stacked-layer) dim and any dim the mesh axes do not divide stay replicated."""
  spec = [None] * (len(shape) - len(axes))
  used = set()
  for name, size in zip(axes, shape[len(shape) - len(axes):]):
    mesh_axes = RULES.get(name)
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
    if mesh_axes and size % math.prod(mesh.shape[a] for a in mesh_axes) == 0:
      used.update(mesh_axes)
      spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    else:
      spec.append(None)
  return P(*spec)


def use_mesh(mesh):
  """Context in which `constrain` shards activations over `mesh`; enter it inside the traced step."""
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def constrain(x, axes):
  """x with its trailing dims named `axes` sharded by RULES over the mesh in context (`use_mesh`).

  A no-op outside one (single-device calls, decoding); dims the mesh does not divide (a batch
  of 1) stay replicated, as in `logical_spec`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))


def per_batch_shard(fn, rows, *whole):
  """fn(rows, *whole) with each device taking its own batch shard of `rows` (arrays whose
  leading dim is the batch; so are fn's outputs): shard_map over the batch mesh axes in context.

  For what GSPMD cannot split by itself (a Pallas kernel, a scan over token chunks); `whole`
  arrives complete on the batch axes and its gradient sums over the shards. Just fn(rows,
  *whole) without a mesh or when the rows do not divide over the shards.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(a for a in RULES["batch"] if mesh.shape[a] > 1)
  if not axes or jax.tree.leaves(rows)[0].shape[0] % math.prod(mesh.shape[a] for a in axes):
    return fn(rows, *whole)
  # check_vma=False: the custom VJPs inside return shard-varying weight gradients for whole
  # (invariant) inputs, which shard_map's transpose then sums. Axes of size 1 are manual too: a
  # Mosaic (TPU Pallas) kernel lowers only where no axis is left to automatic partitioning.
  manual = set(axes) | {a for a in mesh.axis_names if mesh.shape[a] == 1}
  return jax.shard_map(fn, in_specs=(P(axes),) + (P(),) * len(whole), out_specs=P(axes),
                       axis_names=manual, check_vma=False)(rows, *whole)


def per_head_shard(fn, rows, head_dims, *whole):
  """fn(rows, *whole) with each device taking its own heads of its own batch shard: attention
  (q, k, v, segment ids, positions), whose heads are independent. The dim `head_dims[i]` of
  `rows[i]` (None: it has none) is split over the heads' mesh axis where every such dim divides
  (GQA groups then stay whole on a device: query head h reads K/V head h // (H/K)), else those
  arrays arrive whole on that axis and its devices compute every head alike. fn's output is split as
  rows[0]. Every mesh axis is manual: a Mosaic kernel cannot be partitioned automatically, so
  per_batch_shard, which leaves the tensor axis to XLA, fails to lower with mesh.tensor > 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1:  # one device: nothing to split
    return fn(rows, *whole)
  batch = tuple(a for a in RULES["batch"] if mesh.shape[a] > 1)
  if rows[0].shape[0] % math.prod(mesh.shape[a] for a in batch):
    batch = ()  # rows that do not divide: every device of a batch shard runs all of them
  heads = RULES["heads"]
  split = mesh.shape[heads] > 1 and all(x.shape[d] % mesh.shape[heads] == 0 for x, d in zip(rows, head_dims)
                                        if d is not None)

  def spec(x, dim):
    names = [batch or None] + [None] * (x.ndim - 1)
    if split and dim is not None:
      names[dim] = heads
    return P(*names)

  specs = tuple(spec(x, d) for x, d in zip(rows, head_dims))
  # check_vma=False as in per_batch_shard: the kernels' custom VJPs return shard-varying gradients.
  return jax.shard_map(fn, in_specs=(specs,) + (P(),) * len(whole), out_specs=specs[0],
                       axis_names=set(mesh.axis_names), check_vma=False)(rows, *whole)


def state_shardings(state, mesh):
  """NamedSharding for every leaf of an nnx.State, from each Variable's `axes` metadata."""
  def one(var):
    axes = var.get_metadata().get("axes", ())
    return var.replace(NamedSharding(mesh, logical_spec(axes, var.shape, mesh)))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh):
  return NamedSharding(mesh, P(RULES["batch"]))


def microbatch_sharding(mesh):
  """A batch split into microbatches [k, B/k, ...]: each microbatch's rows spread as a batch's."""
  return NamedSharding(mesh, P(None, RULES["batch"]))


def replicated(mesh):
  return NamedSharding(mesh, P())


def batch_shards(mesh):
  """How many shards a batch is split into: the product of the batch's mesh axes (data*fsdp*expert)."""
  return math.prod(mesh.shape[a] for a in RULES["batch"])


def check_batch(batch_size, mesh, microbatches):
  """Each of the train.microbatches splits of a batch must divide over the data*fsdp*expert mesh shards."""
  shards = batch_shards(mesh)
  if batch_size % shards:
    raise ConfigError(f"data.batch_size={batch_size} does not divide over data*fsdp*expert={shards} mesh shards; "
                      f"use a multiple of {shards}.")
  if batch_size % (microbatches * shards):
    raise ConfigError(f"data.batch_size={batch_size} in train.microbatches={microbatches} microbatches of "
                      f"{batch_size // microbatches} rows does not divide over data*fsdp*expert={shards} mesh shards; "
                      f"use a batch size that is a multiple of {microbatches * shards}, or fewer microbatches.")


def check_experts(model_cfg, mesh):
  """model.moe.num_experts must divide over the expert mesh axis (mesh.expert), which splits the experts."""
  size = mesh.shape["expert"]
  if size > 1 and "moe" in model_cfg and model_cfg.moe.enabled and model_cfg.moe.num_experts % size:
    raise ConfigError(f"model.moe.num_experts={model_cfg.moe.num_experts} does not divide over mesh.expert={size} "
                      f"devices, which split the experts; use a mesh.expert that divides {model_cfg.moe.num_experts} "
                      f"or a multiple of {size} experts.")


def process_rows(batch_size, mesh):
  """The rows of a global batch that this process's devices hold (sorted indices): what it reads.

  Contiguous blocks per device under the batch sharding; a process whose devices hold replicas
  (a tensor axis across processes) reads the same rows as the others in its replica group."""
  indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size,)).values()
  return np.unique(np.concatenate([np.arange(batch_size)[i[0]] for i in indices]))


def global_batch(local, mesh, batch_size=None):
  """Assemble this host's numpy batch rows (`process_rows`, in order) into one global array of
  `batch_size` rows (default: the local rows, all of them) sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  shape = lambda x: (batch_size or x.shape[0], *x.shape[1:])
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), shape(x)), local)
