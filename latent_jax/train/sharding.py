"""The device mesh (data, fsdp, tensor) and one rules table from logical axis names to it."""
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from latent_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. The batch spreads over data and fsdp; fsdp also splits the
# model dimension of every matrix, tensor splits heads, MLP width and vocabulary.
RULES = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "mtp_concat": None,  # MTP's [2d, d] input projection: its output dim takes fsdp as "embed"
}


def mesh_shape(mesh_cfg, num_devices):
  """(data, fsdp, tensor) sizes with -1 filled in; an error if they do not use the devices."""
  sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"mesh: data*fsdp*tensor without the -1 entry is {known}, which does not divide the "
                        f"{num_devices} devices; choose sizes whose product divides {num_devices}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(f"mesh: data*fsdp*tensor = {'*'.join(map(str, sizes))} = {math.prod(sizes)}, but there are "
                      f"{num_devices} devices; make the product {num_devices} or set one entry to -1.")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None):
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_cfg, len(devices))
  # Auto axes: Explicit axes (the make_mesh default) break the embedding gather.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


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


def check_batch(batch_size, mesh, microbatches):
  """Each of the train.microbatches splits of a batch must divide over the data*fsdp mesh shards."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % shards:
    raise ConfigError(f"data.batch_size={batch_size} does not divide over data*fsdp={shards} mesh shards; "
                      f"use a multiple of {shards}.")
  if batch_size % (microbatches * shards):
    raise ConfigError(f"data.batch_size={batch_size} in train.microbatches={microbatches} microbatches of "
                      f"{batch_size // microbatches} rows does not divide over data*fsdp={shards} mesh shards; "
                      f"use a batch size that is a multiple of {microbatches * shards}, or fewer microbatches.")


def global_batch(local, mesh):
  """Assemble this host's numpy batch rows into one global array sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)
