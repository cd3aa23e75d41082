"""Many hosts, one job: joining JAX's distributed runtime, what only process 0 may do, and how
the processes agree.

Every command line takes FLAGS and calls `initialize(args)` first. The runtime is joined when
the flags, the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables or the
cluster (SLURM's srun, Open MPI's mpirun, a Cloud TPU VM, an indexed Kubernetes Job) say there
are several processes; docs/launch.md has a recipe for each. On CPU the hosts talk over gloo. On
GPU nodes every process drives the GPUs it is given (`local_device_ids`): with one process per
node all of the node's, with one per GPU its own.

Shared files (metrics, the tokenizer, an export's config, a token store) are written by process 0
only. A step that may fail on process 0 alone (the workdir lock, a write, a whole prepare) runs
through `on_primary`: the others wait for its outcome, for as long as it takes, and its error is
raised on every process. A step every process takes that may fail on some only (reading a
checkpoint) runs through `on_all`, and `barrier` only meets.

These are agreements, named by their callers ("workdir lock", "restore checkpoints/8"): the k-th
agreement of a name on one process pairs with the k-th of that name on the others only, so
processes that took different paths never pair up. A process waits --agreement_timeout seconds
for the others to arrive; then every process stops with the same one-line error naming the
agreement and who did not arrive. An error that ends one process (cli.errors) ends the others at
their next agreement with its message. The agreements go through the key-value store of JAX's
coordination service, not device collectives: those cannot be bounded or cancelled, and their
backend's timeout, where there is one, is fatal.
"""
import collections
import glob
import importlib.util
import json
import os
import signal
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

TIMEOUT_S = 600.0  # how long a process waits for the others at an agreement: --agreement_timeout (initialize)
SLURM = "SLURM (srun)"
OPEN_MPI = "Open MPI (mpirun)"


def initialize(args):
  """Join the distributed runtime when this is one process of several; a clear error when the
  flags, the environment and the runtime disagree. Call before anything touches a device."""
  global TIMEOUT_S  # pylint: disable=global-statement
  TIMEOUT_S = args.agreement_timeout
  quiet_absent_tpu()
  address = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  count = args.num_processes if args.num_processes is not None else env_int("JAX_NUM_PROCESSES")
  index = args.process_id if args.process_id is not None else env_int("JAX_PROCESS_ID")
  cluster, claimed = detect_cluster(os.environ)
  if count is not None and claimed > 1 and count != claimed:
    raise ValueError(f"--num_processes={count} but {cluster} runs {claimed} processes; drop --num_processes "
                     "(the cluster's count is used) or launch as many processes as it says.")
  if count is not None and index is not None and not index < count:
    raise ValueError(f"--process_id={index} is not below --num_processes={count}; processes are numbered 0..{count - 1}.")
  expected = count or claimed
  if expected == 1 and address is None:
    return  # one process: no runtime to join
  if jax.distributed.is_initialized():
    return
  devices = local_device_ids(os.environ)
  # Only the CPU backend reads this; its default has no cross-process collectives at all.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(address, count, index, local_device_ids=devices)
  except (ValueError, TypeError, RuntimeError) as e:
    missing = [f for f, v in (("--coordinator_address", address), ("--num_processes", count),
                              ("--process_id", index)) if v is None]
    hint = (f"give {' and '.join(missing)} (or the JAX_* variables), or launch under a cluster jax detects "
            "(docs/launch.md)" if missing and claimed == 1 else "check that every process got the same address and count, "
            "and that process 0 is running")
    raise ValueError(f"the distributed runtime did not start ({' '.join(str(e).split())[:300]}); {hint}.") from None
  if expected and jax.process_count() != expected:
    raise ValueError(f"{cluster if claimed > 1 else '--num_processes'} says {expected} processes but the runtime "
                     f"has {jax.process_count()}; launch every process with the same settings.")


def env_int(name, env=os.environ):
  value = env.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer; unset it or set it to a number.") from None


