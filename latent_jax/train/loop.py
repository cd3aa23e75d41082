"""The training loop, top to bottom: data, model, restore, then per phase: optimiser, step, log, eval, save.

A plain run has one phase; a TST run two (train/phases.py, docs/tst.md).
"""
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from latent_jax.config import ConfigError, is_ladder, moe_enabled, trainable_setting, validate
from latent_jax import distributed, sharding
from latent_jax.cli import writable_dir
from latent_jax.data import build_data, check_text_source, make_train_iterator, make_val_batches, save_tokenizer
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.nn.lora import adapt
from latent_jax import checkpoint, proxies
from latent_jax.train import flops, phases, resume
from latent_jax.train import step as steps
from latent_jax.train.metrics import MetricsWriter, read_metrics
from latent_jax.train.monitors import make_probe, make_router_bias_metrics
from latent_jax.train.profile import StepProfiler
from latent_jax.train.progress import Progress
from latent_jax.train.optim import build_optimizer, trainable_mask
from latent_jax.train.workdir import WorkdirBusy, WorkdirLock, remove_if_empty, workdir_created


class NonFiniteLoss(RuntimeError):
  pass


def train(cfg, workdir, allow_data_change=False):
  """Train (or resume) the run in `workdir`. Returns the last logged metrics.

  One training per workdir: a second one exits at once, naming the live holder (train/workdir.py).
  With several processes (latent_jax/distributed.py) process 0 holds the lock for all of them.
  allow_data_change: resume although data.* or train.seed differ from the checkpoint's config.
  """
  started = time.perf_counter()
  if "target" in cfg:
    raise ConfigError("--config: a drafter config (it names a target, as configs/tiny_drafter.py does) trains with "
                      "python -m latent_jax.draft --config FILE --workdir DIR, not with the train command.")
  validate(cfg)
  check_text_source(cfg.data, jax.process_count())  # before the workdir is made
  writable_dir(workdir, "--workdir")
  created, lock = distributed.on_primary("workdir lock", lambda: hold_workdir(workdir), WorkdirBusy,
                                         OSError) or (None, None)
  try:
    return run(cfg, workdir, allow_data_change, started)
  finally:
    if lock:
      lock.release()
      remove_if_empty(created)  # bad input stopped a new run before it wrote anything


def hold_workdir(workdir):
  """(the folder this made or None, the held lock)."""
  created = workdir_created(workdir)
  return created, WorkdirLock(workdir)


