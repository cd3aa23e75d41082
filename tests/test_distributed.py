"""How processes join: the GPUs each process drives under SLURM and Open MPI (the arguments that
reach jax.distributed.initialize, from the launchers' variables)."""
import os
import types

import jax
import pytest

from latent_jax import distributed

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
    distributed.initialize(types.SimpleNamespace(coordinator_address=None, num_processes=None, process_id=None))
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