def detect_cluster(env):
  """(name, processes it runs) from the launcher's environment; ("", 1) outside a cluster.

  These are the environments jax.distributed.initialize() detects by itself; a count of 0 means
  "ask jax" (a Cloud TPU VM or a Kubernetes Job, whose size is looked up at initialisation)."""
  if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
    return SLURM, int(env["SLURM_NTASKS"])
  if "OMPI_MCA_orte_hnp_uri" in env and "OMPI_COMM_WORLD_SIZE" in env:
    return OPEN_MPI, int(env["OMPI_COMM_WORLD_SIZE"])
  if importlib.util.find_spec("libtpu") and tpu_present():
    # TPU_WORKER_HOSTNAMES lists one slice's hosts; a multislice job runs MEGASCALE_NUM_SLICES of them.
    hosts, slices = env.get("TPU_WORKER_HOSTNAMES", ""), env_int("MEGASCALE_NUM_SLICES", env) or 1
    if slices > 1:
      return f"these {slices} Cloud TPU slices", len(hosts.split(",")) * slices if hosts else 0
    return "this Cloud TPU slice", len(hosts.split(",")) if hosts else 0
  if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env and importlib.util.find_spec("kubernetes"):
    return "this Kubernetes Job", 0
  return "", 1


NVIDIA_DEVICES = "/dev/nvidia[0-9]*"  # a node's GPUs, where no launcher variable lists them


def local_device_ids(env):
  """The local GPUs this process drives, for jax.distributed.initialize, when SLURM or Open MPI
  runs it; None leaves them to jax (every visible device joins).

  jax itself gives each such process one GPU, its local rank's, which suits one process per GPU
  but drives only the first GPU of a node that runs one process. Here a process that sees fewer
  GPUs than the node gives the job step (srun --gpus-per-task, --gpu-bind) or fewer than there
  are processes on the node drives all it sees; processes that see all of the node's GPUs split
  them in order: one process per node drives all, one per GPU its local rank's. $JAX_LOCAL_DEVICE_IDS
  overrides this (jax reads it).
  """
  cluster, _ = detect_cluster(env)
  if env.get("JAX_LOCAL_DEVICE_IDS") or cluster not in (SLURM, OPEN_MPI):
    return None
  if cluster == SLURM:
    rank, tasks, node_gpus = env_int("SLURM_LOCALID", env), slurm_tasks_on_node(env), env_int("SLURM_GPUS_ON_NODE", env)
  else:
    rank, tasks, node_gpus = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env), env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env), None
  visible = visible_gpus(env)
  if rank is None or not tasks or not visible:
    return None  # not known, or no GPU here: jax's choice does no harm
  if visible < tasks or (node_gpus and visible < node_gpus):
    return list(range(visible))  # the launcher gave this process its own GPUs
  if visible % tasks:
    raise ValueError(f"{cluster} runs {tasks} processes on this node, which has {visible} GPUs: launch one process "
                     f"per node, one per GPU, or a number of processes per node that divides {visible} (docs/launch.md).")
  share = visible // tasks
  return list(range(rank * share, (rank + 1) * share))


def slurm_tasks_on_node(env):
  """Processes of this job step on this node: SLURM_STEP_TASKS_PER_NODE ("8(x2),4", by
  SLURM_NODEID), else --ntasks-per-node, else the job's SLURM_TASKS_PER_NODE; None if unset."""
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    if env.get(name):
      try:
        counts = [int(n) for part in env[name].split(",") for n, _, times in [part.partition("(x")]
                  for _ in range(int(times.rstrip(")") or 1))]
      except ValueError:
        raise ValueError(f"${name}={env[name]!r} is not a SLURM task count (like 8 or 8(x2),4).") from None
      return counts[min(env_int("SLURM_NODEID", env) or 0, len(counts) - 1)]
  return None


def visible_gpus(env):
  """How many GPUs this process sees: the entries of CUDA_VISIBLE_DEVICES (ROCR_VISIBLE_DEVICES on
  AMD), else the node's GPUs as SLURM counts them, else as /dev lists them."""
  for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
    if name in env:  # SLURM writes NoDevFiles where a step has no GPU
      return len([d for d in env[name].split(",") if d.strip() and d.strip() != "NoDevFiles"])
  gpus = env_int("SLURM_GPUS_ON_NODE", env)
  return gpus if gpus is not None else len(glob.glob(NVIDIA_DEVICES))


