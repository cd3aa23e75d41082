"""Per-device memory of the compiled train step with and without activation sharding.

  python benchmarks/activation_sharding.py --config configs/tiny.py [--config.a.b=v ...] [--devices=4]

Compiles (does not run) the train step of the config's mesh (e.g. --config.mesh.fsdp=4) on
`devices` fake CPU devices (a real accelerator's devices when there are that many), twice:
as trained (activations pinned by `sharding.constrain` / `per_batch_shard`), and with
`sharding.use_mesh` a no-op, which leaves every activation to XLA's sharding propagation
(the code before activation sharding). Prints XLA's per-device scratch memory
(memory_analysis().temp_size_in_bytes) and how many arrays of the per-device program have the
global batch (B, T) as leading dims (occurrences in its text), against the per-device batch (B / (data * fsdp), T).
"""
import contextlib
import os
import re
import sys

from latent_jax import cli

FLAGS = [cli.CONFIG, cli.Flag("devices", int, 4, "fake CPU devices", lambda n: n >= 1, ">= 1")]


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    measure(args.config, sys.argv[1:] if argv is None else argv)


def measure(cfg, argv):
  import jax  # after XLA_FLAGS
  import numpy as np

  from latent_jax import objectives, sharding
  from latent_jax.data import FEATURES
  from latent_jax.nn import abstract_model, axes_tree
  from latent_jax.train import step as steps
  from latent_jax.train.optim import build_optimizer

  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shard = steps.state_shardings(abstract, tx, mesh)
  state = steps.abstract_state(cfg, tx, shard)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  rows = jax.ShapeDtypeStruct((b, t), np.int32, sharding=sharding.batch_sharding(mesh))
  local = b // (mesh.shape["data"] * mesh.shape["fsdp"])
  print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, mesh {dict(mesh.shape)}, "
        f"{' '.join(argv)}")
  print("| activations | temp MiB | shapes [B, T, ...] in the HLO | shapes [B/shards, T, ...] |")
  print("|---|---|---|---|")
  for name, use_mesh in [("constrained", sharding.use_mesh), ("XLA propagation only", None)]:
    original = sharding.use_mesh
    sharding.use_mesh = use_mesh or (lambda mesh: contextlib.nullcontext())
    try:
      compiled = steps.make_train_step(graphdef, tx, cfg, shard, mesh, objectives.objective_for(cfg)).lower(
          state, dict.fromkeys(FEATURES, rows)).compile()
    finally:
      sharding.use_mesh = original
    text = compiled.as_text()
    count = lambda batch: len(re.findall(rf"\[{batch},{t}[,\]]", text))
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    print(f"| {name} | {temp:.2f} | {count(b)} | {count(local)} |", flush=True)


if __name__ == "__main__":
  main()
