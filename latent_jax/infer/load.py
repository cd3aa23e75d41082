"""Load params, config and tokenizer from a training workdir or from an export folder.

A training workdir holds `checkpoints/STEP/{params,...}` with the config in each checkpoint's
metadata and `tokenizer.model` beside them; an export folder (`python -m latent_jax.export`)
holds `params/`, `config.json` and `tokenizer.model`.
"""
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from latent_jax.data.tokenizer import Tokenizer
from latent_jax.train import checkpoint
from latent_jax.train import step as steps


def is_export(directory):
  return os.path.isfile(os.path.join(directory, "config.json")) and os.path.isdir(os.path.join(directory, "params"))


def find_checkpoint(directory, step=None):
  """(manager, step) of the given or newest checkpoint: regular ones, or a TST phase-1 result."""
  managers = [checkpoint.Checkpoints(directory, subdir=sub) for sub in ("checkpoints", "phase1")
              if os.path.isdir(os.path.join(directory, sub))]
  found = [(s, m) for m in managers for s in m.manager.all_steps() if step is None or s == step]
  if not found:
    what = f"no checkpoint at step {step}" if step else "no checkpoints"
    raise FileNotFoundError(f"--workdir {directory!r} has {what} and is not an export folder; "
                            f"train first (python -m latent_jax.train ... --workdir {directory}).")
  step, manager = max(found, key=lambda x: x[0])
  return manager, step


def load_config(directory, step=None):
  """(config, step) of a workdir's latest (or given) checkpoint, or of an export folder."""
  if is_export(directory):
    with open(os.path.join(directory, "config.json")) as f:
      return checkpoint.config_from_json(json.load(f)), None
  manager, step = find_checkpoint(directory, step)
  return checkpoint.config_from_json(manager.restore_meta(step)["config"]), step


def load_params(directory, cfg, step=None):
  """(graphdef, params) of the inference model: training-only heads (NITP, MTP) are dropped."""
  _, saved = steps.abstract_model(cfg)  # what the checkpoint holds, heads included
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(saved))
  if is_export(directory):
    params = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(directory, "params")), target)
  else:
    manager, step = find_checkpoint(directory, step)
    params = manager.restore_params(step, target)
  graphdef, abstract = steps.abstract_model(cfg.model)
  return graphdef, keep_like(params, nnx.to_pure_dict(abstract))


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


def load_tokenizer(directory, cfg):
  path = os.path.join(directory, "tokenizer.model")
  if not os.path.isfile(path):
    path = cfg.data.tokenizer
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer.model in {directory!r} and data.tokenizer={cfg.data.tokenizer!r} "
                            "is not a file; copy the run's tokenizer.model there.")
  return Tokenizer(path)


def load_model(directory, step=None):
  """(model, config, tokenizer) from a workdir or an export folder."""
  cfg, step = load_config(directory, step)
  graphdef, params = load_params(directory, cfg, step)
  return nnx.merge(graphdef, params), cfg, load_tokenizer(directory, cfg)
