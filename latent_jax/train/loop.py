"""The training loop, top to bottom: data, model, optimiser, restore, step, log, eval, save."""
import math
import os
import signal
import time

import jax
import numpy as np
import tqdm

from latent_jax import objectives
from latent_jax.config import validate
from latent_jax.data import build_data, make_train_iterator, make_val_batches
from latent_jax.train import checkpoint, flops, sharding
from latent_jax.train import step as steps
from latent_jax.train.metrics import MetricsWriter
from latent_jax.train.optim import build_optimizer


class NonFiniteLoss(RuntimeError):
  pass


def train(cfg, workdir):
  """Train (or resume) the run in `workdir`. Returns the last logged metrics."""
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(cfg.mesh)
  sharding.check_batch(cfg.data.batch_size, mesh)

  # Data: corpus -> tokenizer (trained once, then reused) -> packed windows.
  data = build_data(cfg, workdir)
  train_iter = make_train_iterator(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.seed,
                                   jax.process_index(), jax.process_count())
  val_batches = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
  val_bytes = steps.scored_bytes(val_batches, data.tokenizer.token_bytes)

  # Model and optimiser, initialised straight into their shardings.
  graphdef, abstract_params = steps.abstract_model(cfg.model)
  tx, schedule = build_optimizer(cfg.optim, cfg.train.steps, steps.axes_tree(abstract_params))
  shardings = steps.state_shardings(abstract_params, tx, mesh)
  state = steps.init_state(cfg.model, cfg.train.seed, tx, shardings)

  # Resume from the latest checkpoint in the workdir, if there is one.
  ckpt = checkpoint.Checkpoints(workdir, cfg.train.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if start:
    state, _ = ckpt.restore(start, checkpoint.abstract_like(state, shardings), train_iter)
    print(f"resumed from {ckpt.path(start)}")
  meta = {"config": checkpoint.config_to_json(cfg)}

  train_step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg))
  eval_step = steps.make_eval_step(graphdef, cfg, shardings["params"], mesh)

  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  flops_per_token = flops.flops_per_token(cfg.model, cfg.data.seq_len)
  peak, peak_source = flops.peak_flops(cfg.train.peak_flops)
  peak *= jax.device_count()
  writer = MetricsWriter(workdir, start)
  print(f"{param_count(abstract_params) / 1e6:.2f}M params, {flops_per_token / 1e6:.1f} MFLOPs/token, "
        f"peak {peak / 1e12:.3g} TFLOP/s ({peak_source}); train {data.train_tokens.size:,} tokens, "
        f"val {data.val_tokens.size:,} tokens")

  stop = install_stop_handler()
  bar = tqdm.tqdm(total=cfg.train.steps, initial=start, dynamic_ncols=True, disable=jax.process_index() != 0)
  metrics, last_time, last_step = {}, time.perf_counter(), start
  step = start
  while step < cfg.train.steps:
    batch = sharding.global_batch(next(train_iter), mesh)
    state, step_metrics = train_step(state, batch)
    step += 1
    is_last = step == cfg.train.steps
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
      tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
      last_time, last_step = now, step
      metrics.update(lr=float(schedule(step - 1)), tokens_per_s=tokens_per_s, tokens=step * tokens_per_step,
                     flops=step * tokens_per_step * flops_per_token, mfu=tokens_per_s * flops_per_token / peak)
      if eval_now:
        metrics.update(steps.evaluate(eval_step, state["params"], val_batches, val_bytes, mesh))
        last_time = time.perf_counter()  # keep evaluation out of the throughput
      writer.write(step, metrics)
      bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{metrics['mfu']:.1%}")
    bar.update(1)
    if save_now:
      ckpt.save(step, state, train_iter, meta)
    if stopping:
      print(f"\nstopped at step {step}; checkpoint {ckpt.path(step)}")
      break
  bar.close()
  ckpt.close()
  writer.close()
  return metrics


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
