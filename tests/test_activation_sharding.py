"""Activations shard like the batch: the compiled per-device train step holds no global-batch tensor.

One subprocess with 4 fake CPU devices compiles (does not run) the train steps of the baseline
with NITP and MTP, ConceptLM and TST phase 1 on an fsdp=4 mesh and reads the shapes in the
per-device HLO. The batch (16) and the row counts it makes (16*24 tokens, 16*8 concepts,
16*72 phase-1 tokens) occur in no other shape, so any of them as dim 0 or 1 of an array (dim 1:
behind a stacked layer axis) is an activation that was not split.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, re
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    from latent_jax import load_config, objectives
    from latent_jax import sharding
    from latent_jax.nn import abstract_model, axes_tree
    from latent_jax.train import step as steps
    from latent_jax.train.optim import build_optimizer

    SMALL = ["model.vocab_size=320", "model.d_model=40", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "model.head_dim=10", "model.mlp_dim=72", "model.window=8",
             "model.full_attention_every=2", "data.seq_len=24", "data.batch_size=16", "kernels.impl=xla"]
    GLOBAL = re.compile(r"\\[(\\d+,)?(16|384|128|1152)[,\\]]")

    def shapes(config, overrides, mesh_sizes, objective, seq):
      cfg = load_config(os.path.join("configs", config), SMALL + overrides)
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_sizes
      mesh = sharding.make_mesh(cfg.mesh)
      graphdef, abstract = abstract_model(cfg)
      tx, _ = build_optimizer(cfg.optim, 10, axes_tree(abstract))
      shard = steps.state_shardings(abstract, tx, mesh)
      state = steps.abstract_state(cfg, tx, shard)
      rows = jax.ShapeDtypeStruct((16, seq), np.int32, sharding=sharding.batch_sharding(mesh))
      text = steps.make_train_step(graphdef, tx, cfg, shard, mesh, objective).lower(
          state, dict.fromkeys(("inputs", "targets", "segment_ids", "positions"), rows)).compile().as_text()
      return set(re.findall(r"[a-z]+[0-9]*\\[[0-9,]*\\]", text))

    cases = [("tiny.py", ["nitp.enabled=True", "mtp.enabled=True"], objectives.lm_objective, 24),
             ("tiny_ncp.py", ["model.chunk_size=3", "model.codebook_size=36", "model.residual_hidden=12"],
              objectives.ncp_objective, 24),
             ("tiny_tst.py", ["tst.s=3"], objectives.tst_objective, 72)]
    for config, overrides, objective, seq in cases:
      found = shapes(config, overrides, (1, 4, 1), objective, seq)
      unsplit = sorted(s for s in found if GLOBAL.search(s))
      assert not unsplit, (config, unsplit)
      assert "f32[4,24,40]" in found, (config, sorted(found))  # the residual stream, 16/4 rows each

    # data=2 x fsdp=2 splits the batch 4 ways as well.
    found = shapes("tiny.py", [], (2, 2, 1), objectives.lm_objective, 24)
    assert not [s for s in found if GLOBAL.search(s)] and "f32[4,24,40]" in found
    # tensor=2 splits heads (4 -> 2 of 10 dims) and the MLP width (72 -> 36); fsdp=2 the batch (16 -> 8).
    found = shapes("tiny.py", [], (1, 2, 2), objectives.lm_objective, 24)
    assert not [s for s in found if GLOBAL.search(s)]
    assert {"f32[8,24,2,10]", "f32[8,24,36]", "f32[8,24,40]"} <= found, sorted(found)
    assert not {"f32[8,24,4,10]", "f32[8,24,72]"} & found
    print("OK")
""")


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_no_activation_holds_the_global_batch():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, cwd=root)
  assert result.returncode == 0, result.stdout + result.stderr[-5000:]
  assert "OK" in result.stdout
