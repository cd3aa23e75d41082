"""python -m latent_jax.ladder plan|run|status|fit|plot --config configs/ladder_NAME.py --workdir DIR

  plan     one line per point (method, N, FLOPs/token, tokens, steps, budget), the total, a wall-time
           estimate from one measured step per shape (--nomeasure skips it), and each point's launch line
  run      trains the points here, one after another; --shard I/N takes every N-th point from the I-th,
           so N jobs split a ladder with no coordinator. Resumable: a recorded point is only read
  status   done / partial / missing, with each point's last validation loss
  fit      IsoFLOP minima, frontiers and compute multipliers over the reference (fit.json, fit.md in
           --out, default the ladder's results folder); --points FILE.csv fits points from anywhere
           (columns method,flops,params,tokens,loss[,seed]) without a ladder config
  plot     isoflop.png and frontier.png in --out (needs matplotlib: pip install -e ".[experiments]")

docs/ladder.md: the FLOPs convention, N, the fits and their assumptions, launching across a cluster.
"""
import glob
import json
import os
import sys

from latent_jax import cli

COMMANDS = ("plan", "run", "status", "fit", "plot")
OPTIONAL_CONFIG = cli.Flag("config", cli.CONFIG.type, None, cli.CONFIG.help)
FLAGS = {
    "plan": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder: one workdir per point"),
             cli.Flag("measure", bool, True, "time one step of each shape for the wall-time estimate")],
    "run": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder: one workdir per point"),
            cli.Flag("shard", str, "", "I/N: train every N-th point from the I-th (0 <= I < N)")],
    "status": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder")],
}
FIT_FLAGS = [OPTIONAL_CONFIG, cli.Flag("workdir", str, "", "the ladder's folder (with --config)"),
             cli.Flag("points", str, "", "a CSV of points to fit instead of a ladder's results"),
             cli.Flag("out", str, "", "folder for the output; default: the ladder's results folder"),
             cli.Flag("reference", str, "", "the reference method; default: the ladder's, or 'baseline'"),
             cli.Flag("bootstrap", int, 100, "bootstrap replicates for the intervals", lambda n: n >= 0, ">= 0")]
FLAGS["fit"] = FLAGS["plot"] = FIT_FLAGS


def ladder_points(args):
  from latent_jax.config import ConfigError, is_ladder
  from latent_jax.ladder import points
  if not is_ladder(args.config):
    raise ConfigError("--config: not a ladder config (it lists no methods and budgets); start from "
                      "configs/ladder_cpu.py.")
  return points.ladder_points(args.config)


def fit_inputs(args):
  """(points as dicts, the reference, the output folder, notes) for fit and plot."""
  from latent_jax.ladder import fit
  if args.points:
    if args.config is not None:
      raise ValueError("--points and --config: give one, a CSV of points or a ladder config.")
    if not os.path.isfile(args.points):
      raise FileNotFoundError(f"--points {args.points}: no such file; give a CSV with columns method,flops,params,tokens,loss.")
    return fit.read_points(args.points), args.reference or "baseline", args.out or os.path.dirname(
        os.path.abspath(args.points)), {"source": args.points}
  if args.config is None or not args.workdir:
    raise ValueError("fit and plot need --config and --workdir (a ladder), or --points FILE.csv.")
  from latent_jax.ladder.run import results_dir
  ladder = args.config
  # The recorded results alone (no store, no training code): a ladder fits on any machine its results reach.
  rows = []
  for path in sorted(glob.glob(os.path.join(results_dir(ladder, args.workdir), "points", "*.json"))):
    with open(path) as f:
      rows.append(json.load(f))
  done = [r for r in rows if r["status"] == "done" and r["method"] in ladder.methods]
  if not done:
    raise ValueError(f"no finished points yet in {results_dir(ladder, args.workdir)}; run the ladder first "
                     "(python -m latent_jax.ladder run ...).")
  pts = [{"method": r["method"], "flops": r["flops"], "params": r["params"], "tokens": r["tokens"],
          "loss": r["val_loss"], "seed": r["seed"], "budget": r["budget"]} for r in done]
  convention = ("training FLOPs with the LM head's matmul" if ladder.count_lm_head else
                "training FLOPs without the LM head's matmul (NCP's C = F_tok x D)")
  notes = {"flops": convention, "params": "non-embedding parameters of the inference model",
           "loss": "validation loss, nats/token, the whole held-out split of " + ladder.data,
           "points": f"{len(done)} finished points recorded"}
  return pts, args.reference or ladder.reference, args.out or results_dir(ladder, args.workdir), notes


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  with cli.errors():
    if not argv or argv[0] not in COMMANDS:
      if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0)
      raise ValueError(f"give a subcommand first: one of {', '.join(COMMANDS)} (see --help).")
    command, rest = argv[0], argv[1:]
    args = cli.parse(__doc__, FLAGS[command], rest)
    if command in ("fit", "plot"):
      from latent_jax.ladder import fit
      pts, reference, out, notes = fit_inputs(args)
      result = fit.fit_ladder(pts, reference=reference, n_boot=args.bootstrap, notes=notes)
      if command == "fit":
        fit.write_fit(result, out)
        print(fit.table(result))
        print(f"wrote {os.path.join(out, 'fit.json')} and {os.path.join(out, 'fit.md')}")
      else:
        from latent_jax.ladder.plot import plot_ladder
        for path in plot_ladder(pts, result, out):
          print(f"wrote {path}")
      return
    points = ladder_points(args)
    if command == "plan":
      from latent_jax.ladder.plan import plan
      plan(args.config, args.workdir, points, measure=args.measure)
    elif command == "run":
      from latent_jax.ladder.points import shard
      from latent_jax.ladder.run import run
      left = run(args.config, args.workdir, shard(points, args.shard))
      raise SystemExit(1 if left else 0)
    else:
      from latent_jax.ladder.status import status
      status(args.config, args.workdir, points)


if __name__ == "__main__":
  main()
