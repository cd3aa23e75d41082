"""eval, generate and export read a model laid out as its training laid it out (issue: no device
holds all parameters of a model that training shards): a run trained with fsdp over 4 CPU devices
is read on 4 devices with every matrix split, and gives what a one-device reading gives."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT, TINY, TINY_OVERRIDES

SCRIPT = textwrap.dedent("""
    import os, json, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from latent_jax import checkpoint, load_config
    from latent_jax.eval import evaluate_dir
    from latent_jax.export import export
    from latent_jax.infer import generate, load, load_model
    from latent_jax import sharding
    from latent_jax.train.loop import train

    config, corpus, workdir, out, overrides = sys.argv[1:5] + [json.loads(sys.argv[5])]
    train(load_config(config, overrides + [f"data.source={corpus}"]), workdir)

    model, cfg, _ = load_model(workdir)
    params = nnx.to_pure_dict(nnx.state(model))
    # As the training lays them out: each parameter's shard shape on the training's own mesh.
    trained = nnx.to_pure_dict(sharding.state_shardings(nnx.state(model), sharding.make_mesh(cfg.mesh)))

    def split(params):  # laid out as in training, so one device holds a fraction of the bytes
      same = all(x.sharding.shard_shape(x.shape) == s.shard_shape(x.shape)
                 for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(trained)))
      held = sum(np.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(params))
      return bool(same and held < 0.5 * sum(x.size for x in jax.tree.leaves(params)))
    # The same checkpoint replicated on a data-only mesh: the layout eval and generate used before.
    mesh = jax.make_mesh((4, 1, 1, 1), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    everywhere = {name: NamedSharding(mesh, P()) for name in checkpoint.placement(cfg)}
    graphdef, replicated = load.load_params(workdir, cfg, None, everywhere)
    prompt = np.tile(np.arange(1, 6, dtype=np.int32), (4, 1))
    tokens = [np.asarray(generate(m, prompt, 6, jax.random.key(0), temperature=0.0))
              for m in (model, nnx.merge(graphdef, replicated))]
    export(workdir, out)
    exported, _, _ = load_model(out)
    print(json.dumps({"split": split(params), "export_split": split(nnx.to_pure_dict(nnx.state(exported))),
                      "generated": [t.tolist() for t in tokens], "eval": evaluate_dir(workdir, max_batches=2),
                      "export_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                          jax.tree.leaves(params), jax.tree.leaves(nnx.to_pure_dict(nnx.state(exported)))))}))
""")


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_eval_generate_export_keep_the_training_layout(tmp_path, corpus_dir):
  overrides = TINY_OVERRIDES + ["mesh.data=1", "mesh.fsdp=-1", "train.steps=2", "optim.warmup_steps=1", "train.eval_every=0",
                                "train.checkpoint_every=2"]
  workdir, out = tmp_path / "run", tmp_path / "export"
  result = subprocess.run([sys.executable, "-c", SCRIPT, TINY, corpus_dir, str(workdir), str(out), json.dumps(overrides)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  got = json.loads(result.stdout.strip().splitlines()[-1])
  assert got["split"] and got["export_split"] and got["export_equal"]
  sharded, replicated = got["generated"]
  assert sharded == replicated  # greedy decoding with the split params and the whole ones
  # The same checkpoint scored on one device (no split possible there): the same figures.
  one = subprocess.run([sys.executable, "-m", "latent_jax.eval", "--workdir", str(workdir), "--batches=2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "XLA_FLAGS": ""})
  assert one.returncode == 0, one.stdout + one.stderr
  alone = json.loads(one.stdout.strip().splitlines()[-1])
  assert alone["tokens"] == got["eval"]["tokens"] > 0
  np.testing.assert_allclose(alone["val_loss"], got["eval"]["val_loss"], rtol=1e-5)
  np.testing.assert_allclose(alone["val_bpb"], got["eval"]["val_bpb"], rtol=1e-5)
