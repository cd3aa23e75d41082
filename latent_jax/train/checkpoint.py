"""Orbax checkpoints of a run: params, optimiser state and metadata.

Layout: WORKDIR/checkpoints/STEP/{params, opt_state, meta}; TST runs also keep their
phase-1 result in WORKDIR/phase1/STEP/..., which max_to_keep never removes. `params` is its
own item so evaluation, generation and export restore it without the optimiser. Saves are async;
an interrupted save leaves only a temporary folder that the next training ignores and removes.
Readers (eval, generate, export) open the folders read-only: they list committed steps only and
never touch a training's in-flight temporary folders.

No data iterator state is saved: the data position is the step (data/pipeline.py), so a run
resumes on any number of hosts. (Checkpoints from before kept a `data` item; it is ignored.)
Arrays are restored into the shardings of the target given, whatever mesh and process count
saved them.
"""
import contextlib
import json
import logging
import os
import time

import jax
import orbax.checkpoint as ocp

from latent_jax import paths


LIST_ATTEMPTS = 5


class Checkpoints:
  def __init__(self, workdir, keep=2, async_save=True, subdir="checkpoints", read_only=False):
    """Checkpoints in WORKDIR/SUBDIR (TST keeps its phase-1 result apart, in WORKDIR/phase1).

    Only the training opens them writable; with read_only nothing on disk is created, cleaned or
    removed, so a reader cannot disturb a training that is saving.
    """
    self.directory = paths.absolute(os.path.join(workdir, subdir))  # a local one absolute, as Orbax asks
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1, create=not read_only,
        read_only=read_only, enable_async_checkpointing=async_save and not read_only,
        cleanup_tmp_directories=not read_only)
    for attempt in range(LIST_ATTEMPTS):
      try:
        with quiet_orbax():  # which warns that a read-only manager is read-only
          self.manager = ocp.CheckpointManager(self.directory, options=options)
        break
      except (FileNotFoundError, NotADirectoryError):
        # A reader lists the steps while a training may remove one (max_to_keep): list again.
        if not read_only or attempt == LIST_ATTEMPTS - 1:
          raise
        time.sleep(0.1)

  def latest_step(self):
    return self.manager.latest_step()

  def all_steps(self):
    return sorted(self.manager.all_steps())

  def reload(self):
    """Re-read the steps on disk (after a damaged one was moved away)."""
    self.manager.reload()

  def path(self, step):
    return os.path.join(self.directory, str(step))

  def save(self, step, state, meta):
    """Save the train state {"params", "opt_state", "step"} and a JSON dict (written by process 0)."""
    args = dict(params=ocp.args.StandardSave(state["params"]), opt_state=ocp.args.StandardSave(state["opt_state"]),
                meta=ocp.args.JsonSave({**meta, "step": int(step)}))
    self.manager.save(step, args=ocp.args.Composite(**args), force=True)

  def restore(self, step, abstract_state):
    """Restore into arrays shaped and sharded like `abstract_state`."""
    args = dict(params=ocp.args.StandardRestore(abstract_state["params"]),
                opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]), meta=ocp.args.JsonRestore())
    out = self.manager.restore(step, args=ocp.args.Composite(**args))
    step_array = jax.device_put(jax.numpy.asarray(step, jax.numpy.int32), abstract_state["step"].sharding)
    return {"params": out["params"], "opt_state": out["opt_state"], "step": step_array}, out["meta"]

  def layout_differences(self, step, abstract_state):
    """Entries ("opt_state/1/0/count (): saved, not built") where the saved params or optimiser
    state differ in path or shape from `abstract_state`: a config change, not damage."""
    out = []
    for item in ("params", "opt_state"):
      folder = os.path.join(self.path(step), item)
      with quiet_orbax():  # which warns that an item folder has no step metadata of its own
        saved = layout(ocp.StandardCheckpointer().metadata(folder).item_metadata) if paths.path(folder).is_dir() else {}
      if not saved:  # a missing item is damage, not another layout
        raise FileNotFoundError(f"{folder} is missing or holds no arrays")
      here = layout(abstract_state[item])
      out += [f"{item}/{k} {saved[k]}: saved, not built here" for k in sorted(saved.keys() - here.keys())]
      out += [f"{item}/{k} {here[k]}: built here, not saved" for k in sorted(here.keys() - saved.keys())]
      out += [f"{item}/{k}: saved {saved[k]}, built here {here[k]}" for k in sorted(saved.keys() & here.keys())
              if saved[k] != here[k]]
    return out

  def restore_params(self, step, abstract_params):
    args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
    with self.reading(step):
      return self.manager.restore(step, args=args)["params"]

  def restore_meta(self, step):
    with self.reading(step):
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  @contextlib.contextmanager
  def reading(self, step):
    """A reader's restore of `step`: a step that a training removes meanwhile (max_to_keep) is an
    error to retry, not a traceback (Orbax says KeyError or NotADirectoryError as folders go)."""
    try:
      yield
    except (KeyError, FileNotFoundError, NotADirectoryError) as e:
      raise FileNotFoundError(f"{self.path(step)} lost an item while being read ({e}); a training may have "
                              "removed this step as it saved a newer one: run again.") from None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


@contextlib.contextmanager
def quiet_orbax():
  """Orbax's warnings about what we do on purpose go to absl's logger: keep them off the console."""
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    yield
  finally:
    absl.setLevel(level)


def layout(tree):
  """{"a/0/b": shape} of a pytree, dict keys, sequence indices and attribute names alike (a NamedTuple
  optimiser state is saved as a list)."""
  def name(k):
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return {"/".join(map(name, p)): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def has_checkpoints(workdir):
  """Whether the workdir holds a saved step (a regular checkpoint or a TST phase-1 result)."""
  folders = [paths.path(os.path.join(workdir, sub)) for sub in ("checkpoints", "phase1")]
  return any(f.name.isdigit() for folder in folders if folder.is_dir() for f in folder.iterdir())


def config_to_json(cfg):
  return json.loads(cfg.to_json_best_effort())
