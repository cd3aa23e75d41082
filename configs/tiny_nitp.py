"""Tiny NITP run (docs/aux.md): configs/tiny.py with Next Implicit Token Prediction on.

`add_nitp(c)` and `add_mtp(c)` turn the auxiliary objectives on in any config derived from
configs/tiny.py (every recipe here is), e.g. `add_mtp(tiny_ncp.get_config())` for NCP + MTP;
on the command line, `--config.nitp.enabled=True` / `--config.mtp.enabled=True` do the same.
"""
import tiny  # configs load with their own folder on sys.path


def add_nitp(c, weight=1.0):
  """NITP with the paper's choices: cosine to sg(z_{t+1}), SwiGLU projector, ~20%-depth target."""
  c.nitp.enabled = True
  c.nitp.weight = weight
  return c


def add_mtp(c, weight=0.3):
  """One DeepSeek-V3 MTP block predicting token t+2, sharing the LM head."""
  c.mtp.enabled = True
  c.mtp.weight = weight
  return c


def get_config():
  return add_nitp(tiny.get_config())
