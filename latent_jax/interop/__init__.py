"""Hugging Face interop (`python -m latent_jax.convert`, docs/interop.md): the OLMo-3 name map and
config translation (olmo3), safetensors read and written a tensor at a time (safetensors_stream),
and the conversions both ways (hf). Needs no torch; the tests compare against transformers
(`pip install -e ".[hf]"`)."""
