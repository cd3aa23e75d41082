"""Orbax checkpoints of a run: params, optimiser state and metadata.

Layout: WORKDIR/checkpoints/STEP/{params, opt_state, meta, tokenizer}; TST runs also keep their
phase-1 result in WORKDIR/phase1/STEP/..., which max_to_keep never removes. `params` is its
own item so evaluation, generation and export restore it without the optimiser. `tokenizer` holds
the run's tokenizer file (its checksum is in `meta` too), so a workdir whose tokenizer.model (or
.json) is lost or damaged gets it back from its newest checkpoint (`restore_tokenizer`); checkpoints
from before it was saved lack it, and restore as before. Saves are async;
an interrupted save leaves only a temporary folder that the next training ignores and removes.
Readers (eval, generate, export) open the folders read-only: they list committed steps only and
never touch a training's in-flight temporary folders.

No data iterator state is saved: the data position is the step (data/pipeline.py), so a run
resumes on any number of hosts. (Checkpoints from before kept a `data` item; it is ignored.)
Arrays are restored into the shardings of the target given, whatever mesh and process count
saved them.
"""
import base64
import contextlib
import hashlib
import json
import logging
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from latent_jax import distributed, paths
from latent_jax.train.workdir import move_aside


LIST_ATTEMPTS = 5
TOKENIZER = "tokenizer"  # the item holding the tokenizer file, and its key in meta


class Checkpoints:
  def __init__(self, workdir, keep=2, async_save=True, subdir="checkpoints", read_only=False):
    """Checkpoints in WORKDIR/SUBDIR (TST keeps its phase-1 result apart, in WORKDIR/phase1).

    Only the training opens them writable; with read_only nothing on disk is created, cleaned or
    removed, so a reader cannot disturb a training that is saving.
    """
    self.subdir = subdir
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

  def save(self, step, state, meta, tokenizer):
    """Save the train state {"params", "opt_state", "step"}, a JSON dict and the run's `tokenizer` (a
    data.Tokenizer: its file's name and bytes); the JSON items are written by process 0."""
    file = {"file": tokenizer.filename, "sha256": hashlib.sha256(tokenizer.proto).hexdigest()}
    args = dict(params=ocp.args.StandardSave(state["params"]), opt_state=ocp.args.StandardSave(state["opt_state"]),
                meta=ocp.args.JsonSave({**meta, "step": int(step), TOKENIZER: file}),
                tokenizer=ocp.args.JsonSave({**file, "base64": base64.b64encode(tokenizer.proto).decode()}))
    self.manager.save(step, args=ocp.args.Composite(**args), force=True)

  def read(self, step, **items):
    """The items of `step` ({"params": ocp.args.StandardRestore(target), "meta": ocp.args.JsonRestore()}),
    read by this process alone. Orbax's own restore ends in a barrier over every device, which a
    process whose read failed never reaches, leaving the others there for ever: with several
    processes the caller agrees on the outcome instead (distributed.on_all)."""
    return {item: read_item(os.path.join(self.path(step), item), args) for item, args in items.items()}

  def restore(self, step, abstract_state):
    """Restore into arrays shaped and sharded like `abstract_state`."""
    out = self.read(step, params=ocp.args.StandardRestore(abstract_state["params"]),
                    opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]), meta=ocp.args.JsonRestore())
    # From this host's value: device_put onto devices of several processes checks that every
    # process put the same value, a collective that a process whose read failed would never join.
    step_array = jax.make_array_from_callback((), abstract_state["step"].sharding, lambda _: np.int32(step))
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
    with self.reading(step):
      return self.read(step, params=ocp.args.StandardRestore(abstract_params))["params"]

  def restore_meta(self, step):
    with self.reading(step):
      return self.read(step, meta=ocp.args.JsonRestore())["meta"]

  def restore_tokenizer(self, step):
    """(file name, bytes) of the tokenizer file saved with `step`; None if it has none (saved before
    they were) or its copy does not match its checksum."""
    if not paths.path(os.path.join(self.path(step), TOKENIZER)).is_dir():
      return None
    with self.reading(step):
      saved = self.manager.restore(step, args=ocp.args.Composite(tokenizer=ocp.args.JsonRestore()))[TOKENIZER]
    proto = base64.b64decode(saved["base64"])
    return (saved["file"], proto) if hashlib.sha256(proto).hexdigest() == saved["sha256"] else None

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


def read_item(folder, args):
  """One item folder of a checkpoint (or an export's params), read by this process alone (see
  Checkpoints.read): through Orbax's handler, which has no barrier, not its Checkpointer."""
  handler = ocp.JsonCheckpointHandler() if isinstance(args, ocp.args.JsonRestore) else ocp.StandardCheckpointHandler()
  try:
    return handler.restore(paths.path(paths.absolute(paths.expand(folder))), args=args)  # absolute, as Orbax asks
  finally:
    handler.close()


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


def restore_tokenizer(workdir, log=print):
  """Put the workdir's tokenizer file back from its newest checkpoint that holds one, when the file is
  missing, or is not the file that checkpoint saved (damaged, or another tokenizer): every checkpoint
  of the run depends on its token ids. What was there is moved to WORKDIR/damaged/, never deleted.
  Call on every process (Orbax's managers synchronise them); process 0 writes. Returns the restored
  path, or None when nothing was to do (or no checkpoint holds a tokenizer)."""
  managers = [Checkpoints(workdir, subdir=sub, read_only=True) for sub in ("checkpoints", "phase1")
              if paths.path(os.path.join(workdir, sub)).is_dir()]
  for step, saved in sorted(((s, m) for m in managers for s in m.all_steps()), key=lambda x: x[0], reverse=True):
    try:
      expected = saved.restore_meta(step).get(TOKENIZER)
      found = saved.restore_tokenizer(step) if expected else None
    except Exception:  # pylint: disable=broad-except  # a damaged checkpoint: try the one before it
      continue
    if not expected:
      return None  # saved before checkpoints held the tokenizer: the workdir's file is the only copy
    if found is None:
      continue
    name, proto = found
    path = os.path.join(workdir, name)
    here = paths.path(path).read_bytes() if paths.path(path).is_file() else None
    if here is not None and hashlib.sha256(here).hexdigest() == expected["sha256"]:
      return None

    def put_back():
      why = "is missing"
      if here is not None:
        moved = move_aside(path, workdir, f"not the tokenizer file saved with {saved.path(step)}")
        why = f"is damaged or another tokenizer (not the file saved with the checkpoints; moved to {moved})"
      paths.write_atomic(path, lambda f: f.write(proto))
      log(f"warning: {path} {why}; restored it from {saved.path(step)}, which holds the run's tokenizer")

    distributed.on_primary("restore tokenizer", put_back, OSError)
    return path
  return None


def config_to_json(cfg):
  return json.loads(cfg.to_json_best_effort())
