"""Load params, config and tokenizer from a training workdir or from an export folder.

A training workdir holds `checkpoints/STEP/{params,...}` with the config in each checkpoint's
metadata and `tokenizer.model` (or `tokenizer.json`) beside them; an export folder (`python -m latent_jax.export`)
holds `params/`, `config.json` and the same tokenizer file.
"""
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from latent_jax import distributed, paths
from latent_jax.config import config_from_json
from latent_jax.data.tokenizer import Tokenizer, find_tokenizer
from latent_jax.train import checkpoint
from latent_jax.nn import abstract_model

READ_ATTEMPTS = 10  # reads of a newest step that a training removed meanwhile, before giving up


def is_export(directory):
  return paths.path(os.path.join(directory, "config.json")).is_file() and paths.path(os.path.join(directory, "params")).is_dir()


def find_checkpoint(directory, step=None):
  """(manager, step) of the given or newest checkpoint: regular ones, or a TST phase-1 result."""
  managers = [checkpoint.Checkpoints(directory, subdir=sub, read_only=True) for sub in ("checkpoints", "phase1")
              if paths.path(os.path.join(directory, sub)).is_dir()]
  found = [(s, m) for m in managers for s in m.manager.all_steps() if step is None or s == step]
  if not found:
    what = f"no checkpoint at step {step}" if step else "no checkpoints"
    raise FileNotFoundError(f"--workdir {directory!r} has {what} and is not an export folder; "
                            f"train first (python -m latent_jax.train ... --workdir {directory}).")
  step, manager = max(found, key=lambda x: x[0])
  return manager, step


def read_newest(directory, step, read):
  """read(step) for the given step, or, when `step` is None, for the workdir's newest checkpoint.

  A training saving into the workdir meanwhile removes its older steps (train.keep_checkpoints),
  maybe the one being read; what that raises depends on which file went first (KeyError,
  FileNotFoundError, ValueError or a bare Exception from Orbax). So a failed read is judged by the
  listing, not by its type: when the newest step has changed since it was chosen, the newest is read instead; a
  step that is still the newest failed for another reason (damage), raised as it is. A step given
  by number, an export folder and a multi-host reader (whose processes would each choose their own
  step) read once.
  """
  if step is not None or is_export(directory) or jax.process_count() > 1:
    return read(step)
  for _ in range(READ_ATTEMPTS):
    _, chosen = find_checkpoint(directory)
    try:
      return read(chosen)
    except Exception as e:  # pylint: disable=broad-except  # judged by the listing below, else raised
      if find_checkpoint(directory)[1] == chosen:
        raise
      last = f"{type(e).__name__}: {e}"
  raise FileNotFoundError(f"--workdir {directory!r}: the training saving there removed the newest checkpoint while "
                          f"it was being read, {READ_ATTEMPTS} times in a row (last: {last[:300]}); read it once the "
                          "training has finished, or train with a larger train.keep_checkpoints.")


def load_config(directory, step=None):
  """(config, step) of a workdir's latest (or given) checkpoint, or of an export folder. A workdir's
  lost or damaged tokenizer file is restored from its checkpoints first (checkpoint.restore_tokenizer)."""
  if is_export(directory):
    return config_from_json(json.loads(paths.path(os.path.join(directory, "config.json")).read_text())), None
  manager, step = find_checkpoint(directory, step)
  checkpoint.restore_tokenizer(directory)
  return config_from_json(manager.restore_meta(step)["config"]), step


def saved_params(directory, cfg, step=None, shardings=None):
  """Every parameter the checkpoint (or export) holds, training-only heads included; placed by
  `shardings` ({"a/b/c": sharding}) where given, else replicated on every device here: whatever
  mesh and number of processes saved them."""
  _, saved = abstract_model(cfg)
  shardings = shardings or {}
  everywhere = NamedSharding(Mesh(jax.devices(), ("devices",)), P())
  target = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings.get(path_name(p), everywhere)),
      nnx.to_pure_dict(saved))
  if is_export(directory):
    read = lambda: checkpoint.read_item(os.path.join(directory, "params"), ocp.args.StandardRestore(target))
  else:
    manager, step = find_checkpoint(directory, step)
    read = lambda: manager.restore_params(step, target)
  return distributed.on_all("load params", read, "those hosts read a damaged part of them, or see the shared file "
                            "system differently (a stale or missing mount); check them.")


