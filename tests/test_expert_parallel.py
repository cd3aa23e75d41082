"""Expert parallelism (docs/moe.md): the `expert` mesh axis splits a sparse MLP's experts and, with data and
fsdp, the batch. An MoE train step on data x fsdp x expert x tensor meshes of 8 fake CPU devices equals one
device; across 2 processes too; a checkpoint restores on another expert count; bad sizes are config errors."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import load_config, sharding
from latent_jax.config import ConfigError
from test_multihost import corpus_store  # noqa: F401 (a fixture: conftest's corpus as a token store)

TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.py")

HEADER = textwrap.dedent("""
    import os, sys
    # 32 fake devices for meshes of 8: see tests/test_sharding.py (XLA:CPU's thread pool and collectives).
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=32 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=900")
    import jax, numpy as np
    from latent_jax import load_config, sharding
    from latent_jax.nn import abstract_model, axes_tree
    from latent_jax.train import step as steps
    from latent_jax.train.optim import build_optimizer

    cfg = load_config(sys.argv[1], ["model.vocab_size=256", "model.d_model=32", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64",
        "model.moe.expert_dim=32", "model.window=8", "data.seq_len=16", "data.batch_size=8", "train.steps=10",
        "optim.warmup_steps=1", "kernels.impl=xla"] + sys.argv[3:])

    def build(sizes, devices):
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = sizes
      mesh = sharding.make_mesh(cfg.mesh, devices)
      graphdef, abstract = abstract_model(cfg.model)
      tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
      return mesh, graphdef, tx, steps.state_shardings(abstract, tx, mesh)
""")

EQUAL = HEADER + textwrap.dedent("""
    meshes = [tuple(map(int, m.split(","))) for m in sys.argv[2].split(";")]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
      tokens = rng.integers(0, 256, size=(8, 17)).astype(np.int32)
      batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((8, 16), np.int32),
                      "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))})

    def run(sizes, devices):
      mesh, graphdef, tx, shard = build(sizes, devices)
      state = steps.init_state(cfg.model, 0, tx, shard)
      train_step = steps.make_train_step(graphdef, tx, cfg, shard, mesh)
      compiled = train_step.lower(state, sharding.global_batch(batches[0], mesh)).compile()
      collectives = {op: compiled.as_text().count(op + "(") for op in ("all-to-all", "all-gather", "all-reduce")}
      metrics = []
      for b in batches:
        state, m = compiled(state, sharding.global_batch(b, mesh))
        metrics.append([float(m[k]) for k in ("loss", "grad_norm", "moe_lb_loss", "router_z_loss")])
      return metrics, state, collectives

    one, one_state, _ = run((1, 1, 1, 1), jax.devices()[:1])
    for sizes in meshes:
      many, state, collectives = run(sizes, jax.devices()[:8])
      np.testing.assert_allclose(many, one, rtol=2e-5)   # losses and the gradients' norm
      for a, b in zip(jax.tree.leaves(one_state["params"]), jax.tree.leaves(state["params"])):  # the updates
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
      gate = state["params"]["blocks"]["sparse_blocks"]["mlp"]["gate"]   # [layers, E, d, f]
      assert gate.sharding.spec[1] == "expert" and gate.addressable_shards[0].data.shape[1] == 8 // sizes[2]
      # Tokens stay on their device: the experts' weights are gathered to them, nothing is sent all-to-all.
      assert collectives["all-to-all"] == 0 and collectives["all-gather"] > 0, collectives
      print("OK", sizes, collectives)
""")


def run_script(script, *args):
  result = subprocess.run([sys.executable, "-c", script, TINY_MOE, *args], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


LAYER = HEADER + textwrap.dedent("""
    from flax import nnx
    from latent_jax.nn.layers import SparseMLP
    layer = SparseMLP(cfg.model, nnx.Rngs(0))
    graphdef, params = nnx.split(layer, nnx.Param)
    x = np.random.default_rng(0).normal(size=(8, 16, 32)).astype(np.float32)

    def loss(params, x):
      y = nnx.merge(graphdef, params)(x)
      return jnp.sum(jnp.sin(y))

    def on(mesh):
      def f(params, x):
        with sharding.use_mesh(mesh):
          x = sharding.constrain(x, ("batch", "length", "act_embed"))
          return jax.value_and_grad(loss, argnums=(0, 1))(params, x)
      shards = sharding.state_shardings(params, mesh)
      return jax.jit(f)(jax.device_put(params, shards), jax.device_put(x, sharding.batch_sharding(mesh)))

    import jax.numpy as jnp
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    for sizes in ((2, 1, 2, 2), (1, 2, 4, 1)):
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = sizes
      got = on(sharding.make_mesh(cfg.mesh, jax.devices()[:8]))
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-6)
      print("OK", sizes)
