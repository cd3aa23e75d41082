"""python -m latent_jax.ladder plan|tune|run|status|fit|plot --config configs/ladder_NAME.py --workdir DIR

  plan     one line per point planned so far (method, N, FLOPs/token, tokens, steps, batch, lr, budget),
           the total, a wall-time estimate from one measured step per shape (--nomeasure skips it), and
           each point's launch line; works from recorded results without the token store (no estimate)
  tune     trains the learning-rate sweep (tune.*) and prints each method's factor (RESULTS/tune.md)
  run      the tune, then the ladder's points, one after another; the plan grows as results land (sizes
           widen until each IsoFLOP minimum is bracketed). --shard I/N takes the points whose name
           hashes to I, so N jobs split a ladder with no coordinator (run `tune --shard` first, and
           run again once all have ended: the others' results may add points); --after_point CMD runs a shell
           command after each recorded point (LADDER_POINT, LADDER_RESULT set), e.g. to commit it.
           Resumable: a recorded point is only read
  status   done / partial / missing, with each point's last validation loss (from recorded results and
           the workdir; no token store needed)
  fit      raw IsoFLOP minima with paired seed differences, then each method's pooled compute multiplier
           over the reference, under both FLOPs conventions (fit.json, fit.md in --out, default the
           workdir); --points FILE.csv fits points from anywhere (columns method,flops,params,tokens,loss
           [,seed,budget,lm_head_flops]) without a ladder config
  plot     isoflop.png and frontier.png in --out (needs matplotlib: pip install -e ".[experiments]")

docs/ladder.md: the FLOPs convention, N, the fits and their assumptions, launching across a cluster.
"""
import glob
import json
import os
import sys

from latent_jax import cli

COMMANDS = ("plan", "tune", "run", "status", "fit", "plot")
OPTIONAL_CONFIG = cli.Flag("config", cli.CONFIG.type, None, cli.CONFIG.help)
FLAGS = {
    "plan": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder: one workdir per point"),
             cli.Flag("measure", bool, True, "time one step of each shape for the wall-time estimate")],
    "tune": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder: one workdir per point"),
             cli.Flag("shard", str, "", "I/N: train the points whose name hashes to I (0 <= I < N)")],
    "run": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder: one workdir per point"),
            cli.Flag("shard", str, "", "I/N: train the points whose name hashes to I (0 <= I < N)"),
            cli.Flag("after_point", str, "", "a shell command run after each recorded point (LADDER_POINT, LADDER_RESULT)")],
    "status": [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the ladder's folder")],
}
FIT_FLAGS = [OPTIONAL_CONFIG, cli.Flag("workdir", str, "", "the ladder's folder (with --config)"),
             cli.Flag("points", str, "", "a CSV of points to fit instead of a ladder's results"),
             cli.Flag("out", str, "", "folder for the output; default: the workdir (with --points: the CSV's folder)"),
             cli.Flag("reference", str, "", "the reference method; default: the ladder's, or 'baseline'"),
             cli.Flag("bootstrap", int, 1000, "bootstrap replicates for the intervals", lambda n: n >= 0, ">= 0")]
FLAGS["fit"] = FLAGS["plot"] = FIT_FLAGS


def ladder_points(args, store_required):
  """(points, notes) planned from the recorded results (points.ladder_points)."""
  from latent_jax.config import ConfigError, is_ladder
  from latent_jax.ladder import points
  from latent_jax.ladder.run import results_dir
  if not is_ladder(args.config):
    raise ConfigError("--config: not a ladder config (it lists no methods and budgets); start from "
                      "configs/ladder_cpu.py.")
  recorded = points.read_results(results_dir(args.config, args.workdir))
  return points.ladder_points(args.config, recorded, store_required=store_required)


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
  # flops with the LM head, whichever convention set the budgets; both conventions are fitted from them.
  pts = [{"method": r["method"], "flops": r["flops"] + (0 if ladder.count_lm_head else r["lm_head_flops"]),
          "lm_head_flops": r["lm_head_flops"], "params": r.get("active_params", r.get("params")), "tokens": r["tokens"], "loss": r["val_loss"],
          "seed": r["seed"], "budget": r["budget"]} for r in done]
  r = ladder.rule
  notes = {"budgets": "set " + ("with" if ladder.count_lm_head else "without") + " the LM head's FLOPs",
           "settings": (f"batch (tokens ~ N^{r.batch_exponent:.3g}), warmup ({r.warmup_tokens_per_param:g} x N tokens) "
                        f"and base learning rate (~ N^{r.lr_exponent:.3g}) keyed on {ladder.reference}'s N at each size; "
                        "each method's learning rate times its tuned factor (tune.md); Adam's beta2 "
                        f"{r.beta2} below {r.beta2_below_batch_tokens:,}-token batches"),
           "params": "non-embedding parameters of the inference model",
           "loss": "validation loss, nats/token, the whole held-out split of " + ladder.data,
           "points": f"{len(done)} finished points recorded"}
  return pts, args.reference or ladder.reference, args.out or args.workdir, notes


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
      if command == "plot":
        try:
          import matplotlib  # noqa: F401  (before the fit: a missing extra is one line, not a traceback)
        except ImportError:
          raise ValueError('plot needs matplotlib: pip install -e ".[experiments]"') from None
      pts, reference, out, notes = fit_inputs(args)
      result = fit.fit_ladder(pts, reference=reference, n_boot=args.bootstrap, notes=notes)
      if command == "fit":
        fit.write_fit(result, out)
        print(fit.table(result))
        print(f"wrote {os.path.join(out, 'fit.json')} and {os.path.join(out, 'fit.md')}")
      else:
        from latent_jax.ladder.plot import plot_ladder
        for line in plot_ladder(pts, result, out):
          print(line)
      return
    if command in ("tune", "run"):
      from latent_jax.ladder.run import run
      from latent_jax.ladder.status import write_tune
      ladder_points(args, store_required=True)  # every error of the plan before anything trains
      left = run(args.config, args.workdir, args.shard, after=getattr(args, "after_point", ""),
                 stages=("tune",) if command == "tune" else ("tune", "ladder"))
      write_tune(args.config, args.workdir)
      raise SystemExit(1 if left else 0)
    points, notes = ladder_points(args, store_required=False)
    if command == "plan":
      from latent_jax.ladder.plan import plan
      plan(args.config, args.workdir, points, notes, measure=args.measure)
    else:
      from latent_jax.ladder.status import status
      status(args.config, args.workdir, points, notes)


if __name__ == "__main__":
  main()
