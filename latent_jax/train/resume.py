"""Resuming a run: the config must match the one its checkpoint was saved with, and a damaged
checkpoint is moved aside for the newest readable one.

Changes to a resumed run's config fall in three kinds:
  refused       the saved state would not fit or mean the same: the model (but for model.remat,
                model.scan_unroll, the compute dtype and the bf16 opt-in), data.tokenizer,
                optim.name / optim.trainable, the training-only heads (nitp.enabled,
                nitp.projector, mtp.enabled), LoRA (any lora.* field: rank, targets and
                alpha shape or scale the adapters) and TST's first
                phase (tst.enabled, s, r, budget, superpose, positions; what phase 2 does,
                tst.carry and tst.reinit_embeddings_at_switch, may change: one phase-1 result
                can start several phase-2 variants);
  data          the batches would change under a restored iterator position: data.source,
                data.batch_size, data.seq_len (any data.* field but data.max_text_gib) and train.seed;
                refused unless the train CLI is given --allow_data_change;
  anything else (lr, schedule, train.steps, train.microbatches, logging, mesh, kernels, loss
                weights) is taken, and printed.
"""
import os
from types import SimpleNamespace

from flax.traverse_util import flatten_dict

from latent_jax.config import ConfigError, warmup_steps
from latent_jax import distributed, paths
from latent_jax.checkpoint import Checkpoints, config_to_json, move_aside

REFUSED = ("model.", "data.tokenizer", "optim.name", "optim.trainable", "nitp.enabled", "nitp.projector",
           "mtp.enabled", "tst.enabled", "tst.s", "tst.r", "tst.budget", "tst.superpose", "tst.positions", "lora.")
TAKEN = ("model.remat", "model.scan_unroll", "model.dtype", "model.allow_bf16_params")
DATA = ("data.", "train.seed")
DATA_TAKEN = ("data.max_text_gib",)  # a guard on reading text, not the data: the batches stay the same
IGNORED = ("train.init_from",)  # a resumed run reads its own checkpoints, never its source
DEFAULTS = {"optim.name": "adamw", "optim.trainable": "all",  # fields older checkpoints may lack
            "model.rope_scaling": "none"}


def matches(field, names):
  """Whether `field` is one of `names`, or inside a section named with a trailing dot ("model.")."""
  return any(field == n or (n.endswith(".") and field.startswith(n)) for n in names)


def config_changes(saved, now):
  """[(field, saved value, value now)] of every field that differs (nested config dicts)."""
  saved, now = flatten_dict(saved, sep="."), flatten_dict(now, sep=".")
  missing = object()
  changes = []
  for field in sorted(set(saved) | set(now)):
    before = saved.get(field, DEFAULTS.get(field, missing))
    after = now.get(field, DEFAULTS.get(field, missing))
    if before is not missing and after is not missing and before != after and not matches(field, IGNORED):
      if field == "optim.warmup_steps" and same_warmup(saved, now):
        continue  # 50 steps then, 50/600 of the same 600 now (configs/tiny.py's fraction): the same schedule
      changes.append((field, before, after))
  return changes


def same_warmup(saved, now):
  """Whether two flattened configs' optim.warmup_steps (steps, or a fraction of train.steps) give one length."""
  steps = lambda c: warmup_steps(SimpleNamespace(warmup_steps=c["optim.warmup_steps"]), c["train.steps"])
  return "train.steps" in saved and "train.steps" in now and steps(saved) == steps(now)


def check_config(saved, now, path, allow_data_change=False):
  """Refuse a resume whose config differs from `saved` (the checkpoint at `path`'s) in what the state
  depends on; returns the notices of what else changed."""
  changes = config_changes(saved, now)
  listing = lambda items: "; ".join(f"{f}: saved {a!r}, now {b!r}" for f, a, b in items)
  refused = [c for c in changes if matches(c[0], REFUSED) and not matches(c[0], TAKEN)]
  if refused:
    workdir = os.path.dirname(os.path.dirname(path))
    raise ConfigError(f"{path} was saved with another model, tokenizer or optimiser ({listing(refused)}); resume "
                      f"with the saved values, or start a new --workdir with train.init_from={workdir} to continue "
                      "from its params.")
  data = [c for c in changes if matches(c[0], DATA) and not matches(c[0], DATA_TAKEN)]
  if data and not allow_data_change:
    raise ConfigError(f"{path} was saved with other data ({listing(data)}): the restored iterator position would "
                      "mean other batches. Resume with the saved values, or pass --allow_data_change to resume on "
                      "this data anyway.")
  return [f"resuming with changed config: {f}: {a!r} -> {b!r}" for f, a, b in changes]


def check_saved_config(workdir, cfg, allow_data_change=False, log=print):
  """check_config against the newest checkpoint whose metadata reads (regular or TST phase-1 result),
  read-only and before anything heavy; damage is left to restore_newest. Prints what changed."""
  found = [(s, c) for c in (Checkpoints(workdir, subdir=sub, read_only=True) for sub in ("checkpoints", "phase1")
                            if paths.path(os.path.join(workdir, sub)).is_dir()) for s in c.all_steps()]
  for step, saved in sorted(found, key=lambda x: x[0], reverse=True):
    try:
      saved_cfg = saved.restore_meta(step)["config"]
    except Exception:  # pylint: disable=broad-except  # damaged: restore_newest reports and moves it
      continue
    for notice in check_config(saved_cfg, config_to_json(cfg), saved.path(step), allow_data_change):
      log(notice)
    return


def restore_newest(candidates, restore, workdir, log=print):
  """The newest checkpoint that restores: `candidates` lists (step, Checkpoints), `restore(step,
  checkpoints)` reads one (raising on damage). An unreadable one is named with its error, moved
  to WORKDIR/damaged/ and the next older one tried. Returns (step, checkpoints, restored) or None.

  With several processes every one reads its part of a checkpoint, and they agree on the outcome:
  one that fails on every process is damaged; one that fails on some only stops them all with the
  same error (distributed.Disagreement), moving nothing, as those hosts may be what is wrong.
  Errors that are not damage (a ConfigError: the config does not match) pass through.
  """
  for step, checkpoints in sorted(candidates, key=lambda c: c[0], reverse=True):
    try:
      return step, checkpoints, restore_agreed(checkpoints, step, lambda: restore(step, checkpoints))
    except (ConfigError, distributed.Disagreement):
      raise
    except Exception as e:  # pylint: disable=broad-except  # any failure to read is damage
      reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
      moved = distributed.on_primary(f"move aside {label(checkpoints, step)}",
                                     lambda: move_aside(checkpoints.path(step), workdir, reason))
      checkpoints.reload()
      log(f"warning: checkpoint {checkpoints.path(step)} is unreadable ({reason}); moved it to {moved} and "
          "trying the one before it")
  return None


def restore_agreed(checkpoints, step, read):
  """read() of `step` on every process, and their agreement on it (distributed.on_all): a
  checkpoint that some processes read and others cannot stops them all with one error."""
  where = label(checkpoints, step)
  return distributed.on_all(f"restore {where}", read, f"those hosts read a damaged part of it, or see the shared file "
                            f"system differently (a stale or missing mount); check them. To resume from the checkpoint "
                            f"before it, move WORKDIR/{where} into WORKDIR/damaged/.")


def label(checkpoints, step):
  """"checkpoints/8": the same on every host, wherever it mounts the workdir."""
  return f"{checkpoints.subdir}/{step}"
