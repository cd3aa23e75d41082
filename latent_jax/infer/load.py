"""Load the inference model, its config and tokenizer from a training workdir or from an export
folder (latent_jax/checkpoint.py reads both), and write an export folder's files.
"""
import json
import os

import ml_collections
from flax import nnx

from latent_jax import paths
from latent_jax.nn import abstract_model
from latent_jax import checkpoint


def load_params(directory, cfg, step=None, shardings=None):
  """(graphdef, params) of the inference model: training-only heads (NITP, MTP, a drafter) are dropped;
  `shardings` as checkpoint.saved_params takes them."""
  params = checkpoint.saved_params(directory, cfg, step, shardings)
  graphdef, abstract = abstract_model(cfg.model)
  return graphdef, keep_like(params, nnx.to_pure_dict(abstract))


def keep_like(tree, like):
  """The entries of the nested dict `tree` whose keys the nested dict `like` has."""
  return {k: keep_like(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def inference_config(cfg):
  """A copy of cfg that builds no training-only heads and no LoRA factors (what an export's params hold): a
  drafter run's is its frozen target's."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # unlocked: a section may go
  for section in ("nitp", "mtp", "lora"):  # LoRA: the params read hold the adapters merged (saved_params)
    if section in cfg:
      cfg[section].enabled = False
  if "drafter" in cfg:
    del cfg["drafter"]
  return cfg


ORIGIN = "export.json"  # where an export folder came from: {"workdir": DIR, "step": N} or {"hf": HF_DIR}


def write_beside(out, cfg, tokenizer, origin=None):
  """An export folder's config.json and tokenizer file (tokenizer.model / .json), next to its params/, and
  export.json (`origin`: what it was made from, which eval names)."""
  paths.path(os.path.join(out, "config.json")).write_text(json.dumps(checkpoint.config_to_json(cfg), indent=2))
  paths.path(os.path.join(out, tokenizer.filename)).write_bytes(tokenizer.proto)
  if origin is not None:
    paths.path(os.path.join(out, ORIGIN)).write_text(json.dumps(origin, indent=2))


def read_origin(directory):
  """An export folder's export.json ({} when it has none: written before it existed, or unreadable)."""
  try:
    origin = json.loads(paths.path(os.path.join(directory, ORIGIN)).read_text())
  except (OSError, ValueError):
    return {}
  return origin if isinstance(origin, dict) else {}


def load_model(directory, step=None):
  """(model, config, tokenizer) from a workdir (its newest checkpoint, or `step`) or an export folder."""
  def read(step):
    cfg, step = checkpoint.load_config(directory, step)
    return cfg, load_params(directory, cfg, step)
  cfg, (graphdef, params) = checkpoint.read_newest(directory, step, read)
  return nnx.merge(graphdef, params), cfg, checkpoint.load_tokenizer(directory, cfg)
