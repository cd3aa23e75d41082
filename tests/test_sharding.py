"""Sharded equals unsharded: a few train steps on a (2, 2, 2) mesh of 8 fake CPU devices."""
import os
import subprocess
import sys
import textwrap

import pytest

from latent_jax.config import ConfigError

SCRIPT = textwrap.dedent("""
    import os, sys
    # 8 device threads on 2 busy cores can reach a collective far apart: XLA:CPU's default 40 s
    # before it aborts a collective nobody else has joined yet is too short under CI load.
    # 32 fake devices for a mesh of 8: XLA:CPU sizes its thread pools to the device count (one
    # thread per device) but runs a device's independent collectives concurrently, each one
    # blocking a thread until its peers join. With 8 devices all 8 threads ended up blocked,
    # some devices holding two, while one device had no thread left to reach its collectives:
    # a deadlock under load, in the code before and after kernels.attention alike. With this
    # script at 30 steps, 2-4 runs at once on 2 loaded cores: 8 devices hung in 8 of 9 runs,
    # 32 devices in 0 of 49. 32 threads leave room.
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=32 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=900")
    import jax, numpy as np
    from latent_jax import load_config
    from latent_jax import sharding
    from latent_jax.nn import abstract_model, axes_tree
    from latent_jax.train import step as steps
    from latent_jax.train.optim import build_optimizer

    cfg = load_config(sys.argv[1], ["model.vocab_size=256", "model.d_model=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64",
        "model.window=8", "data.seq_len=16", "data.batch_size=8", "train.steps=10",
        "optim.warmup_steps=1", "optim.name=" + sys.argv[2], "kernels.impl=xla"])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
      tokens = rng.integers(0, 256, size=(8, 17)).astype(np.int32)
      batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                      "segment_ids": np.ones((8, 16), np.int32), "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))})

    def run(mesh_sizes, devices):
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_sizes
      mesh = sharding.make_mesh(cfg.mesh, devices)
      graphdef, abstract = abstract_model(cfg.model)
      tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
      shard = steps.state_shardings(abstract, tx, mesh)
      state = steps.init_state(cfg.model, 0, tx, shard)
      train_step = steps.make_train_step(graphdef, tx, cfg, shard, mesh)
      losses = []
      for b in batches:
        state, m = train_step(state, sharding.global_batch(b, mesh))
        losses.append(float(m["loss"]))
      return losses, state

    one_losses, one = run((1, 1, 1), jax.devices()[:1])
    many_losses, many = run((2, 2, 2), jax.devices()[:8])
    np.testing.assert_allclose(many_losses, one_losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(many["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(many["params"])}
    mlp = many["params"]["blocks"]["blocks"]["mlp"]["gate"]
    assert mlp.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor"), mlp.sharding.spec
    assert len(mlp.addressable_shards) == 8 and mlp.addressable_shards[0].data.shape == (2, 16, 32)
    mu = [x for x in jax.tree.leaves(many["opt_state"]) if x.shape == mlp.shape]
    assert mu and all(x.sharding.spec == mlp.sharding.spec for x in mu)
    print("OK", one_losses, specs)
""")


@pytest.mark.parametrize("optimizer", [pytest.param(o, marks=pytest.mark.slow) for o in ("adamw", "muon")])  # slow: by time
def test_sharded_train_steps_equal_single_device(optimizer):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-c", SCRIPT, os.path.join(root, "configs", "tiny.py"), optimizer],
                          capture_output=True, text=True, timeout=600, cwd=root)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "OK" in result.stdout


def test_mesh_that_does_not_fit_devices_is_a_clear_error(tiny_cfg):
  from latent_jax.sharding import mesh_shape
  tiny_cfg.mesh.data, tiny_cfg.mesh.fsdp, tiny_cfg.mesh.tensor = 2, 2, 2
  with pytest.raises(ConfigError, match="there are 4 devices"):
    mesh_shape(tiny_cfg.mesh, 4)
  tiny_cfg.mesh.data = -1
  tiny_cfg.mesh.fsdp = 3
  with pytest.raises(ConfigError, match="does not divide"):
    mesh_shape(tiny_cfg.mesh, 8)
  tiny_cfg.mesh.fsdp = 2
  assert mesh_shape(tiny_cfg.mesh, 8) == (2, 2, 1, 2)


def test_slices_group_devices_by_tpu_slice_then_process_then_runs():
  """mesh.slices: which devices form each slice (the data axis runs over slices, fsdp and tensor
  stay inside one): TPU slices by slice_index, hosts by process (two per slice here), else runs."""
  from types import SimpleNamespace as Device
  from latent_jax.sharding import slice_groups
  ids = lambda groups: [[d.id for d in g] for g in groups]
  tpus = [Device(id=i, slice_index=i % 2, process_index=i // 2) for i in range(8)]
  assert ids(slice_groups(tpus, 2)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  hosts = [Device(id=i, process_index=i // 2) for i in range(8)]  # 4 processes of 2 GPUs
  assert ids(slice_groups(hosts, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  fake = [Device(id=i, process_index=0) for i in range(8)]
  assert ids(slice_groups(fake, 4)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  with pytest.raises(ConfigError, match=r"mesh.slices=3 does not divide the 4 processes"):
    slice_groups(hosts, 3)
