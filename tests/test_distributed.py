"""How processes join and agree: the GPUs each process drives under SLURM and Open MPI (the
arguments that reach jax.distributed.initialize, from the launchers' variables), and agreements
between real local processes (gloo on CPU) that take different paths."""
import os
import shutil
import subprocess
import sys
import time
import types

import jax
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import distributed
from test_multihost import free_port

# What srun sets in every task of a job step on 2 nodes (SLURM_PROCID and SLURM_LOCALID vary by task).
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}
EIGHT = "0,1,2,3,4,5,6,7"


@pytest.fixture
def launcher_env(monkeypatch, tmp_path):
  """Clears every variable the choice reads, and /dev's GPUs, so that each case sets its own."""
  for name in [*SLURM, "SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
               "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS",
               "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(distributed, "NVIDIA_DEVICES", str(tmp_path / "nvidia[0-9]*"))

  def put(**env):
    for name, value in env.items():
      monkeypatch.setenv(name, value)
  return put


# (variables, local_device_ids): what SLURM sets for each layout, and the GPUs (indices among
# those the process sees) that the process must drive.
SLURM_LAYOUTS = [
    # srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8: one process per node drives all 8
    (dict(SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NTASKS_PER_NODE="1",
          SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES=EIGHT), list(range(8))),
    # the same where only --ntasks-per-node and SLURM's GPU count say it (no CUDA_VISIBLE_DEVICES)
    (dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="4"), [0, 1, 2, 3]),
    # srun --ntasks-per-node=8 --gpus-per-node=8: one process per GPU, each sees 8: its local rank's
    (dict(SLURM_NTASKS="16", SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_LOCALID="3", SLURM_PROCID="11",
          SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES=EIGHT), [3]),
    # srun --ntasks-per-node=8 --gpus-per-task=1: each task sees only its own GPU (jax's own choice,
    # its local rank 3, is a GPU it does not have)
    (dict(SLURM_NTASKS="16", SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_LOCALID="3", SLURM_PROCID="11",
          SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="3"), [0]),
    # two processes per node sharing 8 GPUs: the second drives the upper four
    (dict(SLURM_NTASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_LOCALID="1", SLURM_PROCID="3",
          CUDA_VISIBLE_DEVICES=EIGHT), [4, 5, 6, 7]),
    # an uneven step, 4 tasks on the first node and 1 on this (the second) one: all 4 of its GPUs
    (dict(SLURM_NTASKS="5", SLURM_STEP_TASKS_PER_NODE="4,1", SLURM_PROCID="4", CUDA_VISIBLE_DEVICES="0,1,2,3"),
     [0, 1, 2, 3]),
    # a CPU step (SLURM writes NoDevFiles): nothing to choose, jax's default is harmless
    (dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES="NoDevFiles"), None),
    # the user's own choice, which jax reads
    (dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES=EIGHT, JAX_LOCAL_DEVICE_IDS="0,1"), None),
]


@pytest.mark.parametrize("env, expected", SLURM_LAYOUTS)
def test_slurm_variables_reach_jax_distributed_initialize(launcher_env, monkeypatch, env, expected):
  launcher_env(**{**SLURM, **env})
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax, "process_count", lambda: int(env["SLURM_NTASKS"]))
  old = jax.config.jax_cpu_collectives_implementation
  try:
    distributed.initialize(types.SimpleNamespace(coordinator_address=None, num_processes=None, process_id=None,
                                                 agreement_timeout=600.0))
  finally:
    jax.config.update("jax_cpu_collectives_implementation", old)
  # The address, count and index are left to jax's own SLURM detection; the GPUs are chosen here.
  assert calls == [((None, None, None), {"local_device_ids": expected})]