def tpu_present():
  """Whether this machine has TPU chips (their device files)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_absent_tpu():
  """Keep an installed libtpu (the `tpu` extra, which plan needs for TPU slices) quiet on a machine
  without a TPU. At start-up jax loads it to look for one, and libtpu prints warnings (no
  TPU_ACCELERATOR_TYPE, no TPU_WORKER_HOSTNAMES) and takes /tmp/libtpu_lockfile, which one process
  at a time may hold. JAX_PLATFORMS=cpu, jax's documented way to skip other backends, skips the
  probe where no GPU is either (a JAX_PLATFORMS of the user's is kept); one host's
  TPU_WORKER_HOSTNAMES and TPU_HOST_BOUNDS, the machine's true description, quiet plan's own load."""
  if importlib.util.find_spec("libtpu") is None or tpu_present():
    return
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
  gpu = glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")  # NVIDIA's, AMD's
  if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms and not gpu:
    jax.config.update("jax_platforms", "cpu")


def describe(mesh=None):
  """The start-up line: process i of n, local and global devices, and the mesh."""
  devices = jax.devices()
  line = (f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local / "
          f"{len(devices)} global {devices[0].platform} devices")
  if mesh is not None:
    line += "; mesh " + " ".join(f"{k}={v}" for k, v in mesh.shape.items())
  return line


def joined():
  """Whether this process joined a runtime of several processes (without starting a backend otherwise)."""
  return jax.distributed.is_initialized() and jax.process_count() > 1


def is_primary():
  return jax.process_index() == 0


def from_primary(value):
  """Process 0's numpy value (a scalar or array of the same shape everywhere) on every process."""
  return value if jax.process_count() == 1 else multihost_utils.broadcast_one_to_all(np.asarray(value))


def broadcast_bytes(data):
  """Process 0's `data` (bytes; ignored elsewhere) on every process."""
  if jax.process_count() == 1:
    return data
  size = int(from_primary(np.int32(len(data) if is_primary() else 0)))
  buffer = np.frombuffer(data, np.uint8) if is_primary() else np.zeros(size, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()


# ----------------------------------------------------------------------------- agreements

POLL_S = 1.0  # how often a waiting process looks whether another has stopped them all
KEYS = "latent_jax"  # the coordination service's key-value store: KEYS/NAME#K/..., KEYS/stop, KEYS/reached/I
_made = collections.Counter()  # agreements made so far, by name


class Disagreement(ValueError):
  """The processes took different paths: a step failed on some only, or some did not arrive.
  (A ValueError, so that a command ends with its one `error:` line.)"""


def on_primary(name, fn, *errors):
  """fn() on process 0 only, once every process has reached the agreement `name`; the others wait
  for its outcome however long it takes (a prepare may take hours). An error of the kinds `errors`
  it raises is raised on every process (as the same class, with the same message), any other as a
  RuntimeError naming it, so all stop together. Returns fn's result on process 0, None elsewhere.
  If process 0 dies instead, the coordination service (which runs in it) ends the others.
  """
  if jax.process_count() == 1:
    return fn()
  key = next_key(name)
  gather(key, name, "")
  client = coordination_client()
  if is_primary():
    try:
      result = fn()
    except BaseException as e:
      client.key_value_set(f"{key}/outcome", f"{type(e).__name__}\n{e}")
      raise
    client.key_value_set(f"{key}/outcome", "ok")
    return result
  message = wait_for(f"{key}/outcome", None, key, name)
  if message != "ok":
    kind, text = message.split("\n", 1)
    kinds = {e.__name__: e for e in errors}
    raise kinds[kind](text) if kind in kinds else RuntimeError(f"process 0 failed: {kind}: {text}")
  return None


def on_all(name, fn, advice):
  """fn() on every process, then the agreement `name` on its outcome: fn's result where it
  succeeded everywhere; where it failed everywhere, each process's own error; where it failed on
  some processes only, the same Disagreement on all, naming them and their error, then `advice`
  (what to check: the message must read the same on every host, so nothing host-local)."""
  if jax.process_count() == 1:
    return fn()
  try:
    result, error, outcome = fn(), None, ""
  except Exception as e:  # pylint: disable=broad-except  # told to the others, then raised
    text = str(e).strip()
    result, error, outcome = None, e, f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]
  outcomes = gather(next_key(name), name, outcome)
  failed = [i for i, o in enumerate(outcomes) if o]
  if 0 < len(failed) < len(outcomes):
    raise Disagreement(f"{name} failed on {processes(failed)} ({outcomes[failed[0]]}) but not on the others: {advice}")
  if error is not None:
    raise error
  return result


def barrier(name):
  """Every process waits here until all have reached the agreement `name` (a no-op with one process)."""
  if jax.process_count() > 1:
    gather(next_key(name), name, "")


def next_key(name):
  """The key of this process's next agreement called `name`: its k-th pairs with every other's k-th."""
  k = _made[name]
  _made[name] += 1
  return f"{KEYS}/{name}#{k}"


def gather(key, name, value):
  """Every process's `value` (a str) at the agreement `key`, by process index. Each process posts
  its own; process 0 collects them and posts the list, which the others read: 2n messages."""
  client, me = coordination_client(), jax.process_index()
  client.key_value_set(f"{KEYS}/reached/{me}", name, allow_overwrite=True)  # for a timeout's message
  client.key_value_set(f"{key}/{me}", value)
  deadline = time.monotonic() + TIMEOUT_S
  if me:
    return json.loads(wait_for(f"{key}/all", deadline, key, name))
  values = [value] + [wait_for(f"{key}/{i}", deadline, key, name) for i in range(1, jax.process_count())]
  client.key_value_set(f"{key}/all", json.dumps(values))
  return values


def wait_for(entry, deadline, key, name):
  """The value of `entry`, once posted; a Disagreement if another process stopped all of them
  meanwhile, or (with a deadline) if not every process reached the agreement in time."""
  client = coordination_client()
  while True:
    left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
    if left <= 0:
      message = timed_out(key, name)
      if message:
        raise Disagreement(stop_all(message))
      deadline, left = None, POLL_S  # all arrived just now: process 0 is posting the outcome
    try:
      return client.blocking_key_value_get(entry, max(1, int(left * 1000)))
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" not in str(e):
        raise
    stopped = try_get(f"{KEYS}/stop")
    if stopped is not None:
      raise Disagreement(stopped)


def timed_out(key, name):
  """The message for the processes that did not reach agreement `key` (`name`) in time; None if all have."""
  arrived = {k.rsplit("/", 1)[1] for k, _ in coordination_client().key_value_dir_get(f"{key}/")}
  missing = [i for i in range(jax.process_count()) if str(i) not in arrived]
  if not missing:
    return None
  where = "; ".join(f"process {i} was last at {last!r}" if (last := try_get(f"{KEYS}/reached/{i}"))
                    else f"process {i} met the others nowhere yet" for i in missing[:4])
  return (f"{processes(missing)} did not reach {name!r}, where every process meets, within --agreement_timeout="
          f"{TIMEOUT_S:g} s ({where}{'; ...' if len(missing) > 4 else ''}): the processes took different paths (a "
          "step failed on some hosts only: see their logs) or a host is stuck; if it is only slow, raise "
          "--agreement_timeout.")


def stop_all(message):
  """Stop every process at its next agreement with `message`; returns the message they stop with:
  the first one given, should several processes stop at once."""
  client = coordination_client()
  try:
    client.key_value_set(f"{KEYS}/stop", message)
    return message
  except jax.errors.JaxRuntimeError as e:
    if "ALREADY_EXISTS" not in str(e):
      raise
    return client.key_value_try_get(f"{KEYS}/stop")


def stop_others(line):
  """After an error that ends this process: the others stop at their next agreement with it,
  instead of waiting for the timeout. Never raises: it runs on the way out."""
  if not joined():
    return
  try:
    stop_all(f"process {jax.process_index()} stopped: {line}")
  except jax.errors.JaxRuntimeError:
    pass  # the coordination service is gone (process 0 ended): the runtime ends the others


def try_get(key):
  try:
    return coordination_client().key_value_try_get(key)
  except jax.errors.JaxRuntimeError as e:
    if "NOT_FOUND" not in str(e):
      raise
    return None


def processes(indices):
  """"process 3", "processes 1, 2", or with many "processes 1, ..., 8 and 991 more"."""
  shown = ", ".join(map(str, indices[:8])) + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")
  return f"process {shown}" if len(indices) == 1 else f"processes {shown}"


def coordination_client():
  """The client of JAX's coordination service. jax has no public accessor (Orbax reads it the same
  way); tests/test_internals.py fails, naming it, if an upgrade moves it."""
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  return jax_distributed.global_state.client


class StopRequests:
  """SIGTERM (a preemption) or Ctrl-C asks the run to save a checkpoint and stop; a second
  Ctrl-C gives up at once. With several processes the stop is agreed through JAX's preemption
  sync point, so every host stops after the same step, whichever host got the signal."""

  def __init__(self):
    self.local = False
    self.shared = jax.process_count() > 1
    # With the runtime, SIGTERM belongs to its preemption notifier (a C handler Python must not
    # replace); Ctrl-C is passed on to it as a SIGTERM.
    for sig in (signal.SIGINT,) if self.shared else (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self.request)

  def request(self, signum, frame):
    if self.local:
      raise KeyboardInterrupt
    self.local = True
    if self.shared:
      os.kill(os.getpid(), signal.SIGTERM)

  def after(self, step):
    """Whether to stop after `step`; with several processes, call it at every step on every host."""
    return multihost_utils.reached_preemption_sync_point(step) if self.shared else self.local
