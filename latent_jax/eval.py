"""python -m latent_jax.eval --workdir DIR [--step=N] [--batches=N]

Validation loss (nats/token) and bits per byte on the held-out split of the run's data, for the
latest (or a named) checkpoint of a workdir, or for an export folder. The split and tokenizer are
rebuilt from the saved config exactly as in training, and by default the same batches are scored
as the training's own validation (its train.eval_batches); --batches=0 scores the whole split.
The JSON line says what was covered: `batches` of `split_batches`, and the scored `tokens`.
"""
import json

from flax import nnx

from latent_jax import cli, distributed, sharding
from latent_jax.data import build_data, make_val_batches
from latent_jax.data.pipeline import val_batch_count
from latent_jax.nn import abstract_model
from latent_jax import checkpoint
from latent_jax.train import step as steps
from latent_jax.infer import load


def evaluate_dir(directory, step=None, max_batches=None):
  """max_batches: None = the run's train.eval_batches (what its training validated on), 0 = all."""
  def read(step):  # the checkpoint first: a training may remove it while the data is built
    saved, step = checkpoint.load_config(directory, step)
    cfg = load.inference_config(saved)  # the inference model's loss (a drafter run's: its frozen target's)
    mesh = sharding.inference_mesh(cfg.mesh)  # the training's layout, where the devices here allow it
    _, abstract = abstract_model(cfg.model)
    param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    return cfg, step, mesh, param_shardings, load.load_params(directory, saved, step, checkpoint.by_path(param_shardings))
  cfg, step, mesh, param_shardings, (graphdef, params) = checkpoint.read_newest(directory, step, read)
  data = build_data(cfg, directory)
  max_batches = cfg.train.eval_batches if max_batches is None else max_batches
  split_batches = val_batch_count(len(data.val_tokens), cfg.data.seq_len, cfg.data.batch_size)
  batches = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, max_batches,
                             sharding.process_rows(cfg.data.batch_size, mesh))
  eval_step = steps.make_eval_step(graphdef, cfg, param_shardings, mesh, data.tokenizer.token_bytes)
  result = steps.evaluate(eval_step, params, batches, mesh, cfg.data.batch_size)
  tokens = result.pop("val_tokens")
  return {"step": step, **result, "batches": len(batches), "split_batches": split_batches, "tokens": tokens}


FLAGS = [cli.Flag("workdir", str, cli.REQUIRED, "a run's workdir or an export folder"), cli.STEP,
         cli.Flag("batches", int, None, "validation batches to score; 0 = the whole split; default: the run's "
                  "train.eval_batches, as its training scored", lambda n: n >= 0, ">= 0")] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    result = evaluate_dir(args.workdir, args.step, args.batches)
    if distributed.is_primary():  # every host computed the same result
      print(json.dumps(result))


if __name__ == "__main__":
  main()
