"""The training loop, top to bottom: data, model, restore, then per phase: optimiser, step, log, eval, save.

A plain run has one phase; a TST run two (train/phases.py, docs/tst.md).
"""
import math
import os
import signal
import time

import jax
import numpy as np
import tqdm
from flax import nnx

from latent_jax.cli import writable_dir
from latent_jax.config import ConfigError, validate
from latent_jax.data import build_data, make_train_iterator, make_val_batches, save_tokenizer
from latent_jax.infer import load
from latent_jax.train import checkpoint, flops, phases, sharding
from latent_jax.train import step as steps
from latent_jax.train.metrics import MetricsWriter
from latent_jax.train.optim import build_optimizer, trainable_mask


class NonFiniteLoss(RuntimeError):
  pass


def train(cfg, workdir):
  """Train (or resume) the run in `workdir`. Returns the last logged metrics."""
  validate(cfg)
  writable_dir(workdir, "--workdir")
  mesh = sharding.make_mesh(cfg.mesh)
  sharding.check_batch(cfg.data.batch_size, mesh)
  source = None
  if checkpoint.has_checkpoints(workdir):  # a resumed run ignores train.init_from
    load.check_resume(workdir, cfg)
  elif cfg.train.get("init_from"):
    source = adopt_source(cfg)

  # Data: corpus -> tokenizer (trained once, then reused) -> packed windows. Each phase opens
  # its own train iterator (TST phase 1 reads longer rows); validation is always plain NTP.
  data = build_data(cfg, workdir, source)
  plan = phases.plan(cfg)
  phases.check_data(plan, data.train_tokens.size, cfg.data.batch_size)
  save_tokenizer(data, workdir)  # the first write: bad input stops the run above, leaving nothing
  val_batches = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches,
                                 jax.process_index(), jax.process_count())
  val_bytes = steps.scored_bytes(val_batches, data.tokenizer.token_bytes)

  # Model and state shardings (every phase's optimiser state has the same structure).
  graphdef, abstract_params = steps.abstract_model(cfg)  # with the training-only heads (NITP, MTP)
  axes = steps.axes_tree(abstract_params)
  trains = trainable_mask(axes, cfg.optim.get("trainable", "all"))
  if len(plan) > 1 and cfg.tst.reinit_embeddings_at_switch:
    check_trains_embeddings(trains, cfg.optim.get("trainable", "all"))
  tx, _ = build_optimizer(cfg.optim, plan[0].schedule_steps, axes)
  shardings = steps.state_shardings(abstract_params, tx, mesh)
  abstract_state = checkpoint.abstract_like(
      jax.eval_shape(lambda: steps.init_state(cfg, cfg.train.seed, tx, shardings)), shardings)

  # Resume from the latest checkpoint in the workdir; in a TST run, from the phase-1 result
  # (WORKDIR/phase1, kept apart from max_to_keep) if phase 1 finished after that checkpoint.
  ckpt = checkpoint.Checkpoints(workdir, cfg.train.keep_checkpoints)
  phase1 = checkpoint.Checkpoints(workdir, 1, async_save=False, subdir="phase1") if len(plan) > 1 else None
  step = ckpt.latest_step() or 0
  saved = ckpt
  if phase1 and phase1.latest_step() is not None and step < plan[1].start:
    step, saved = plan[1].start, phase1
  if step:  # the saved optimiser state must be the one this config builds
    check_same_optimizer(cfg, saved.restore_meta(step)["config"], saved.path(step))
  meta = {"config": checkpoint.config_to_json(cfg)}
  eval_step = steps.make_eval_step(graphdef, cfg, shardings["params"], mesh)

  peak, peak_source = flops.peak_flops(cfg.train.peak_flops)
  peak *= jax.device_count()
  writer = MetricsWriter(workdir, step)
  flags = jax.tree.leaves(trains)
  trainable = "" if all(flags) else f" ({sum(int(np.prod(x.shape)) for x, t in zip(jax.tree.leaves(abstract_params), flags) if t) / 1e6:.3f}M trainable)"
  print(f"{param_count(abstract_params) / 1e6:.2f}M params{trainable}, peak {peak / 1e12:.3g} TFLOP/s ({peak_source}); "
        f"train {data.train_tokens.size:,} tokens, val {data.val_tokens.size:,} tokens, "
        f"unigram entropy {data.unigram_entropy:.3f} nats/token")

  stop = install_stop_handler()
  bar = tqdm.tqdm(total=cfg.train.steps, initial=step, dynamic_ncols=True, disable=jax.process_index() != 0)
  metrics, stopped = {}, False
  try:
    for phase in plan:
      if step >= phase.end:
        continue
      print(phase.describe(cfg.data.batch_size))
      tx, schedule = build_optimizer(cfg.optim, phase.schedule_steps, axes)
      train_iter = make_train_iterator(data, phase.seq_len, cfg.data.batch_size, phase.data_seed,
                                       jax.process_index(), jax.process_count())
      state = enter_phase(phase, step, cfg, tx, shardings, abstract_state, ckpt, phase1, train_iter)
      train_step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, phase.objective)
      last_time, last_step = time.perf_counter(), step
      while step < phase.end:
        batch = sharding.global_batch(next(train_iter), mesh)
        state, step_metrics = train_step(state, batch)
        step += 1
        is_last = step == phase.end
        stopping = stop.requested  # read once: a signal may land at any point of this iteration
        eval_now = cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or is_last)
        log_now = step % cfg.train.log_every == 0 or is_last or eval_now
        save_now = step % cfg.train.checkpoint_every == 0 or is_last or stopping
        if log_now or save_now:
          metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
          if not all(map(math.isfinite, metrics.values())):
            ckpt.wait()
            good = ckpt.latest_step()
            raise NonFiniteLoss(f"non-finite loss at step {step}: {metrics}. Last good checkpoint: "
                                f"{ckpt.path(good) if good else 'none'}. Lower optim.lr or raise optim.warmup_steps.")
        if log_now:
          now = time.perf_counter()
          steps_per_s = (step - last_step) / (now - last_time)
          last_time, last_step = now, step
          metrics.update(lr=float(schedule(step - 1 - phase.schedule_start)),
                         tokens_per_s=phase.tokens_per_step * steps_per_s, tokens=phase.tokens_at(step),
                         flops=phase.flops_at(step), mfu=phase.flops_per_step * steps_per_s / peak)
          if phase.number is not None:
            metrics["phase"] = phase.number
          if eval_now:
            metrics.update(steps.evaluate(eval_step, state["params"], val_batches, val_bytes, mesh))
            last_time = time.perf_counter()  # keep evaluation out of the throughput
          writer.write(step, metrics)
          bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:,.0f}",
                          mfu=f"{metrics['mfu']:.1%}")
        bar.update(1)
        # The phase-1 result goes to WORKDIR/phase1, synchronously: phase 2 starts by restoring it.
        switch = is_last and phase.number == 1
        saver = phase1 if switch else ckpt
        if save_now:
          tags = {} if phase.number is None else {"phase": phase.number}
          if switch:
            tags["phase1_final"] = True
          saver.save(step, state, train_iter, {**meta, **tags})
        if stopping:
          print(f"\nstopped at step {step}; checkpoint {saver.path(step)}")
          stopped = True
          break
      if stopped:
        break
  finally:  # also on errors: let started checkpoint saves finish
    bar.close()
    ckpt.close()
    if phase1:
      phase1.close()
    writer.close()
  return metrics