def run(cfg, workdir, allow_data_change, started):
  mesh = sharding.make_mesh(cfg.mesh)
  sharding.check_batch(cfg.data.batch_size, mesh, cfg.train.microbatches)
  sharding.check_experts(cfg.model, mesh)
  print(distributed.describe(mesh))  # on every host: its own log names it
  source = None
  if checkpoint.has_checkpoints(workdir):  # a resumed run ignores train.init_from
    resume.check_saved_config(workdir, cfg, allow_data_change, log=say)
    checkpoint.restore_tokenizer(workdir, log=say)
  elif cfg.train.get("init_from"):
    source = adopt_source(cfg)

  # Data: corpus -> tokenizer (trained once, then reused) -> packed windows. Each phase opens
  # its own train iterator (TST phase 1 reads longer rows); validation is always plain NTP.
  data = build_data(cfg, workdir, source)
  plan = phases.plan(cfg)
  phases.check_data(plan, data.train_tokens.size, cfg.data.batch_size)
  rows = sharding.process_rows(cfg.data.batch_size, mesh)  # of each global batch, those this host's devices hold
  val_batches = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches, rows)
  # The data position is the phase's step count: no iterator state to save, any host count resumes.
  open_iterator = lambda phase, step: make_train_iterator(data, phase.seq_len, cfg.data.batch_size, phase.data_seed,
                                                          rows, step - phase.start)

  # Model and state shardings (every phase's optimiser state has the same structure).
  graphdef, abstract_params = abstract_model(cfg)  # with the training-only heads (NITP, MTP, a drafter)
  axes = axes_tree(abstract_params)
  trains = trainable_mask(axes, trainable_setting(cfg))  # with lora.enabled: the LoRA factors
  if len(plan) > 1 and cfg.tst.reinit_embeddings_at_switch:
    check_trains_embeddings(trains, trainable_setting(cfg))
  tx, _ = build_optimizer(cfg.optim, plan[0].schedule_steps, axes, trainable_setting(cfg),
                          total_steps=cfg.train.steps)
  shardings = steps.state_shardings(abstract_params, tx, mesh)
  abstract_state = steps.abstract_state(cfg, tx, shardings)
  # train.eval_tasks: the capability proxies' task files, read and checked here, scored at each evaluation.
  proxy_eval = proxies.for_run(cfg, data.tokenizer, graphdef, shardings["params"], mesh, lambda p: adapt(p, cfg))
  # The first write (process 0's): bad input stops the run above, leaving nothing.
  distributed.on_primary("tokenizer", lambda: save_tokenizer(data, workdir), OSError)

  # Resume from the newest readable checkpoint in the workdir: a regular one, or in a TST run the
  # phase-1 result (WORKDIR/phase1, kept apart from max_to_keep), from which phase 2 starts.
  ckpt = checkpoint.Checkpoints(workdir, cfg.train.keep_checkpoints)
  phase1 = checkpoint.Checkpoints(workdir, 1, async_save=False, subdir="phase1") if len(plan) > 1 else None
  meta = {"config": checkpoint.config_to_json(cfg)}

  def restore(step, saved):
    """The state at `step` (and, mid-phase, the data iterator from there on)."""
    differences = saved.layout_differences(step, abstract_state)
    if differences:  # readable, but of another layout: a config change (optim.clip_norm 0 <-> > 0, ...)
      raise ConfigError(f"{saved.path(step)} holds a state of another layout than this config builds "
                        f"({len(differences)} entries differ: {'; '.join(differences[:3])}); resume with the config "
                        "it was saved with, or start a new --workdir with train.init_from=" + workdir + ".")
    if saved is phase1:  # phase 2 starts here, from this state, with a fresh iterator
      return phase1.restore(step, abstract_state)[0], None
    return ckpt.restore(step, abstract_state)[0], open_iterator(phases.phase_at(plan, step), step)

  candidates = [(s, ckpt) for s in ckpt.all_steps()] + [(s, phase1) for s in (phase1.all_steps() if phase1 else ())]
  found = resume.restore_newest(candidates, restore, workdir, log=say)
  step, saved, (state, train_iter) = found if found else (0, None, (None, None))
  if step >= plan[-1].end:
    for manager in (ckpt, phase1):
      if manager:
        manager.close()
    return finished(workdir, step, saved.path(step))
  if step:
    say(f"resumed from {saved.path(step)}")

  eval_step = steps.make_eval_step(graphdef, cfg, shardings["params"], mesh, data.tokenizer.token_bytes)
  is_finite = jax.jit(lambda tree: jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])))
  peak, peak_source = flops.peak_flops(cfg.train.peak_flops)
  peak = float(distributed.from_primary(peak)) * jax.device_count()  # one figure: the hosts' own may differ
  writer = MetricsWriter(workdir, step, cfg)
  flags = jax.tree.leaves(trains)
  trainable = "" if all(flags) else f" ({sum(int(np.prod(x.shape)) for x, t in zip(jax.tree.leaves(abstract_params), flags) if t) / 1e6:.3f}M trainable)"
  active, non_embedding = flops.parameter_counts(abstract_params, axes, cfg.model)
  sparse = f" (non-embedding: {active / 1e6:.3f}M active of {non_embedding / 1e6:.3f}M)" if moe_enabled(cfg.model) else ""
  say(f"{param_count(abstract_params) / 1e6:.2f}M params{sparse}{trainable}, peak {peak / 1e12:.3g} TFLOP/s ({peak_source}); "
        f"train {data.train_tokens.size:,} tokens, val {data.val_tokens.size:,} tokens, "
        f"unigram entropy {data.unigram_entropy:.3f} nats/token")

  stop = distributed.StopRequests()
  metrics, stopped, saver, bar = {}, False, ckpt, None
  profiler = StepProfiler(workdir, cfg.train.get("profile_steps"), log=say)
  # train.monitors: per-layer attention logits and q/k norms, from a probe of a few rows at log steps.
  probe = make_probe(graphdef, cfg, shardings, mesh, compile_for=(abstract_state["params"], steps.batch_shapes(
      cfg.data.batch_size, cfg.data.seq_len, mesh))) if cfg.train.get("monitors") else None
  bias_metrics = make_router_bias_metrics(shardings["params"], mesh) if (
      moe_enabled(cfg.model) and cfg.model.moe.router == "sigmoid") else None
  try:
    for phase in plan:
      if step >= phase.end:
        continue
      say(phase.describe(cfg.data.batch_size))
      tx, schedule = build_optimizer(cfg.optim, phase.schedule_steps, axes, trainable_setting(cfg),
                                     total_steps=cfg.train.steps)
      if step == phase.start:  # a fresh run, or TST's switch
        train_iter = open_iterator(phase, step)
        state = enter_phase(phase, cfg, tx, shardings, abstract_state, phase1)
      # Compiled before the progress bar starts, so that its rate and ETA count steps only. With train.monitors,
      # log steps run a twin that also gives the group norms (make_train_step's `monitors`).
      compile_start = time.perf_counter()
      compile_step = lambda monitored: steps.make_train_step(
          graphdef, tx, cfg, shardings, mesh, phase.objective, monitors=monitored).lower(
          abstract_state, steps.batch_shapes(cfg.data.batch_size, phase.seq_len, mesh)).compile()
      train_step = compile_step(False)
      logged_step = compile_step(True) if probe else train_step
      say(f"compiled the train step{' and its monitored twin' if probe else ''} in "
          f"{time.perf_counter() - compile_start:.1f} s")
      # The hosts start stepping together: on CPU, gloo gives up on a first collective whose peers
      # arrive over 30 s apart (a host still compiling under load), whatever the XLA timeout flags.
      distributed.barrier("train step compiled")
      bar = Progress(step, phase.end)  # a bar on a terminal, a plain line per log step otherwise
      last_time, last_step, first = time.perf_counter(), step, step + 1
      while step < phase.end:
        batch = sharding.global_batch(next(train_iter), mesh, cfg.data.batch_size)
        is_last = step + 1 == phase.end
        eval_now = cfg.train.eval_every > 0 and ((step + 1) % cfg.train.eval_every == 0 or is_last)
        log_now = (step + 1) % cfg.train.log_every == 0 or is_last or eval_now
        with profiler.before(step + 1):  # train.profile_steps
          state, step_metrics = (logged_step if log_now else train_step)(state, batch)
        step += 1
        profiler.after(step, state)
        if step == first:  # dispatched steps return at once: the bar's rate starts when the first has run
          jax.block_until_ready(step_metrics)
          bar.started(step)
        stopping = stop.after(step)  # read once: a signal may land at any point of this iteration
        save_now = step % cfg.train.checkpoint_every == 0 or is_last or stopping
        if log_now or save_now:
          metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
          # The loss terms and grad_norm; not the monitors' per-group norms ("/" in the name), whose update norm
          # overflows with the parameters (which the state check below names).
          if not all(math.isfinite(v) for k, v in metrics.items() if "/" not in k):
            raise NonFiniteLoss(f"non-finite loss at step {step}: {metrics}. {last_good(ckpt, phase1)}")
        if save_now and not bool(is_finite(state)):  # a finite loss can still give a non-finite update
          raise NonFiniteLoss(f"non-finite parameters or optimiser state after step {step}; not saved. "
                              f"{last_good(ckpt, phase1)}")
        if log_now:
          now = time.perf_counter()
          steps_per_s = (step - last_step) / (now - last_time)
          last_time, last_step = now, step
          metrics.update(lr=float(schedule(step - 1 - phase.schedule_start)),
                         tokens_per_s=phase.tokens_per_step * steps_per_s, tokens=phase.tokens_at(step),
                         flops=phase.flops_at(step), mfu=phase.flops_per_step * steps_per_s / peak)
          if phase.number is not None:
            metrics["phase"] = phase.number
          if sparse:  # model.moe: N as active and total non-embedding parameters
            metrics.update(active_params=active, nonembedding_params=non_embedding)
          if bias_metrics:  # model.moe.router=sigmoid: router_bias_spread/i, from the params
            metrics.update(bias_metrics(state["params"]))
          if probe and phase.seq_len == phase.positions:  # not over TST's bags: plain rows only
            metrics.update(probe(state["params"], batch))
          if eval_now:
            val = steps.evaluate(eval_step, state["params"], val_batches, mesh, cfg.data.batch_size)
            metrics.update(val_loss=val["val_loss"], val_bpb=val["val_bpb"])
            if proxy_eval:
              metrics.update(proxy_eval(state["params"]))  # proxy/...: latent_jax/proxies.py
            last_time = time.perf_counter()  # keep evaluation out of the throughput
          writer.write(step, metrics, upload=eval_now)
          bar.logged(step, metrics)
        bar.advance()
        # The phase-1 result goes to WORKDIR/phase1, synchronously: phase 2 starts by restoring it.
        switch = is_last and phase.number == 1
        saver = phase1 if switch else ckpt
        if save_now:
          tags = {} if phase.number is None else {"phase": phase.number}
          if switch:
            tags["phase1_final"] = True
          saver.save(step, state, {**meta, **tags}, data.tokenizer)
        if stopping:
          stopped = True
          break
      bar.close()
      if stopped:
        break
  finally:  # also on errors: let started checkpoint saves finish
    if bar is not None:
      bar.close()  # before any error message, which then stays the last line
    ckpt.close()
    if phase1:
      phase1.close()
    writer.close()
  say(summary("stopped" if stopped else "done", step, cfg.train.steps, metrics, phase.tokens_at(step),
                time.perf_counter() - started, saver.path(step)))
  return metrics