def test_local_devices_of_open_mpi_and_of_a_node_only_dev_lists(launcher_env, tmp_path):
  # mpirun -npernode 1 on nodes of 4 GPUs that no variable lists: /dev's GPUs count.
  for i in range(4):
    (tmp_path / f"nvidia{i}").touch()
  (tmp_path / "nvidiactl").touch()
  launcher_env(OMPI_MCA_orte_hnp_uri="1.0;tcp://10.0.0.1:5000", OMPI_COMM_WORLD_SIZE="2",
               OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="1")
  assert distributed.local_device_ids(os.environ) == [0, 1, 2, 3]
  launcher_env(OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="4")  # -npernode 4: one GPU each
  assert distributed.local_device_ids(os.environ) == [1]
  launcher_env(**SLURM, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1")  # SLURM first, as jax looks
  assert distributed.local_device_ids(os.environ) == [0, 1, 2, 3]


def test_processes_that_cannot_split_a_node_are_an_error(launcher_env):
  launcher_env(**SLURM, SLURM_NTASKS="6", SLURM_STEP_TASKS_PER_NODE="3(x2)", CUDA_VISIBLE_DEVICES=EIGHT)
  with pytest.raises(ValueError, match=r"SLURM \(srun\) runs 3 processes on this node, which has 8 GPUs"):
    distributed.local_device_ids(os.environ)
  launcher_env(SLURM_STEP_TASKS_PER_NODE="eight")
  with pytest.raises(ValueError, match=r"\$SLURM_STEP_TASKS_PER_NODE='eight' is not a SLURM task count"):
    distributed.local_device_ids(os.environ)


def test_a_multislice_tpu_job_counts_every_slices_hosts(monkeypatch):
  """TPU_WORKER_HOSTNAMES lists one slice's hosts; MEGASCALE_NUM_SLICES says how many slices run."""
  find_spec = distributed.importlib.util.find_spec  # a TPU VM: libtpu installed, TPU chips present
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu"
                      else find_spec(name, *a))
  monkeypatch.setattr(distributed, "tpu_present", lambda: True)
  env = {"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}
  assert distributed.detect_cluster(env) == ("this Cloud TPU slice", 4)
  assert distributed.detect_cluster({**env, "MEGASCALE_NUM_SLICES": "2"}) == ("these 2 Cloud TPU slices", 8)


# ----------------------------------------------------------------------------- agreements

AGREE = """
import sys
import jax
from latent_jax import cli, distributed
with cli.errors():
  args = cli.parse("", cli.DISTRIBUTED, sys.argv[2:])
  distributed.initialize(args)
  me = jax.process_index()
  distributed.on_primary("workdir lock", lambda: None)
  if sys.argv[1] == "paths":  # the two take different paths from here, and wait 3 s for each other
    distributed.TIMEOUT_S = 3
    distributed.on_primary("tokenizer" if me == 0 else "move aside checkpoints/8", lambda: None)
  elif me == 1:
    raise ValueError("process 1 found bad input")
  distributed.barrier("end")
"""


def run_together(commands, env=None, timeout=300):
  """Start the commands at once; (their exit codes, their `error:` lines, seconds until the last ended)."""
  start = time.monotonic()
  procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for c in commands]
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  errors = [[line for line in out.splitlines() if line.startswith("error:")] for out in outs]
  return [p.returncode for p in procs], errors, time.monotonic() - start


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_processes_on_different_paths_stop_together_with_one_error():
  port = free_port()
  agree = lambda mode: [[sys.executable, "-c", AGREE, mode, f"--coordinator_address=127.0.0.1:{port}",
                         "--num_processes=2", f"--process_id={i}", "--agreement_timeout=600"] for i in range(2)]
  # Process 0 at "tokenizer", process 1 at "move aside": each waits for the other at its own
  # agreement (never pairing with the other's), and both end at the timeout with the same line.
  codes, errors, _ = run_together(agree("paths"))
  assert codes == [2, 2] and errors[0] == errors[1] and len(errors[0]) == 1, errors
  line = errors[0][0]  # whichever process timed out first words it, naming both places
  assert "did not reach" in line and "within --agreement_timeout=3 s" in line, line
  assert "'tokenizer'" in line and "'move aside checkpoints/8'" in line, line
  # An error that ends process 1 ends process 0, waiting at "end", with its message at once.
  port = free_port()
  codes, errors, seconds = run_together(agree("error"))
  assert codes == [2, 2], errors
  assert errors == [["error: process 1 stopped: process 1 found bad input"], ["error: process 1 found bad input"]]
  assert seconds < 300, seconds  # not the 600 s timeout


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus_dir):
  """conftest's corpus as a token store (several processes train from a store)."""
  from latent_jax import load_config, prepare
  out = tmp_path_factory.mktemp("store") / "store"
  prepare.prepare(load_config(TINY, ["model.vocab_size=320", f"data.source={corpus_dir}"]), str(out), log=lambda *a: None)
  return str(out)


def save_fresh_checkpoint(workdir, cfg, step):
  """A checkpoint at `step` as a training of `cfg` saves it (of a fresh state: what it holds does
  not matter here), written by this process without compiling a train step."""
  from latent_jax import checkpoint, sharding
  from latent_jax.data import Tokenizer, find_tokenizer
  from latent_jax.nn import abstract_model, axes_tree
  from latent_jax.train import step as steps
  from latent_jax.train.optim import build_optimizer
  _, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  state = steps.init_state(cfg, cfg.train.seed, tx, steps.state_shardings(abstract, tx, sharding.make_mesh(cfg.mesh)))
  saved = checkpoint.Checkpoints(str(workdir), async_save=False)
  saved.save(step, state, {"config": checkpoint.config_to_json(cfg)}, Tokenizer(find_tokenizer(cfg.data.source)))
  saved.close()


def test_a_restore_that_fails_on_one_process_only_stops_both_with_one_error(tmp_path, store):
  """Process 1 sees a damaged copy of the checkpoint that process 0 reads whole (as a host with a
  stale view of the shared file system would): both stop with the same error, nothing moved."""
  from latent_jax import load_config
  overrides = [*TINY_OVERRIDES, f"data.source={store}", "train.steps=3"]
  whole, seen_by_1 = tmp_path / "whole", tmp_path / "seen_by_1"
  save_fresh_checkpoint(whole, load_config(TINY, overrides + ["mesh.data=1", "mesh.fsdp=1"]), 1)
  shutil.copytree(whole, seen_by_1)
  for folder in (seen_by_1 / "checkpoints" / "1" / "params").rglob("d"):
    for f in folder.iterdir():  # the arrays' bytes zeroed; their metadata intact
      f.write_bytes(bytes(f.stat().st_size))

  port = free_port()
  train = [sys.executable, "-m", "latent_jax.train", "--config", TINY, *[f"--config.{o}" for o in overrides],
           "--config.mesh.data=1", "--config.mesh.fsdp=2"]
  codes, errors, _ = run_together(
      [train + ["--workdir", str(workdir), f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                f"--process_id={i}", "--agreement_timeout=120"] for i, workdir in enumerate((whole, seen_by_1))],
      env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert codes == [2, 2] and errors[0] == errors[1] and len(errors[0]) == 1, errors
  line = errors[0][0]
  assert line.startswith("error: restore checkpoints/1 failed on process 1 (") and "but not on the others" in line, line
  assert "move WORKDIR/checkpoints/1 into WORKDIR/damaged/" in line, line
  for workdir in (whole, seen_by_1):  # nothing moved aside: the damage may be the host's, not the checkpoint's
    assert os.listdir(workdir / "checkpoints") == ["1"] and not (workdir / "damaged").exists()
