"""The peak FLOP/s that MFU divides by on a device without a data sheet (a CPU): measured once per
machine and kept, so that runs on one machine share one reference."""
import json

import jax.numpy as jnp

from latent_jax.train import flops


def test_the_measured_peak_is_kept(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  calls = []
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype, repeats: calls.append(repeats) or 1.25e11)
  first, source = flops.peak_flops()
  assert first == 1.25e11 and calls == [20] and "kept in" in source
  with open(tmp_path / "latent_jax" / "peak_flops.json") as f:
    [(key, value)] = json.load(f).items()
  assert value == first and flops.processor() in key and "float32" in key
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: 1 / 0)  # not measured again
  assert flops.peak_flops() == (first, source)
  assert flops.peak_flops(3e12) == (3e12, "config")
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype, repeats: 7.0)  # another dtype: its own figure
  assert flops.peak_flops(dtype=jnp.bfloat16)[0] == 7.0

