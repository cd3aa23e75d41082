"""python -m latent_jax.evaluate --workdir DIR --tasks T1,T2 [--include_path DIR] [--limit=N]
   [--num_fewshot=N] [--batch_size=8] [--max_length=N] [--step=N] [--output FILE]

lm-evaluation-harness tasks (lm_eval.simple_evaluate) on a run's latest (or --step) checkpoint or
an export folder, BaselineLM or ConceptLM, through the harness model `latent_jax`
(latent_jax/harness.py); prints the harness's results table, and --output writes its results as
JSON. --include_path adds a folder of your own task YAML files. Needs the eval extra:
pip install -e '.[eval]'. The harness's own CLI with this model, and the recipe for local tasks
offline, are in docs/interop.md.
"""
import json
import os

from latent_jax import checkpoint, cli

FLAGS = [
    cli.Flag("workdir", str, cli.REQUIRED, "a run's workdir or an export folder"), cli.STEP,
    cli.Flag("tasks", str, cli.REQUIRED, "comma-separated harness task names (or glob patterns)"),
    cli.Flag("include_path", str, None, "a folder of task YAML files to add to the harness's own"),
    cli.Flag("limit", int, None, "score only the first N examples of each task", lambda n: n >= 1, ">= 1"),
    cli.Flag("num_fewshot", int, None, "few-shot examples per prompt; default: each task's own", lambda n: n >= 0,
             ">= 0"),
    cli.Flag("batch_size", int, 8, "rows per batch (rounded up to a multiple of the devices)", lambda n: n >= 1, ">= 1"),
    cli.Flag("max_length", int, None, "tokens per window; default: the run's data.seq_len", lambda n: n >= 2, ">= 2"),
    cli.Flag("output", str, None, "a JSON file to write the results to"),
]


def import_harness():
  """latent_jax.harness, which imports lm_eval: an optional extra."""
  try:
    from latent_jax import harness  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError(f"lm-evaluation-harness is not installed ({e}); pip install -e '.[eval]'.") from None
  return harness


def task_names(tasks):
  names = [t.strip() for t in tasks.split(",") if t.strip()]
  if not names:
    raise ValueError(f"--tasks={tasks!r} names no task; give names such as --tasks=arc_easy,hellaswag.")
  return names


def check_tasks(names, task_manager):
  for name in names:
    if not task_manager.match_tasks([name]):
      raise ValueError(f"--tasks: no task {name!r}; list them with `lm-eval ls tasks`, and give a folder of your "
                       "own task YAML files with --include_path.")


def evaluate(args):
  harness = import_harness()
  import lm_eval  # pylint: disable=import-outside-toplevel  # installed: harness imported it
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
  if args.include_path and not os.path.isdir(args.include_path):
    raise NotADirectoryError(f"--include_path {args.include_path} is not a folder; give the folder of your task "
                             "YAML files.")
  if args.output:
    cli.writable_dir(os.path.dirname(os.path.abspath(args.output)), "--output's folder")
  tasks = task_names(args.tasks)
  checkpoint.load_config(args.workdir, args.step)  # a workdir without checkpoints, before the harness indexes its tasks
  task_manager = TaskManager(include_path=args.include_path)
  check_tasks(tasks, task_manager)  # before the model loads
  model = harness.LatentJaxLM(args.workdir, args.step, args.batch_size, args.max_length)
  results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                    task_manager=task_manager, log_samples=False)
  print(make_table(results))
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2, default=str)
  return results


def main(argv=None):
  with cli.errors():
    evaluate(cli.parse(__doc__, FLAGS, argv))


if __name__ == "__main__":
  main()
