"""python -m latent_jax.eval --workdir DIR [--step=N] [--batches=N] [--tasks FILE[,FILE...]] [--[no]val]
   [--lm_eval_tasks T1,T2 [--include_path DIR] [--limit=N] [--num_fewshot=N] [--output FILE]]
   [--batch_size=8] [--max_length=N]

One evaluation command, for the latest (or a named) checkpoint of a workdir or an export folder,
BaselineLM or ConceptLM; it prints one JSON line. For ConceptLM it adds, on the same validation batches,
ncp_loss and vq_loss and the codebook's health (code_usage, code_usage_min, code_perplexity, dead_codes).

Validation loss (nats/token) and bits per byte on the held-out split of the run's data: the split and
tokenizer are rebuilt from the saved config exactly as in training, and by default the same batches
are scored as the training's own validation (its train.eval_batches); --batches=0 scores the whole
split. The JSON line says what was covered: `batches` of `split_batches`, and the scored `tokens`.
With --tasks or --lm_eval_tasks the run's data is optional: a model imported (convert --hf) or exported
without it is judged on the task files alone, and when its data.source is not at hand (no such file, or
less than one batch of it) validation is left out (`"val_loss": null`) with one line on stderr saying
why. --val requires validation (bad data is then an error, as without tasks); --noval skips it.

On an export folder the JSON line's `step` is the training step it was exported from (export.json,
written by export), or "export" where that is not known (an import, an older export), and `source`
says what the folder is.

--tasks: capability proxies on local JSONL task files (latent_jax/proxies.py; python -m latent_jax.tasks
writes the shipped sets), adding proxy/C/nll, proxy/S/nll, proxy/C/bpb and, for multiple choice,
proxy/C/acc, proxy/C/acc_norm and proxy/C/margin: the names training logs with train.eval_tasks.

--lm_eval_tasks: lm-evaluation-harness tasks (lm_eval.simple_evaluate, through the harness model
`latent_jax`, latent_jax/harness.py), adding lm_eval/TASK/METRIC; the harness's table goes to stderr
and --output writes its results as JSON. --include_path adds a folder of your own task YAML files.
Needs the eval extra: pip install -e '.[eval]' (docs/interop.md).
"""
import json
import math
import os
import sys

from flax import nnx

from latent_jax import cli, distributed, proxies, sharding
from latent_jax.data import build_data, make_val_batches
from latent_jax.data.pipeline import val_batch_count
from latent_jax.nn import abstract_model
from latent_jax import checkpoint
from latent_jax.train import step as steps
from latent_jax.infer import load


def validation_data(cfg, directory, val):
  """(Data, None) for validation, or (None, why it is left out). val: True = required (a data error is
  raised), None = when the run's data is at hand, False = never."""
  if val is False:
    return None, "--noval"
  try:
    return build_data(cfg, directory), None
  except (ValueError, OSError) as e:
    if val:
      raise
    return None, " ".join(str(e).splitlines())


def describe_source(directory, step):
  """(the JSON line's step, its source: None for a workdir) of what was read."""
  if not checkpoint.is_export(directory):
    return step, None
  origin = load.read_origin(directory)
  if origin.get("workdir") is not None:
    return origin.get("step", "export"), f"export of {origin['workdir']} at step {origin.get('step')}"
  if origin.get("hf"):
    return "export", f"import of the Hugging Face checkpoint {origin['hf']} (convert --hf)"
  return "export", "export folder (the step it was exported from is not recorded)"


def evaluate_dir(directory, step=None, max_batches=None, tasks=(), rows=8, max_length=None, val=True):
  """max_batches: None = the run's train.eval_batches (what its training validated on), 0 = all.
  tasks: proxy task files, scored `rows` at a time in rows of `max_length` tokens (data.seq_len).
  val: True = validate (the run's data must be at hand), None = when it is at hand (else left out, with
  a line on stderr saying why), False = not."""
  examples = proxies.read_tasks(tasks, "--tasks") if tasks else None  # checked before anything loads
  def read(step):  # the checkpoint first: a training may remove it while the data is built
    saved, step = checkpoint.load_config(directory, step)
    cfg = load.inference_config(saved)  # the inference model's loss (a drafter run's: its frozen target's)
    mesh = sharding.inference_mesh(cfg.mesh)  # the training's layout, where the devices here allow it
    _, abstract = abstract_model(cfg.model)
    param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    return cfg, step, mesh, param_shardings, load.load_params(directory, saved, step, checkpoint.by_path(param_shardings))
  cfg, step, mesh, param_shardings, (graphdef, params) = checkpoint.read_newest(directory, step, read)
  data, why = validation_data(cfg, directory, val)
  shown, source = describe_source(directory, step)
  result = {"step": shown, **({"source": source} if source else {})}
  if data is None:
    if why != "--noval" and distributed.is_primary():
      print(f"eval: validation loss left out, the run's data is not at hand ({why.removesuffix('.')}); the task "
            "scores need none (--val requires it)", file=sys.stderr, flush=True)
    result["val_loss"] = None
    tokenizer = checkpoint.load_tokenizer(directory, cfg)
  else:
    tokenizer = data.tokenizer
    max_batches = cfg.train.eval_batches if max_batches is None else max_batches
    split_batches = val_batch_count(len(data.val_tokens), cfg.data.seq_len, cfg.data.batch_size)
    batches = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, max_batches,
                               sharding.process_rows(cfg.data.batch_size, mesh))
    eval_step = steps.make_eval_step(graphdef, cfg, param_shardings, mesh, tokenizer.token_bytes)
    scores = steps.evaluate(eval_step, params, batches, mesh, cfg.data.batch_size)
    tokens = scores.pop("val_tokens")
    result.update(scores, batches=len(batches), split_batches=split_batches, tokens=tokens)
    if cfg.model.name == "concept":  # its own terms and codebook health on the same batches, as training logs them
      terms_step = steps.make_terms_step(graphdef, cfg, param_shardings, mesh)
      result.update(steps.evaluate_terms(terms_step, params, batches, mesh, cfg.data.batch_size))
  if examples:
    scorer = proxies.Proxies(examples, "--tasks", tokenizer, graphdef, param_shardings, mesh, rows,
                             max_length or cfg.data.seq_len)
    result.update(scorer(params))
  return result


