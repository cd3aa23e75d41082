"""Models: `build_model(model_config, rngs)` picks the architecture named by `model.name`."""
from latent_jax.nn.baseline import BaselineLM, ModelOutput
from latent_jax.nn.concept import ConceptLM


def build_model(cfg, rngs):
  """Build the model that `cfg.model.name` names (pass `cfg.model`)."""
  if cfg.name == "baseline":
    return BaselineLM(cfg, rngs)
  if cfg.name == "concept":
    return ConceptLM(cfg, rngs)
  raise ValueError(f"model.name={cfg.name!r} is not a known model; use 'baseline' or 'concept'.")