def enter_phase(phase, step, cfg, tx, shardings, abstract_state, ckpt, phase1, train_iter):
  """The train state at `step`: fresh at 0, a checkpoint inside the phase, or TST's switch."""
  if step == 0:
    state = steps.init_state(cfg, cfg.train.seed, tx, shardings)
    if cfg.train.get("init_from"):
      state["params"] = load.initial_params(cfg.train.init_from, cfg, state["params"])
      print(f"params from {cfg.train.init_from}")
    return state
  if step > phase.start:
    state, _ = ckpt.restore(step, abstract_state, train_iter)
    print(f"resumed from {ckpt.path(step)}")
    return state
  # The TST switch: phase 2 starts from the phase-1 result on disk (exactly as a resumed run
  # does), with a fresh data iterator; carry="params" also starts a fresh optimiser state.
  state, _ = phase1.restore(step, abstract_state, None)
  print(f"phase {phase.number} starts from {phase1.path(step)}")
  if phase.fresh_optimizer:
    state["opt_state"] = jax.jit(tx.init, out_shardings=shardings["opt_state"])(state["params"])
  if phase.reinit_embeddings:
    state = phases.reinit_embeddings(state, cfg.model, cfg.train.seed, shardings)
  return state


def adopt_source(cfg):
  """train.init_from: check, before anything compiles, that the source has every parameter of
  this model -> its tokenizer (the run keeps its token ids), unless data.tokenizer names another."""
  source_cfg, _ = load.check_init_from(cfg.train.init_from, cfg, nnx.to_pure_dict(steps.abstract_model(cfg)[1]))
  return None if cfg.data.tokenizer else load.load_tokenizer(cfg.train.init_from, source_cfg)


def check_same_optimizer(cfg, saved, path):
  """A resumed run must build the optimiser state it saved: same optim.name and optim.trainable."""
  for field, default in (("name", "adamw"), ("trainable", "all")):
    before, now = saved.get("optim", {}).get(field, default), cfg.optim.get(field, default)
    if before != now:
      raise ConfigError(f"optim.{field}: {path} was saved with optim.{field}={before!r}, this config says {now!r}; "
                        f"resume with {before!r}, or start a new workdir with "
                        f"train.init_from={os.path.dirname(os.path.dirname(path))} to continue from its params.")


def check_trains_embeddings(trains, trainable):
  """TST's re-init ablation gives phase 2 a fresh embedding and LM head: they must train."""
  frozen = [k for k in phases.EMBEDDING_PARAMS if k in trains and not all(jax.tree.leaves(trains[k]))]
  if frozen:
    raise ConfigError(f"optim.trainable={trainable!r} freezes {frozen}, which tst.reinit_embeddings_at_switch "
                      "re-initialises at the switch: they would stay random. Train them, or turn the re-init off.")


def param_count(abstract_params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))


class install_stop_handler:
  """SIGTERM or Ctrl-C asks the loop to save a checkpoint and exit after the current step."""

  def __init__(self):
    self.requested = False
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self.request)

  def request(self, signum, frame):
    if self.requested:  # a second Ctrl-C: give up at once
      raise KeyboardInterrupt
    self.requested = True