def enter_phase(phase, cfg, tx, shardings, abstract_state, phase1):
  """The train state at a phase's first step: fresh at step 0, else TST's switch."""
  if phase.start == 0:
    state = steps.init_state(cfg, cfg.train.seed, tx, shardings)
    if cfg.train.get("init_from"):
      state["params"] = checkpoint.initial_params(cfg.train.init_from, cfg, state["params"])
      say(f"params from {cfg.train.init_from}")
    return state
  # The TST switch: phase 2 starts from the phase-1 result on disk (exactly as a resumed run
  # does), with a fresh data iterator; carry="params" also starts a fresh optimiser state.
  state, _ = resume.restore_agreed(phase1, phase.start, lambda: phase1.restore(phase.start, abstract_state))
  say(f"phase {phase.number} starts from {phase1.path(phase.start)}")
  if phase.fresh_optimizer:
    state["opt_state"] = jax.jit(tx.init, out_shardings=shardings["opt_state"])(state["params"])
  if phase.reinit_embeddings:
    state = phases.reinit_embeddings(state, cfg.model, cfg.train.seed, shardings)
  return state


def last_good(ckpt, phase1):
  """Where the newest saved (and so finite: nothing else is saved) state is, for NaN messages."""
  ckpt.wait()
  found = [(s, c.path(s)) for c in (ckpt, phase1) if c for s in c.all_steps()]
  where = max(found)[1] if found else "none"
  return f"Last good checkpoint: {where}. Lower optim.lr or raise optim.warmup_steps."


