"""python -m latent_jax.draft --config configs/tiny_drafter.py --workdir DIR [--config.target=RUN] [--config.a.b=v]

Trains a block drafter (latent_jax.nn.drafter) for a frozen trained target, with or without
the NCP paper's concept injection (Sec. 5.3, Eq. 26), then measures it on the target's
validation split: the drafter's loss and accuracy per block slot, and the mean accepted length
of greedy speculative decoding (MAL, Eq. 27). Writes DIR/drafter.json (the config, the training
curve, the measurements) and DIR/params (Orbax); never overwrites an earlier result.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from latent_jax.config import ConfigError
from latent_jax import cli, distributed, paths
from latent_jax.data import build_data, make_train_iterator, make_val_batches
from latent_jax.data.pipeline import num_windows
from latent_jax.ops import drafting as D
from latent_jax.nn import axes_tree
from latent_jax.nn.drafter import BlockDrafter, draft, target_features
from latent_jax import checkpoint
from latent_jax.train.optim import decays, is_axes
from latent_jax.infer import load
from latent_jax.infer.speculative import speculative_generate


def drafter_loss(drafter, target, batch, anchors, source="data"):
  """Mean CE of the drafter's K proposals at anchors [B, A] against the row's next K tokens ('data') or
  the target's greedy tokens there ('target') -> (loss, (correct [B, A, K], scored [B, A, K]))."""
  tokens = batch["inputs"]
  target_logits, hidden, concepts = target_features(target, tokens, batch["segment_ids"], batch["positions"],
                                                    drafter.concept, logits=source == "target")
  hidden, concepts = jax.lax.stop_gradient((hidden, concepts))
  logits = draft(drafter, target, hidden, concepts, tokens, batch["segment_ids"], anchors)
  if source == "target":  # the target's greedy token at each position after the data before it (teacher-forced)
    tokens = jnp.concatenate([tokens[:, :1], jnp.argmax(target_logits[:, :-1], -1).astype(tokens.dtype)], axis=1)
  labels = D.draft_labels(tokens, batch["segment_ids"], anchors, drafter.block_size)
  real, _ = D.gather_offsets(batch["targets"] >= 0, anchors, jnp.arange(drafter.block_size))  # not padding
  labels = jnp.where(real, labels, -1)
  scored = labels >= 0
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.maximum(labels, 0))
  loss = jnp.sum(jnp.where(scored, ce, 0)) / jnp.maximum(jnp.sum(scored), 1)
  return loss, (jnp.argmax(logits, -1) == labels, scored)


def train_drafter(target, cfg, data, seq_len, log=print):
  """A drafter trained on the target's training rows of seq_len tokens -> (drafter, [{step, loss}])."""
  t = cfg.train
  graphdef, state = nnx.split(BlockDrafter(target.cfg, cfg.drafter, nnx.Rngs(t.seed)))
  params = nnx.to_pure_dict(state)
  target_graph, target_params = nnx.split(target)
  schedule = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps, t.lr * 0.1)
  decay = jax.tree.map(decays, axes_tree(state), is_leaf=is_axes)  # matrices only: not norms, gates, the mask
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=decay))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, target_params, batch, key):
    anchors = jax.random.randint(key, (batch["inputs"].shape[0], t.anchors), 1, batch["inputs"].shape[1])
    loss_fn = lambda p: drafter_loss(nnx.merge(graphdef, p), nnx.merge(target_graph, target_params), batch, anchors,
                                     cfg.drafter.labels)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = make_train_iterator(data, seq_len, t.batch_size, t.seed)
  key, history, start = jax.random.key(t.seed), [], time.time()
  for i in range(1, t.steps + 1):
    batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
    params, opt_state, loss = step(params, opt_state, target_params, batch, jax.random.fold_in(key, i))
    if i % t.log_every == 0 or i == t.steps:
      history.append({"step": i, "loss": float(loss)})
      log(f"drafter step {i}/{t.steps}: loss {float(loss):.4f} ({time.time() - start:.0f} s)")
  return nnx.merge(graphdef, params), history


def validation_prompts(data, count, length):
  """The first `length` tokens of up to `count` validation documents that have that many."""
  val = np.asarray(data.val_tokens)  # a token store's is read on demand
  ends = np.flatnonzero(val == data.tokenizer.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1])
  prompts = [val[s:s + length] for s, e in zip(starts, ends) if e - s >= length][:count]
  if not prompts:
    raise ValueError(f"eval.prompt_len={length}: no validation document has that many tokens; lower it.")
  return np.stack(prompts).astype(np.int32)


