"""LoRA (Hu et al. 2021) for any model, its scanned stacks included, as a parameter transform (docs/lora.md).

Each weight W [..., in, out] that `lora.targets` names (a regex over whole parameter paths, as
optim.trainable) gets two factors beside it in its module, NAME_lora_a [..., in, r] and
NAME_lora_b [..., r, out] (nnx.LoRAParam), with W's leading axes: a stacked weight's layer axis
too, so the layer scan slices them as it slices W. The model then reads W + alpha / r * A @ B:
the train step builds it from `adapt(params, cfg)`, and every reader of a checkpoint merges the
factors into W and drops them (checkpoint.saved_params), so export, eval, generate, convert and
train.init_from see a plain model. B starts at zero: at step 0 the model is its source, bitwise.
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from latent_jax.config import ConfigError, lora_enabled
from latent_jax.nn.concept import VQ_PARAMS

A, B = "_lora_a", "_lora_b"  # the factors of weight NAME are NAME_lora_a and NAME_lora_b
LORA_PARAMS = r".*_lora_[ab]"  # optim.trainable="lora": the factors alone


def lora_merge(w, a, b, scale):
  """Hu et al. 2021 Eq. 3 as a weight: W + scale * A @ B, w [..., in, out], a [..., in, r], b [..., r, out]."""
  delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def apply_lora(params, alpha, merge=lora_merge):
  """`params` (nested dicts) with each weight that has factors beside it replaced by merge(W, A, B, alpha / r)."""
  if not isinstance(params, dict):
    return params
  out = {}
  for key, value in params.items():
    if isinstance(key, str) and key + A in params:
      a, b = params[key + A], params[key + B]
      out[key] = merge(value, a, b, alpha / a.shape[-1])
    else:
      out[key] = apply_lora(value, alpha, merge)
  return out


def without_factors(tree):
  """The nested dict `tree` without its LoRA factors: what the plain model holds."""
  if not isinstance(tree, dict):
    return tree
  return {k: without_factors(v) for k, v in tree.items() if not (isinstance(k, str) and k.endswith((A, B)))}


def adapt(params, cfg):
  """The params the training model of `cfg` (the whole config) computes with: with lora.enabled each
  adapted weight is W + alpha / r * A @ B (the factors stay: its graph holds them)."""
  return apply_lora(params, cfg.lora.alpha) if lora_enabled(cfg) else params


def lora_targets(model, regex):
  """{path: (parent module, attribute name, nnx.Param)} of the weights of 2 or more dims that `regex` matches."""
  pattern, found, nodes = re.compile(regex), {}, dict(nnx.iter_graph(model))
  for path, node in nodes.items():
    name = "/".join(map(str, path))
    if isinstance(node, nnx.Param) and node[...].ndim >= 2 and pattern.fullmatch(name):
      found[name] = (nodes[path[:-1]], path[-1], node)
  if not found:
    weights = sorted("/".join(map(str, p)) for p, n in nodes.items() if isinstance(n, nnx.Param) and n[...].ndim >= 2)
    raise ConfigError(f"lora.targets: {regex!r} matches no weight (a parameter of 2 or more dims) of this model; it "
                      f"is matched against whole paths such as {', '.join(weights[:8])}, ...")
  return found


def rank_count(shapes):
  """Trainable parameters per unit of rank: sum over weights [..., in, out] of (in + out) * the leading dims."""
  return sum(math.prod(s[:-2]) * (s[-2] + s[-1]) for s in shapes)


def auto_rank(model, shapes):
  """lora.rank='auto': the rank whose trainable count, rank * rank_count(shapes), is nearest VQ adaptation's
  (the params optim.trainable=vq trains, VQ_PARAMS); so within half a rank's count of it."""
  pattern, per_rank = re.compile(VQ_PARAMS), rank_count(shapes)
  vq = sum(int(np.prod(node[...].shape)) for path, node in nnx.iter_graph(model)
           if isinstance(node, nnx.Param) and pattern.fullmatch("/".join(map(str, path))))
  return max(1, round(vq / per_rank))


def add_lora(model, cfg, rngs):
  """Put LoRA factors beside every weight of `model` that cfg.lora.targets names: A ~ N(0, 1/in), B = 0.
  They draw their init after every other parameter, so turning LoRA on leaves the model's own init unchanged."""
  targets = lora_targets(model, cfg.lora.targets)
  shapes = [node[...].shape for _, _, node in targets.values()]
  rank = auto_rank(model, shapes) if cfg.lora.rank == "auto" else cfg.lora.rank
  for name in sorted(targets):
    parent, attr, w = targets[name]
    shape, dtype, axes = w[...].shape, w[...].dtype, tuple(w.get_metadata().get("axes", ()))
    # Logical axes: W's, with "lora" for the rank; a leading unnamed (layer) dim stays unnamed, as W's.
    a_axes, b_axes = ((*axes[:-1], "lora"), (*axes[:-2], "lora", axes[-1])) if len(axes) >= 2 else ((), ())
    a = jax.random.normal(rngs.params(), (*shape[:-1], rank), dtype) / math.sqrt(shape[-2])
    setattr(parent, attr + A, nnx.LoRAParam(a, axes=a_axes))
    setattr(parent, attr + B, nnx.LoRAParam(jnp.zeros((*shape[:-2], rank, shape[-1]), dtype), axes=b_axes))
  return model
