"""Orbax checkpoints of a run: params, optimiser state and metadata; written by the training, read by
it and by everything that loads a model (eval, generate, export, draft, convert, train.init_from).

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
saved them. A checkpoint that cannot be read is moved to WORKDIR/damaged/ (`move_aside`), never deleted.

Readers also take an export folder (`python -m latent_jax.export`): it holds `params/`,
`config.json` and the tokenizer file, where a workdir keeps the config in each checkpoint's
metadata and the tokenizer file beside them.
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
from flax import nnx

from latent_jax.config import config_from_json, lora_enabled
from latent_jax import distributed, paths, sharding
from latent_jax.data.tokenizer import Tokenizer, find_tokenizer
from latent_jax.nn import abstract_model
from latent_jax.nn.lora import apply_lora, lora_merge, without_factors

LIST_ATTEMPTS = 5
TOKENIZER = "tokenizer"  # the item holding the tokenizer file, and its key in meta
DAMAGED_DIRNAME = "damaged"


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
  return {name: tuple(x.shape) for name, x in by_path(tree).items()}


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


def move_aside(path, workdir, reason):
  """Move a damaged checkpoint folder to WORKDIR/damaged/<parent>-<step>[-k], with the reason beside
  it in <parent>-<step>[-k].txt; returns the new path."""
  folder = os.path.join(workdir, DAMAGED_DIRNAME)
  paths.path(folder).mkdir(parents=True, exist_ok=True)
  base = os.path.join(folder, f"{os.path.basename(os.path.dirname(path))}-{os.path.basename(path)}")
  target, k = base, 1
  while paths.path(target).exists() or paths.path(target + ".txt").exists():
    target, k = f"{base}-{k}", k + 1
  # Written first, it also makes the folder, which in a bucket exists only once it holds a file.
  paths.path(target + ".txt").write_text(f"{path} was unreadable: {reason}\n")
  paths.path(path).rename(target)
  return target


READ_ATTEMPTS = 10  # reads of a newest step that a training removed meanwhile, before giving up


def is_export(directory):
  return paths.path(os.path.join(directory, "config.json")).is_file() and paths.path(os.path.join(directory, "params")).is_dir()


def find_checkpoint(directory, step=None):
  """(manager, step) of the given or newest checkpoint: regular ones, or a TST phase-1 result."""
  managers = [Checkpoints(directory, subdir=sub, read_only=True) for sub in ("checkpoints", "phase1")
              if paths.path(os.path.join(directory, sub)).is_dir()]
  found = [(s, m) for m in managers for s in m.manager.all_steps() if step is None or s == step]
  if not found:
    saved = sorted(s for m in managers for s in m.manager.all_steps())
    if saved:  # a step that is not there: name those that are
      raise FileNotFoundError(f"--workdir {directory!r} has no checkpoint at step {step}; its checkpoints are at steps "
                              f"{', '.join(map(str, saved))}: pass one of them to --step, or leave --step out for the newest.")
    raise FileNotFoundError(f"--workdir {directory!r} has no checkpoints and is not an export folder; "
                            f"train first (python -m latent_jax.train ... --workdir {directory}).")
  step, manager = max(found, key=lambda x: x[0])
  return manager, step


def read_newest(directory, step, read):
  """read(step) for the given step, or, when `step` is None, for the workdir's newest checkpoint.

  A training saving into the workdir meanwhile removes its older steps (train.keep_checkpoints),
  maybe the one being read; what that raises depends on which file went first (KeyError,
  FileNotFoundError, ValueError or a bare Exception from Orbax). So a failed read is judged by the
  listing, not by its type: when the newest step has changed since it was chosen, the newest is read instead; a
  step that is still the newest failed for another reason (damage), raised as it is. A step given
  by number, an export folder and a multi-host reader (whose processes would each choose their own
  step) read once.
  """
  if step is not None or is_export(directory) or jax.process_count() > 1:
    return read(step)
  for _ in range(READ_ATTEMPTS):
    _, chosen = find_checkpoint(directory)
    try:
      return read(chosen)
    except Exception as e:  # pylint: disable=broad-except  # judged by the listing below, else raised
      if find_checkpoint(directory)[1] == chosen:
        raise
      last = f"{type(e).__name__}: {e}"
  raise FileNotFoundError(f"--workdir {directory!r}: the training saving there removed the newest checkpoint while "
                          f"it was being read, {READ_ATTEMPTS} times in a row (last: {last[:300]}); read it once the "
                          "training has finished, or train with a larger train.keep_checkpoints.")


def load_config(directory, step=None):
  """(config, step) of a workdir's latest (or given) checkpoint, or of an export folder. A workdir's
  lost or damaged tokenizer file is restored from its checkpoints first (restore_tokenizer)."""
  if is_export(directory):
    return config_from_json(json.loads(paths.path(os.path.join(directory, "config.json")).read_text())), None
  manager, step = find_checkpoint(directory, step)
  restore_tokenizer(directory)
  return config_from_json(manager.restore_meta(step)["config"]), step


def placement(cfg, mesh=None):
  """{"a/b/c": NamedSharding} of every parameter a checkpoint of `cfg` holds, on `mesh`; by default
  sharding.inference_mesh's: the training's layout wherever the devices here allow it."""
  mesh = mesh or sharding.inference_mesh(cfg.mesh)
  _, saved = abstract_model(cfg)
  return by_path(nnx.to_pure_dict(sharding.state_shardings(saved, mesh)))


def saved_params(directory, cfg, step=None, shardings=None):
  """Every parameter the checkpoint (or export) holds, training-only heads included, placed by
  `shardings` ({"a/b/c": sharding}) where given, else as `placement(cfg)`: whatever mesh and
  number of processes saved them. A LoRA run's adapters come merged into their weights (`merge_lora`)."""
  _, saved = abstract_model(cfg)
  shardings = {**placement(cfg), **(shardings or {})}
  target = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[path_name(p)]),
      nnx.to_pure_dict(saved))
  if is_export(directory):
    read = lambda: read_item(os.path.join(directory, "params"), ocp.args.StandardRestore(target))
  else:
    manager, step = find_checkpoint(directory, step)
    read = lambda: manager.restore_params(step, target)
  params = distributed.on_all("load params", read, "those hosts read a damaged part of them, or see the shared "
                              "file system differently (a stale or missing mount); check them.")
  return merge_lora(params, cfg)