def evaluate_drafter(target, drafter, cfg, data, seq_len):
  """The drafter on held-out text: loss and accuracy per block slot (teacher-forced, anchors every
  few tokens), and MAL (Eq. 27) of greedy speculative decoding from validation prompts."""
  e = cfg.eval
  stride = max(1, (seq_len - 1) // cfg.train.anchors)
  total, correct, scored = 0.0, 0, 0
  (drafter_graph, drafter_params), (target_graph, target_params) = nnx.split(drafter), nnx.split(target)
  scores = jax.jit(lambda dp, tp, batch, anchors: drafter_loss(nnx.merge(drafter_graph, dp), nnx.merge(target_graph, tp),
                                                               batch, anchors, cfg.drafter.labels))
  for batch in make_val_batches(data, seq_len, cfg.train.batch_size, e.batches):
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    anchors = jnp.broadcast_to(jnp.arange(1, seq_len, stride), (batch["inputs"].shape[0], len(range(1, seq_len, stride))))
    loss, (hit, mask) = scores(drafter_params, target_params, batch, anchors)
    total += float(loss) * float(jnp.sum(mask))  # weighted by the scored labels: padding counts for nothing
    correct, scored = correct + np.asarray(jnp.sum(hit & mask, (0, 1))), scored + np.asarray(jnp.sum(mask, (0, 1)))
  prompts = validation_prompts(data, e.prompts, e.prompt_len)
  _, committed, rounds = speculative_generate(target, drafter, prompts, e.max_new_tokens)
  return {"val_loss": total / max(int(np.sum(scored)), 1), "slot_accuracy": (correct / np.maximum(scored, 1)).round(4).tolist(),
          "mal": float(D.mean_accepted_length(committed, rounds)), "prompts": len(prompts),
          "rounds": int(jnp.sum(rounds)), "committed": int(jnp.sum(committed))}


def run(cfg, workdir, log=print):
  """Train and measure a drafter for cfg.target; results in WORKDIR/drafter.json -> that dict."""
  if jax.process_count() > 1:
    raise ValueError("latent_jax.draft trains a small drafter in one process; run it on one host, without "
                     "--num_processes (the target may come from a run on any number of hosts).")
  out = os.path.join(workdir, "drafter.json")
  for path in (out, os.path.join(workdir, "params")):
    if paths.path(path).exists():
      raise FileExistsError(f"{path} exists; pick another --workdir (an earlier result is never overwritten).")
  cli.writable_dir(workdir, "--workdir")
  if not (checkpoint.is_export(cfg.target) or checkpoint.has_checkpoints(cfg.target)):
    raise FileNotFoundError(f"target: {cfg.target!r} is neither a training workdir with checkpoints nor an export "
                            "folder; train first, or point --config.target at a trained run's workdir.")
  target, target_cfg, tokenizer = load.load_model(cfg.target)
  if cfg.drafter.concept != "none" and target_cfg.model.name != "concept":
    raise ConfigError(f"drafter.concept={cfg.drafter.concept!r} needs a ConceptLM target, but {cfg.target} is "
                      f"model.name={target_cfg.model.name!r}; use --config.drafter.concept=none.")
  data_cfg = target_cfg.copy_and_resolve_references()
  data_cfg.data.tokenizer = tokenizer.path  # the target's ids, never retrained
  data = build_data(data_cfg, workdir)
  rows = num_windows(len(data.train_tokens), target_cfg.data.seq_len)
  if rows < cfg.train.batch_size:
    raise ConfigError(f"train.batch_size={cfg.train.batch_size}: the target's training split has only {rows} rows of "
                      f"{target_cfg.data.seq_len} tokens; lower it.")
  start = time.time()
  drafter, history = train_drafter(target, cfg, data, target_cfg.data.seq_len, log)
  result = {"config": cfg.to_dict(), "target_model": target_identity(target_cfg.model), "history": history, "train_seconds": round(time.time() - start, 1),
            **evaluate_drafter(target, drafter, cfg, data, target_cfg.data.seq_len)}
  paths.path(workdir).mkdir(parents=True, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(paths.absolute(os.path.join(workdir, "params")), nnx.to_pure_dict(nnx.state(drafter)))
  checkpointer.wait_until_finished()
  paths.path(out).write_text(json.dumps(result, indent=1))
  return result


def target_identity(model_cfg):
  """What a drafter depends on in its target's model config: a drafter fits only a target that matches."""
  fields = ("name", "vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "chunk_size")
  return {f: model_cfg.get(f) for f in fields}


def load_drafter(workdir, target_cfg):
  """(drafter, drafter config) saved by `run` in workdir, for a target of model config target_cfg."""
  path = os.path.join(workdir, "drafter.json")
  if not paths.path(path).is_file():
    raise FileNotFoundError(f"no drafter.json in {workdir!r}; train a drafter first (python -m latent_jax.draft ...).")
  saved = json.loads(paths.path(path).read_text())
  cfg = ml_collections.ConfigDict(saved["config"])
  differ = {f: (v, target_cfg.get(f)) for f, v in saved["target_model"].items() if target_cfg.get(f) != v}
  if differ:
    raise ValueError(f"the drafter in {workdir} was trained for {cfg.target}, whose model differs from this one in "
                     + ", ".join(f"model.{f} ({a!r} there, {b!r} here)" for f, (a, b) in differ.items())
                     + "; train a drafter for this model.")
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: BlockDrafter(target_cfg, cfg.drafter, nnx.Rngs(0))))
  params = ocp.StandardCheckpointer().restore(paths.absolute(os.path.join(workdir, "params")),
                                              nnx.to_pure_dict(abstract))
  nnx.replace_by_pure_dict(abstract, params)
  return nnx.merge(graphdef, abstract), cfg


FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the drafter's folder (drafter.json, params/)")
         ] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    result = run(args.config, args.workdir)
    print(json.dumps({k: result[k] for k in ("val_loss", "slot_accuracy", "mal", "prompts", "rounds")}))


if __name__ == "__main__":
  main()
