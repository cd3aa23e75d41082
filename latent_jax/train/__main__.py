"""python -m latent_jax.train --config configs/tiny.py [--config.a.b=v ...] --workdir DIR

Trains a new run in DIR, or resumes the one there from its latest checkpoint."""
from latent_jax import cli
from latent_jax.config import load_config
from latent_jax.train.loop import NonFiniteLoss, train

FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the run's folder: created, or resumed from")]


def main(argv=None):
  with cli.errors(NonFiniteLoss):
    args = cli.parse(__doc__, FLAGS, argv)
    train(load_config(args.config, args.overrides), args.workdir)


if __name__ == "__main__":
  main()
