"""python -m latent_jax.train --config configs/tiny.py [--config.a.b=v ...] --workdir DIR

Trains a new run in DIR, or resumes the one there from its latest checkpoint (README: "What can
go wrong" says what a resume checks, and what --allow_data_change lets through)."""
from latent_jax import cli, distributed
from latent_jax.train.loop import NonFiniteLoss, train
from latent_jax.train.workdir import WorkdirBusy

FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the run's folder: created, or resumed from"),
         cli.Flag("allow_data_change", bool, False, "resume although data.* or train.seed differ from the checkpoint's")] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors(NonFiniteLoss, WorkdirBusy):
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    train(args.config, args.workdir, args.allow_data_change)


if __name__ == "__main__":
  main()