def load_params(directory, cfg, step=None, shardings=None):
  """(graphdef, params) of the inference model: training-only heads (NITP, MTP) are dropped;
  `shardings` as saved_params takes them."""
  params = saved_params(directory, cfg, step, shardings)
  graphdef, abstract = abstract_model(cfg.model)
  return graphdef, keep_like(params, nnx.to_pure_dict(abstract))


def check_init_from(directory, cfg, params, step=None):
  """(source config, step) of train.init_from = `directory` (its newest checkpoint, or `step`),
  once every parameter of `params` (this run's, arrays or abstract) is known to be there with its
  shape: anything but a training-only head (NITP, MTP) that the source lacks means the models
  differ, an error."""
  if not (is_export(directory) or any(paths.path(os.path.join(directory, sub)).is_dir() for sub in ("checkpoints", "phase1"))):
    raise FileNotFoundError(f"train.init_from: {directory!r} is neither a training workdir with checkpoints nor "
                            "an export folder; give a run's --workdir or a `python -m latent_jax.export` folder.")
  source_cfg, step = load_config(directory, step)
  source = by_path(nnx.to_pure_dict(abstract_model(source_cfg)[1]))
  inference = by_path(nnx.to_pure_dict(abstract_model(cfg.model)[1]))
  for name, x in by_path(params).items():
    if name not in source and name in inference:
      raise ValueError(f"train.init_from: {directory} has no parameter {name!r}; its model config differs from "
                       f"this run's (source model.name={source_cfg.model.name!r}); start from a run of the same model.")
    if name in source and source[name].shape != x.shape:
      raise ValueError(f"train.init_from: parameter {name!r} is {source[name].shape} in {directory} but {x.shape} "
                       "here; the model configs differ, copy the source's model section.")
  return source_cfg, step


def initial_params(directory, cfg, fresh):
  """The params a run starts from with train.init_from = `directory`: each of `fresh` (this run's
  initialised params) replaced by the source's, in fresh's dtype and sharding, except
  training-only heads the source was trained without, which keep their fresh init."""
  placed = {name: x.sharding for name, x in by_path(fresh).items()}

  def read(step):  # the source may be a run still training
    source_cfg, step = check_init_from(directory, cfg, fresh, step)
    return by_path(saved_params(directory, source_cfg, step, placed))
  source = read_newest(directory, None, read)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: source[path_name(p)].astype(x.dtype) if path_name(p) in source else x, fresh)


def path_name(path):
  return "/".join(str(k.key) for k in path)


def by_path(tree):
  """{"a/b/c": leaf} of a nested dict."""
  return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def keep_like(tree, like):
  """The entries of the nested dict `tree` whose keys the nested dict `like` has."""
  return {k: keep_like(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def inference_config(cfg):
  """A copy of cfg that builds no training-only heads (what an export's params hold)."""
  cfg = cfg.copy_and_resolve_references()
  for section in ("nitp", "mtp"):
    if section in cfg:
      cfg[section].enabled = False
  return cfg


def write_beside(out, cfg, tokenizer):
  """An export folder's config.json and tokenizer file (tokenizer.model / .json), next to its params/."""
  paths.path(os.path.join(out, "config.json")).write_text(json.dumps(checkpoint.config_to_json(cfg), indent=2))
  paths.path(os.path.join(out, tokenizer.filename)).write_bytes(tokenizer.proto)


def load_tokenizer(directory, cfg):
  path = find_tokenizer(directory) or cfg.data.tokenizer
  if not path or not paths.path(path).is_file():
    raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {directory!r} and data.tokenizer="
                            f"{cfg.data.tokenizer!r} is not a file; copy the run's tokenizer file there.")
  return Tokenizer(path)


def load_model(directory, step=None):
  """(model, config, tokenizer) from a workdir (its newest checkpoint, or `step`) or an export folder."""
  def read(step):
    cfg, step = load_config(directory, step)
    return cfg, load_params(directory, cfg, step)
  cfg, (graphdef, params) = read_newest(directory, step, read)
  return nnx.merge(graphdef, params), cfg, load_tokenizer(directory, cfg)