def merge_lora(params, cfg):
  """The params of a LoRA run (lora.enabled) as a plain model's: each adapted weight W + alpha / r * A @ B on
  W's sharding, the factors dropped (nn/lora.py); other runs' as they are."""
  if not lora_enabled(cfg):
    return params
  merge = lambda w, a, b, scale: jax.jit(lora_merge, out_shardings=w.sharding)(w, a, b, scale)
  return without_factors(apply_lora(params, cfg.lora.alpha, merge))


def check_init_from(directory, cfg, params, step=None):
  """(source config, step) of train.init_from = `directory` (its newest checkpoint, or `step`),
  once every parameter of `params` (this run's, arrays or abstract) is known to be there with its
  shape: anything but a training-only head (NITP, MTP, a drafter) that the source lacks means the models
  differ, an error."""
  if not (is_export(directory) or any(paths.path(os.path.join(directory, sub)).is_dir() for sub in ("checkpoints", "phase1"))):
    raise FileNotFoundError(f"train.init_from: {directory!r} is neither a training workdir with checkpoints nor "
                            "an export folder; give a run's --workdir or a `python -m latent_jax.export` folder.")
  source_cfg, step = load_config(directory, step)
  source = by_path(without_factors(nnx.to_pure_dict(abstract_model(source_cfg)[1])))  # a LoRA source's: merged
  inference = by_path(nnx.to_pure_dict(abstract_model(cfg.model)[1]))
  for name, x in by_path(params).items():
    if name not in source and name in inference:
      raise ValueError(f"train.init_from: {directory} has no parameter {name!r}; its model config differs from "
                       f"this run's (source model.name={source_cfg.model.name!r}); start from a run of the same model.")
    if name in source and source[name].shape != x.shape:
      raise ValueError(f"train.init_from: parameter {name!r} is {source[name].shape} in {directory} but {x.shape} "
                       "here; the model configs differ, copy the source's model section.")
  return source_cfg, step


def initial_params(directory, cfg, fresh):
  """The params a run starts from with train.init_from = `directory`: each of `fresh` (this run's
  initialised params) replaced by the source's, in fresh's dtype and sharding, except
  training-only heads the source was trained without, which keep their fresh init."""
  placed = {name: x.sharding for name, x in by_path(fresh).items()}

  def read(step):  # the source may be a run still training
    source_cfg, step = check_init_from(directory, cfg, fresh, step)
    return by_path(saved_params(directory, source_cfg, step, placed))
  source = read_newest(directory, None, read)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: source[path_name(p)].astype(x.dtype) if path_name(p) in source else x, fresh)


def path_name(path):
  """"a/0/c" of a key path; an nnx.List's int index is written as its digits."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def by_path(tree):
  """{"a/b/c": leaf} of a pytree (the keys of checkpoint.placement and of the names on disk)."""
  return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load_tokenizer(directory, cfg):
  path = find_tokenizer(directory) or cfg.data.tokenizer
  if not path or not paths.path(path).is_file():
    raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {directory!r} and data.tokenizer="
                            f"{cfg.data.tokenizer!r} is not a file; copy the run's tokenizer file there.")
  return Tokenizer(path)