# ----------------------------------------------------------------------------- lm-evaluation-harness


def import_harness():
  """latent_jax.harness, which imports lm_eval: an optional extra."""
  try:
    from latent_jax import harness  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError(f"--lm_eval_tasks: lm-evaluation-harness is not installed ({e}); "
                     "pip install -e '.[eval]'.") from None
  return harness


def lm_eval_names(tasks):
  names = [t.strip() for t in tasks.split(",") if t.strip()]
  if not names:
    raise ValueError(f"--lm_eval_tasks={tasks!r} names no task; give names such as --lm_eval_tasks=arc_easy,hellaswag.")
  return names


def check_lm_eval(args):
  """Everything the harness needs, checked before a model loads -> (harness, task manager, task names)."""
  harness = import_harness()
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel  # installed: harness imported it
  if args.include_path and not os.path.isdir(args.include_path):
    raise NotADirectoryError(f"--include_path {args.include_path} is not a folder; give the folder of your task "
                             "YAML files.")
  if args.output:
    cli.writable_dir(os.path.dirname(os.path.abspath(args.output)), "--output's folder")
  names = lm_eval_names(args.lm_eval_tasks)
  checkpoint.load_config(args.workdir, args.step)  # a workdir without checkpoints, before the harness indexes its tasks
  task_manager = TaskManager(include_path=args.include_path)
  for name in names:
    if not task_manager.match_tasks([name]):
      raise ValueError(f"--lm_eval_tasks: no task {name!r}; list them with `lm-eval ls tasks`, and give a folder of "
                       "your own task YAML files with --include_path.")
  return harness, task_manager, names


def run_lm_eval(args, step, harness, task_manager, names):
  """The harness's results as lm_eval/TASK/METRIC (METRIC,FILTER for a filter other than none); the table
  to stderr, the whole results to --output."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
  model = harness.LatentJaxLM(args.workdir, step, args.batch_size, args.max_length)
  results = lm_eval.simple_evaluate(model=model, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit,
                                    task_manager=task_manager, log_samples=False)
  print(make_table(results), file=sys.stderr)
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2, default=str)
  flat = {}
  for task, metrics in results["results"].items():
    for key, value in metrics.items():
      metric, _, kind = key.partition(",")
      if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        flat[f"lm_eval/{task}/{metric if kind in ('', 'none') else key}"] = value
  return flat


FLAGS = [
    cli.Flag("workdir", str, cli.REQUIRED, "a run's workdir or an export folder"), cli.STEP,
    cli.Flag("batches", int, None, "validation batches to score; 0 = the whole split; default: the run's "
             "train.eval_batches, as its training scored", lambda n: n >= 0, ">= 0"),
    cli.Flag("tasks", str, None, "proxy task files (JSONL), comma-separated: python -m latent_jax.tasks writes the "
             "shipped sets"),
    cli.Flag("lm_eval_tasks", str, None, "comma-separated lm-evaluation-harness task names (or glob patterns); "
             "the eval extra"),
    cli.Flag("include_path", str, None, "lm-eval: a folder of task YAML files to add to the harness's own"),
    cli.Flag("limit", int, None, "lm-eval: score only the first N examples of each task", lambda n: n >= 1, ">= 1"),
    cli.Flag("num_fewshot", int, None, "lm-eval: few-shot examples per prompt; default: each task's own",
             lambda n: n >= 0, ">= 0"),
    cli.Flag("batch_size", int, 8, "proxy and lm-eval rows per batch (rounded up to a multiple of the devices)",
             lambda n: n >= 1, ">= 1"),
    cli.Flag("max_length", int, None, "proxy and lm-eval tokens per row; default: the run's data.seq_len",
             lambda n: n >= 2, ">= 2"),
    cli.Flag("output", str, None, "lm-eval: a JSON file to write the harness's results to"),
    cli.Flag("val", bool, None, "validation loss on the run's data: --val requires it, --noval skips it; default: "
             "always without task flags, and with --tasks or --lm_eval_tasks when the run's data is at hand"),
] + cli.DISTRIBUTED


def evaluate(args):
  """The JSON line's object: validation, --tasks' proxies, --lm_eval_tasks' scores."""
  tasks = proxies.task_files(args.tasks, "--tasks") if args.tasks is not None else []
  setup = check_lm_eval(args) if args.lm_eval_tasks is not None else None
  judged = bool(tasks) or setup is not None
  if args.val is False and not judged:
    raise ValueError("--noval with neither --tasks nor --lm_eval_tasks leaves nothing to evaluate; drop --noval, "
                     "or give task files.")
  val = args.val if args.val is not None else (None if judged else True)
  result = evaluate_dir(args.workdir, args.step, args.batches, tasks, args.batch_size, args.max_length, val)
  if setup:  # the checkpoint just read (an export folder has none)
    result.update(run_lm_eval(args, None if checkpoint.is_export(args.workdir) else result["step"], *setup))
  return result


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    result = evaluate(args)
    if distributed.is_primary():  # every host computed the same result
      print(json.dumps(result))


if __name__ == "__main__":
  main()
