"""python -m latent_jax.draft --config configs/tiny_drafter.py --workdir DIR [--config.target=RUN] [--config.a.b=v]

Trains a block drafter (latent_jax.nn.drafter) for a frozen trained target, with or without
the NCP paper's concept injection (Sec. 5.3, Eq. 26), through the train loop: the run's config is
the target's with the drafter config's sections laid over it (`run_config`), so it logs,
evaluates, checkpoints and resumes like any training run. Then it measures the drafter on the
target's validation split: its loss and accuracy per block slot, and the mean accepted length
of greedy speculative decoding (MAL, Eq. 27). Writes DIR/drafter.json (the config, the training
curve, the measurements); never overwrites an earlier result.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from latent_jax import checkpoint, cli, distributed, objectives, paths
from latent_jax.config import ConfigError, validate
from latent_jax.data import build_data, make_val_batches
from latent_jax.nn import abstract_model
from latent_jax.ops import drafting as D
from latent_jax.train.loop import train
from latent_jax.train.metrics import read_metrics
from latent_jax.infer.speculative import speculative_generate

OVERLAID = ("data", "train", "optim", "mesh")  # the drafter config's sections that replace the target's fields


def run_config(cfg, target_cfg):
  """The train loop's config of a drafter run: the target's (model, data, kernels), each field of cfg's
  OVERLAID sections replacing the target's, its `drafter` section, the target's params to start from
  (train.init_from) and the drafter alone training (optim.trainable), validated."""
  run = ml_collections.ConfigDict(target_cfg.to_dict())  # unlocked: it gains a drafter section
  # The target's own objectives (the drafter's replaces them) and LoRA (a LoRA target is read merged).
  for section in ("tst", "nitp", "mtp", "lora"):
    if section in run:
      run[section].enabled = False
  for section in OVERLAID:
    run[section].update(cfg[section].to_dict())
  run.drafter = ml_collections.ConfigDict(cfg.drafter.to_dict())
  run.train.init_from = cfg.target
  run.optim.trainable = "drafter/.*"
  return validate(run)


def validation_prompts(data, count, length):
  """The first `length` tokens of up to `count` validation documents that have that many."""
  val = np.asarray(data.val_tokens)  # a token store's is read on demand
  ends = np.flatnonzero(val == data.tokenizer.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1])
  prompts = [val[s:s + length] for s, e in zip(starts, ends) if e - s >= length][:count]
  if not prompts:
    raise ValueError(f"eval.prompt_len={length}: no validation document has that many tokens; lower it.")
  return np.stack(prompts).astype(np.int32)


def measure(model, cfg, e, data):
  """A drafter run's `model` (the target with its trained drafter) on held-out text: the drafter's loss and
  accuracy per block slot (teacher-forced, strided anchors, train.eval_batches batches), and MAL (Eq. 27)
  of greedy speculative decoding from e.prompts validation prompts."""
  seq_len, rows = cfg.data.seq_len, cfg.data.batch_size
  graphdef, params = nnx.split(model)
  anchors = D.strided_anchors(rows, seq_len, cfg.drafter.anchors)
  scores = jax.jit(lambda p, batch: objectives.drafter_scores(nnx.merge(graphdef, p), batch, anchors,
                                                              cfg.drafter.labels))
  total, correct, scored = 0.0, 0, 0
  for batch in make_val_batches(data, seq_len, rows, cfg.train.eval_batches):
    ce, labels, proposals = scores(params, {k: jnp.asarray(v) for k, v in batch.items()})
    mask = labels >= 0
    total += float(jnp.sum(jnp.where(mask, ce, 0)))
    correct = correct + np.asarray(jnp.sum((proposals == labels) & mask, (0, 1)))
    scored = scored + np.asarray(jnp.sum(mask, (0, 1)))
  prompts = validation_prompts(data, e.prompts, e.prompt_len)
  _, committed, rounds = speculative_generate(model, model.drafter, prompts, e.max_new_tokens)
  return {"val_loss": total / max(int(np.sum(scored)), 1), "slot_accuracy": (correct / np.maximum(scored, 1)).round(4).tolist(),
          "mal": float(D.mean_accepted_length(committed, rounds)), "prompts": len(prompts),
          "rounds": int(jnp.sum(rounds)), "committed": int(jnp.sum(committed))}


def run(cfg, workdir):
  """Train (or resume) and measure a drafter for cfg.target; results in WORKDIR/drafter.json -> that dict."""
  if "target" not in cfg:
    raise ConfigError("--config: the draft command takes a drafter config naming its target, such as "
                      "configs/tiny_drafter.py; a training config trains with python -m latent_jax.train.")
  if jax.process_count() > 1:  # the measurement decodes on one host
    raise ValueError("latent_jax.draft trains and measures a small drafter in one process; run it on one host, without "
                     "--num_processes (the target may come from a run on any number of hosts).")
  out = os.path.join(workdir, "drafter.json")
  if paths.path(out).exists():
    raise FileExistsError(f"{out} exists; pick another --workdir (an earlier result is never overwritten).")
  cli.writable_dir(workdir, "--workdir")
  if not (checkpoint.is_export(cfg.target) or checkpoint.has_checkpoints(cfg.target)):
    raise FileNotFoundError(f"target: {cfg.target!r} is neither a training workdir with checkpoints nor an export "
                            "folder; train first, or point --config.target at a trained run's workdir.")
  train_cfg = run_config(cfg, checkpoint.load_config(cfg.target)[0])
  start = time.time()
  train(train_cfg, workdir)
  seconds = time.time() - start
  model, saved_cfg, step = load_run(workdir)
  if step < saved_cfg.train.steps:  # stopped by a signal: the rerun resumes
    print(f"the drafter stopped at step {step}/{saved_cfg.train.steps}; run the same command again to resume.")
    return None
  history = [{k: r[k] for k in ("step", "loss", "val_loss") if k in r} for r in read_metrics(workdir) if "loss" in r]
  result = {"config": cfg.to_dict(), "history": history, "train_seconds": round(seconds, 1),
            **measure(model, saved_cfg, cfg.eval, build_data(saved_cfg, workdir))}
  paths.path(out).write_text(json.dumps(result, indent=1))
  return result


TARGET_FIELDS = ("name", "vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "chunk_size")


def load_run(workdir):
  """(model, config, step) of a drafter run's newest checkpoint: the frozen target with its drafter
  (`model.drafter`); the target's copy is read too, since the checkpoint holds the whole train state."""
  if not checkpoint.has_checkpoints(workdir):
    raise FileNotFoundError(f"{workdir!r} has no drafter checkpoints; train a drafter first "
                            "(python -m latent_jax.draft --config configs/tiny_drafter.py ...).")

  def read(step):
    cfg, step = checkpoint.load_config(workdir, step)
    if "drafter" not in cfg:
      raise ValueError(f"{workdir} holds a training run without a drafter; give a workdir of python -m latent_jax.draft.")
    return cfg, step, checkpoint.saved_params(workdir, cfg, step)
  cfg, step, params = checkpoint.read_newest(workdir, None, read)
  return nnx.merge(abstract_model(cfg)[0], params), cfg, step


def load_drafter(workdir, target_cfg):
  """(drafter, its run's config) from a drafter run's workdir, for a target of model config target_cfg:
  only a drafter trained for a model of the same shape fits."""
  model, cfg, _ = load_run(workdir)
  differ = {f: (cfg.model.get(f), target_cfg.get(f)) for f in TARGET_FIELDS if cfg.model.get(f) != target_cfg.get(f)}
  if differ:
    raise ValueError(f"the drafter in {workdir} was trained for {cfg.train.init_from}, whose model differs from this one in "
                     + ", ".join(f"model.{f} ({a!r} there, {b!r} here)" for f, (a, b) in differ.items())
                     + "; train a drafter for this model.")
  return model.drafter, cfg


FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the drafter run's folder (checkpoints, metrics, drafter.json)")
         ] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    result = run(args.config, args.workdir)
    if result:
      print(json.dumps({k: result[k] for k in ("val_loss", "slot_accuracy", "mal", "prompts", "rounds")}))


if __name__ == "__main__":
  main()
