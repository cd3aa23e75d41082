"""python -m latent_jax.train --config configs/tiny.py [--config.a.b=v ...] --workdir DIR

Trains a new run in DIR, or resumes the one there from its latest checkpoint (README: "What can
go wrong" says what a resume checks, and what --allow_data_change lets through).

A config's fields: `--print_config` prints every field with its value (after the --config.a.b=v
overrides) and exits; configs/tiny.py lists them with a comment each. The multi-host flags
(--coordinator_address, --num_processes, --process_id) matter only when launching several
processes (docs/launch.md)."""
from latent_jax import cli, distributed
from latent_jax.train.loop import NonFiniteLoss, train
from latent_jax.train.workdir import WorkdirBusy

FLAGS = [cli.CONFIG, cli.Flag("workdir", str, None, "the run's folder: created, or resumed from (required)"),
         cli.Flag("allow_data_change", bool, False, "resume although data.* or train.seed differ from the checkpoint's"),
         cli.Flag("print_config", bool, False, "print the config's fields and values (with the overrides) and exit; "
                  "--workdir may then be omitted")] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors(NonFiniteLoss, WorkdirBusy):
    args = cli.parse(__doc__, FLAGS, argv)
    if args.print_config:
      print(args.config)
      return
    if args.workdir is None:
      raise ValueError("missing --workdir (see --help).")
    distributed.initialize(args)
    train(args.config, args.workdir, args.allow_data_change)


if __name__ == "__main__":
  main()
