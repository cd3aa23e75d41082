"""latent_jax: latent-space pretraining objectives (NCP, NITP, TST) and an OLMo-3-style baseline."""
from latent_jax.config import ConfigError, load_config
from latent_jax.nn import ModelOutput, build_model

__all__ = ["ConfigError", "ModelOutput", "build_model", "load_config"]