def summary(what, step, steps, metrics, tokens, seconds, path):
  """The run's last line: where it stands and where its checkpoint is."""
  val = (f"val loss {metrics['val_loss']:.4f} nats/token ({metrics['val_bpb']:.4f} bits/byte)" if "val_loss" in metrics
         else "no validation at this step")
  return f"{what} at step {step}/{steps}: {val}, {tokens:,} tokens, {seconds / 60:.1f} min; checkpoint {path}"


def finished(workdir, step, path):
  """A rerun of a finished run: say so, and return its last logged metrics."""
  rows = [r for r in read_metrics(workdir) if r["step"] <= step]
  with_val = [r for r in rows if "val_loss" in r]
  val = (f", val loss {with_val[-1]['val_loss']:.4f} nats/token at step {with_val[-1]['step']}" if with_val else "")
  say(f"{workdir} is complete: step {step}{val}; checkpoint {path}. Raise train.steps to train further, "
        "or use a new --workdir.")
  return rows[-1] if rows else {}


def adopt_source(cfg):
  """train.init_from: check, before anything compiles, that the source has every parameter of
  this model -> its tokenizer (the run keeps its token ids), unless data.tokenizer names another."""
  source_cfg, _ = checkpoint.check_init_from(cfg.train.init_from, cfg, nnx.to_pure_dict(abstract_model(cfg)[1]))
  return None if cfg.data.tokenizer else checkpoint.load_tokenizer(cfg.train.init_from, source_cfg)


def check_trains_embeddings(trains, trainable):
  """TST's re-init ablation gives phase 2 a fresh embedding and LM head: they must train."""
  frozen = [k for k in phases.EMBEDDING_PARAMS if k in trains and not all(jax.tree.leaves(trains[k]))]
  if frozen:
    raise ConfigError(f"optim.trainable={trainable!r} freezes {frozen}, which tst.reinit_embeddings_at_switch "
                      "re-initialises at the switch: they would stay random. Train them, or turn the re-init off.")


def param_count(abstract_params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))


def say(*args):
  """Print on process 0 only: the other hosts would repeat it."""
  if distributed.is_primary():
    print(*args)