""")


def test_sparse_mlp_on_expert_meshes_equals_one_device():
  """The sparse MLP alone (value and gradients of its input and weights) on data x expert x tensor and
  fsdp x expert meshes: the quick tier's check; the whole train step is the slow tier's."""
  out = run_script(LAYER, "")
  assert "OK (2, 1, 2, 2)" in out and "OK (1, 2, 4, 1)" in out, out


@pytest.mark.slow  # the slow tier by measured time: 8-device compiles of the whole step
@pytest.mark.parametrize("router,meshes", [("softmax", "2,1,2,2;1,2,4,1;1,1,8,1"), ("sigmoid", "1,1,8,1")])
def test_moe_train_steps_on_expert_meshes_equal_one_device(router, meshes):
  """data x expert x tensor (2, 1, 2, 2), fsdp x expert (1, 2, 4, 1) and all-expert (1, 1, 8, 1): losses,
  gradient norm, router losses and updated params against one device (one process: the single-device step
  compiles once); the sigmoid router (its aux-free bias moved by the expert load, summed over the shards)
  on the last."""
  out = run_script(EQUAL, meshes, f"model.moe.router={router}")
  assert all(f"OK ({m.replace(',', ', ')})" in out for m in meshes.split(";")), out


RESTORE = HEADER + textwrap.dedent("""
    from latent_jax import checkpoint
    from types import SimpleNamespace
    workdir = sys.argv[2]
    mesh, graphdef, tx, shard = build((4, 1, 2, 1), jax.devices()[:8])   # saved on expert=2
    saved = steps.init_state(cfg.model, 0, tx, shard)
    ckpt = checkpoint.Checkpoints(workdir, async_save=False)
    ckpt.save(1, saved, {"config": checkpoint.config_to_json(cfg)}, SimpleNamespace(filename="tokenizer.model", proto=b"unread"))
    ckpt.close()
    for sizes, n in (((2, 1, 4, 1), 8), ((1, 1, 8, 1), 8), ((1, 1, 1, 1), 1)):   # restored on expert=4, 8, 1
      mesh, graphdef, tx, shard = build(sizes, jax.devices()[:n])
      state, _ = checkpoint.Checkpoints(workdir, read_only=True).restore(1, steps.abstract_state(cfg, tx, shard))
      for a, b in zip(jax.tree.leaves((saved["params"], saved["opt_state"])),
                      jax.tree.leaves((state["params"], state["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      gate = state["params"]["blocks"]["sparse_blocks"]["mlp"]["gate"]
      assert gate.addressable_shards[0].data.shape[1] == 8 // sizes[2], gate.sharding
      print("OK", sizes)
""")


def test_checkpoint_saved_on_one_expert_count_restores_on_others(tmp_path):
  out = run_script(RESTORE, str(tmp_path))
  assert all(f"OK {s}" in out for s in ("(2, 1, 4, 1)", "(1, 1, 8, 1)", "(1, 1, 1, 1)")), out


def test_expert_axis_splits_experts_and_the_batch():
  mesh = jax.sharding.AbstractMesh((1, 2, 4, 1), sharding.MESH_AXES)
  P = jax.sharding.PartitionSpec
  assert sharding.logical_spec(("expert", "embed", "mlp"), (3, 8, 32, 64), mesh) == P(None, "expert", "fsdp", None)
  assert sharding.logical_spec(("embed", "expert"), (32, 8), mesh) == P("fsdp", "expert")
  assert sharding.logical_spec(("batch", "length"), (8, 16), mesh) == P(("fsdp", "expert"), None)
  assert sharding.batch_shards(mesh) == 8


def test_an_expert_axis_that_does_not_divide_the_experts_is_a_config_error():
  with pytest.raises(ConfigError, match=r"^mesh\.expert: 3 does not divide model\.moe\.num_experts=8"):
    load_config(TINY_MOE, TINY_OVERRIDES + ["mesh.expert=3"])
  with pytest.raises(ConfigError, match=r"^mesh\.expert: 0 must be >= 1"):
    load_config(TINY_MOE, TINY_OVERRIDES + ["mesh.expert=0"])
  with pytest.raises(ConfigError, match="at most one may be -1"):
    load_config(TINY_MOE, TINY_OVERRIDES + ["mesh.expert=-1"])   # data is -1 already
  cfg = load_config(TINY_MOE, TINY_OVERRIDES + ["mesh.data=1", "mesh.expert=-1"])   # -1: known with the devices
  with pytest.raises(ConfigError, match=r"model\.moe\.num_experts=8 does not divide over mesh\.expert=3"):
    sharding.check_experts(cfg.model, jax.sharding.AbstractMesh((1, 1, 3, 1), sharding.MESH_AXES))
  sharding.check_experts(cfg.model, jax.sharding.AbstractMesh((1, 1, 4, 1), sharding.MESH_AXES))
  load_config(os.path.join(ROOT, "configs", "tiny.py"), TINY_OVERRIDES + ["mesh.expert=3"])   # dense: the batch only


@pytest.mark.slow  # 2 training processes and 1 more on 2 cores
def test_expert_axis_across_two_processes_trains_as_one(tmp_path, corpus_store):
  """expert = 4 over 2 processes of 2 devices each (the experts of a layer on two hosts) trains as 1 process
  holding the 4 devices: every logged figure and the final params."""
  from test_multihost import assert_same_metrics, assert_same_params, finish, rows, train
  mesh = ("mesh.data=1", "mesh.fsdp=1", "mesh.expert=4")
  one, many = tmp_path / "one", tmp_path / "many"
  outs = finish(train(one, corpus_store, 1, 4, config=TINY_MOE, extra=mesh)
                + train(many, corpus_store, 2, 2, config=TINY_MOE, extra=mesh))
  assert "process 0 of 2: 2 local / 4 global cpu devices; mesh data=1 fsdp=1 expert=4 tensor=1" in outs[1]
  assert_same_metrics(rows(one), rows(many))
  assert_same_params(one, many)


@pytest.mark.slow  # the slow tier by measured time (quick tier 11:58 on 2 idle cores, 2026-12-06)
def test_plan_uses_the_expert_axis_and_counts_active_parameters():
  """plan on cpu:4 with mesh.expert=4: the experts' weights a quarter per device, N active and total."""
  result = subprocess.run([sys.executable, "-m", "latent_jax.plan", "--config", TINY_MOE,
                           *[f"--config.{o}" for o in TINY_OVERRIDES], "--topology", "cpu:4", "--config.mesh.data=1",
                           "--config.mesh.expert=4", "--noreading"], capture_output=True, text=True, cwd=ROOT, timeout=600)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["mesh"] == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}
  cfg = load_config(TINY_MOE, TINY_OVERRIDES)
  m = cfg.model
  experts = m.num_layers * 3 * m.moe.num_experts * m.d_model * m.moe.expert_dim
  assert out["nonembedding_params"] - out["active_params"] == experts * (1 - m.moe.top_k / m.moe.num_experts)
  assert f"N: {out['nonembedding_params']:,} non-embedding parameters, {out['active_params']:,} active" in log
  [phase] = out["phases"]
  assert phase["params_bytes"] < (out["nonembedding_params"] - experts * 3 // 4) * 4 + 2 * m.vocab_size * m.d_model * 4


@pytest.mark.parametrize("recipe,total,active,experts", [("tst_moe_10b", 10.07e9, 1.01e9, 128),
                                                         ("nitp_moe_2b", 1.69e9, 0.28e9, 64)])
def test_large_moe_recipes_have_their_documented_sizes(recipe, total, active, experts):
  from latent_jax.nn import abstract_model, axes_tree
  from latent_jax.train import flops
  cfg = load_config(os.path.join(ROOT, "configs", f"{recipe}.py"))
  _, abstract = abstract_model(cfg)
  n_active, n_total = flops.parameter_counts(abstract, axes_tree(abstract), cfg.model)
  assert round(n_total / 1e7) == round(total / 1e7) and round(n_active / 1e7) == round(active / 1e7), (n_total, n_active)
  assert cfg.model.moe.num_experts == experts and experts % cfg.mesh.expert == 0
  assert cfg.mesh.fsdp * cfg.mesh.expert == 64 and cfg.data.batch_size % 64 == 0   # a v5p-128's 64 chips


@pytest.mark.slow  # TPU compiles: minutes each
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install -e ".[tpu]"')
@pytest.mark.parametrize("recipe", ["nitp_moe_2b", "tst_moe_10b"])
def test_large_moe_recipes_fit_a_v5p_128(recipe):
  result = subprocess.run([sys.executable, "-m", "latent_jax.plan", "--config", os.path.join(ROOT, "configs", f"{recipe}.py"),
                           "--topology", "v5p-128", "--noreading"], capture_output=True, text=True, cwd=ROOT, timeout=3600)
  assert result.returncode == 0, result.stdout + result.stderr
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["fits"] and out["mesh"]["expert"] == 16 and out["active_params"] < out["nonembedding_params"] / 5
