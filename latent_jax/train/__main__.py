"""python -m latent_jax.train --config configs/tiny.py [--config.a.b=v ...] --workdir DIR"""
import sys

from latent_jax.config import ConfigError, load_config, parse_cli
from latent_jax.train.loop import NonFiniteLoss, train


def main(argv):
  path, overrides, flags = parse_cli(argv)
  if path is None or "workdir" not in flags:
    raise SystemExit(__doc__)
  try:
    train(load_config(path, overrides), flags["workdir"])
  except (ConfigError, NonFiniteLoss) as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  main(sys.argv[1:])
