"""Models: `build_model(config, rngs)` picks the architecture named by `model.name`; `abstract_model`
builds one without allocating, and `axes_tree` reads the logical axes of its params."""
from flax import nnx

from latent_jax.config import lora_enabled
from latent_jax.nn.auxiliary import add_heads
from latent_jax.nn.baseline import BaselineLM, ModelOutput
from latent_jax.nn.concept import ConceptLM
from latent_jax.nn.lora import add_lora


def build_model(cfg, rngs):
  """Build the model that `model.name` names.

  Pass `cfg.model` for the inference model, or the whole config for the training model, which
  adds the training-only heads its `nitp` / `mtp` sections enable (docs/aux.md), a drafter run's
  `drafter` (docs/ncp.md) and the LoRA factors of `lora` (docs/lora.md), and takes its attention kernel
  from `kernels.attention` ("auto" otherwise).
  """
  whole = cfg if "model" in cfg else None
  m = whole.model if whole else cfg
  if m.name not in ("baseline", "concept"):
    raise ValueError(f"model.name={m.name!r} is not a known model; use 'baseline' or 'concept'.")
  model = (BaselineLM if m.name == "baseline" else ConceptLM)(m, rngs)
  if not whole:
    return model
  model = add_heads(model, whole, rngs)
  if lora_enabled(whole):
    model = add_lora(model, whole, rngs)
  model.set_attributes(attention_impl=whole.kernels.get("attention", "auto"))
  return model


def axes_tree(state):
  """The logical axes of every parameter, as a dict shaped like `nnx.to_pure_dict(state)`."""
  if isinstance(state, nnx.Variable):
    return tuple(state.get_metadata().get("axes", ()))
  return {k: axes_tree(v) for k, v in state.items()}


def abstract_model(cfg):
  """(graphdef, abstract param state) of the model, allocating nothing (cfg: as build_model takes it)."""
  return nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))
