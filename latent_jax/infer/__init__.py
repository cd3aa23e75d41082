"""Inference: load a trained or exported model, and sample from it with a KV cache."""
from latent_jax.infer.load import load_model
from latent_jax.infer.sample import generate, sample_token
