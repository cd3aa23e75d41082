"""Models: `build_model(config, rngs)` picks the architecture named by `model.name`."""
from latent_jax.nn.auxiliary import add_heads
from latent_jax.nn.baseline import BaselineLM, ModelOutput
from latent_jax.nn.concept import ConceptLM


def build_model(cfg, rngs):
  """Build the model that `model.name` names.

  Pass `cfg.model` for the inference model, or the whole config for the training model, which
  adds the training-only heads its `nitp` / `mtp` sections enable (docs/aux.md).
  """
  whole = cfg if "model" in cfg else None
  m = whole.model if whole else cfg
  if m.name not in ("baseline", "concept"):
    raise ValueError(f"model.name={m.name!r} is not a known model; use 'baseline' or 'concept'.")
  model = (BaselineLM if m.name == "baseline" else ConceptLM)(m, rngs)
  return add_heads(model, whole, rngs) if whole else model
