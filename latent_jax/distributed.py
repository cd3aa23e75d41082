"""Many hosts, one job: joining JAX's distributed runtime, and what only process 0 may do.

Every command line takes FLAGS and calls `initialize(args)` first. The runtime is joined when
the flags, the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables or the
cluster (SLURM's srun, Open MPI's mpirun, a Cloud TPU VM, an indexed Kubernetes Job) say there
are several processes; docs/launch.md has a recipe for each. On CPU the hosts talk over gloo.

Shared files (metrics, the tokenizer, an export's config, a token store) are written by process 0
only. A step that may fail on process 0 alone (the workdir lock, a write, a whole prepare) runs
through `on_primary`: the others wait for its outcome, for as long as it takes, and its error is
raised on every process, so no host is left waiting for a collective that never comes.
"""
import importlib.util
import glob
import itertools
import os
import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

from latent_jax import cli

FLAGS = [
    cli.Flag("coordinator_address", str, None, "HOST:PORT of process 0's coordinator (or $JAX_COORDINATOR_ADDRESS)"),
    cli.Flag("num_processes", int, None, "processes in the job (or $JAX_NUM_PROCESSES)", lambda n: n >= 1, ">= 1"),
    cli.Flag("process_id", int, None, "this process's index, 0..num_processes-1 (or $JAX_PROCESS_ID)",
             lambda i: i >= 0, ">= 0"),
]


def initialize(args):
  """Join the distributed runtime when this is one process of several; a clear error when the
  flags, the environment and the runtime disagree. Call before anything touches a device."""
  quiet_absent_tpu()
  address = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  count = args.num_processes if args.num_processes is not None else env_int("JAX_NUM_PROCESSES")
  index = args.process_id if args.process_id is not None else env_int("JAX_PROCESS_ID")
  cluster, claimed = detect_cluster()
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
  # Only the CPU backend reads this; its default has no cross-process collectives at all.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(address, count, index)
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


def env_int(name):
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer; unset it or set it to a number.") from None


def detect_cluster():
  """(name, processes it runs) from the launcher's environment; ("", 1) outside a cluster.

  These are the environments jax.distributed.initialize() detects by itself; a count of 0 means
  "ask jax" (a Cloud TPU VM or a Kubernetes Job, whose size is looked up at initialisation)."""
  env = os.environ
  if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
    return "SLURM (srun)", int(env["SLURM_NTASKS"])
  if "OMPI_MCA_orte_hnp_uri" in env and "OMPI_COMM_WORLD_SIZE" in env:
    return "Open MPI (mpirun)", int(env["OMPI_COMM_WORLD_SIZE"])
  if importlib.util.find_spec("libtpu") and tpu_present():
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    return "this Cloud TPU slice", len(hosts.split(",")) if hosts else 0
  if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env and importlib.util.find_spec("kubernetes"):
    return "this Kubernetes Job", 0
  return "", 1


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


def barrier(name):
  """Every process waits here until all have arrived (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


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


_ON_PRIMARY = itertools.count()  # every process calls on_primary in the same order: call k is key k
WAIT_SLICE_MS = 60_000


def on_primary(fn, *errors):
  """fn() on process 0 only; the others wait for its outcome however long it takes (a prepare may
  take hours). An error of the kinds `errors` it raises is raised on
  every process (as the same class, with the same message), any other as a RuntimeError naming
  it, so all stop together. Returns fn's result on process 0, None elsewhere.

  The outcome goes through the key-value store of JAX's coordination service, not a device
  collective (which cannot be bounded or cancelled, and whose backend timeout, where it has one,
  is fatal): process 0 writes it, the others read it on the host, waiting in slices of
  WAIT_SLICE_MS. If process 0 dies instead, the service (which runs in it) ends the others.
  """
  if jax.process_count() == 1:
    return fn()
  key, client = f"latent_jax/on_primary/{next(_ON_PRIMARY)}", coordination_client()
  if is_primary():
    try:
      result = fn()
    except BaseException as e:
      client.key_value_set(key, f"{type(e).__name__}\n{e}")
      raise
    client.key_value_set(key, "ok")
    return result
  while True:
    try:
      message = client.blocking_key_value_get(key, WAIT_SLICE_MS)
      break
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" not in str(e):
        raise
  if message != "ok":
    name, text = message.split("\n", 1)
    kinds = {e.__name__: e for e in errors}
    raise kinds[name](text) if name in kinds else RuntimeError(f"process 0 failed: {name}: {text}")
  return None


def coordination_client():
  """The client of JAX's coordination service (jax has no public accessor; Orbax reads it the same way)."""
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
