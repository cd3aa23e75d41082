"""What train.monitors costs: the train step's throughput with the monitors on against off, in one process.

  python benchmarks/monitors.py [--configs=tiny.py,tiny_ncp.py] [--reps=8] [--steps=20] [--log_every=10]
                                [--variants=off,norms,on] [--pairs=200]

For each config, three variants of the real jitted train step on one random batch, each with its own
train state, run as the train loop runs them: `steps` steps, and at every `log_every`-th step the
metrics fetched (and, with the probe, the probe run on the batch):

  off     train.monitors=False
  norms   the step's grad_norm/{group} and update_norm/{group} only (every step), no probe
  on      train.monitors=True: those and the probe (latent_jax/train/monitors.py) at log steps

(`--variants=off,on` leaves `norms` out, for more rounds of the comparison that decides.)
`reps` rounds, the variants' order rotated every round, so load from other jobs falls on all; a
round's ratio compares its own runs. Reports wall and process CPU seconds per step, per round
and the median ratio, the ratio of the variants' total times over all rounds, and the ratio of
their fastest rounds. Rounds of log_every steps move by a few percent on this machine even
idle, so the two parts are also measured where the loop pays them (`parts`, `--pairs`): the
group norms inside the step, from single steps of off and on alternated, as the median over
windows of log_every pairs of on's time over off's; the probe, as the median of its calls right
after a step; `estimate` = norms_in_step + probe / log_every / step. With the CPU model, versions
and date (docs/performance.md, "Monitors").
"""
import datetime
import json
import os
import statistics
import time

import jax
import numpy as np

from latent_jax import cli, load_config, objectives, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import flops, monitors
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [cli.Flag("configs", str, "tiny.py,tiny_ncp.py", "configs/ files, a comma list"),
         cli.Flag("reps", int, 8, "rounds (each runs every variant once)", lambda n: n >= 1, ">= 1"),
         cli.Flag("steps", int, 20, "steps per run", lambda n: n >= 1, ">= 1"),
         cli.Flag("log_every", int, 10, "train.log_every", lambda n: n >= 1, ">= 1"),
         cli.Flag("pairs", int, 200, "single steps of off and on alternated, for the parts", lambda n: n >= 1, ">= 1"),
         cli.Flag("variants", str, "off,norms,on", "off and on, and optionally norms",
                  lambda s: {"off", "on"} <= set(s.split(",")) <= set(VARIANTS), "off,on or off,norms,on")]
VARIANTS = ("off", "norms", "on")


def build(cfg, monitored, probed):
  """A variant: (compiled step, its fresh train state, the probe or None), and the random batch."""
  cfg = cfg.copy_and_resolve_references()
  cfg.train.monitors = monitored
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  b, t, v = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  tokens = np.random.default_rng(0).integers(0, v, size=(b, t + 1)).astype(np.int32)
  batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                 "segment_ids": np.ones((b, t), np.int32),
                                 "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))}, mesh)
  step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg))
  compiled = step.lower(state, batch).compile()
  probe = monitors.make_probe(graphdef, cfg, shardings, mesh) if probed else None
  return [compiled, state, probe], batch


def timed(variant, batch):
  """One step of `variant`, waited for -> seconds; updates its state."""
  start = time.perf_counter()
  variant[1], m = variant[0](variant[1], batch)
  jax.block_until_ready((variant[1], m))
  return time.perf_counter() - start


def parts(built, batch, log_every, pairs):
  """The two parts of the cost, each where the loop pays it. The group norms inside the step: single steps
  of `off` and `on` alternated `pairs` times (which cancels drift better than runs of log_every steps), the
  ratio of on's time to off's over each log_every consecutive pairs, the median of those; the probe: the
  median of its calls right after a step."""
  on = built["on"]
  times = {"off": [], "on": []}
  probes = []
  for i in range(pairs):
    for name in ("off", "on") if i % 2 else ("on", "off"):
      times[name].append(timed(built[name], batch))
    start = time.perf_counter()
    on[2](on[1]["params"], batch)
    probes.append(time.perf_counter() - start)
  windows = [sum(times["on"][i:i + log_every]) / sum(times["off"][i:i + log_every])
             for i in range(0, pairs - log_every + 1, log_every)]
  out = {"step_s": statistics.median(times["off"]), "norms_in_step": statistics.median(windows) - 1,
         "probe_s": statistics.median(probes)}
  out["estimate"] = out["norms_in_step"] + out["probe_s"] / log_every / out["step_s"]
  return {k: round(v, 5) for k, v in out.items()}


def run(variant, batch, n_steps, log_every):
  """n_steps steps as the loop runs them -> (wall seconds, CPU seconds, names logged); updates variant's state."""
  compiled, state, probe = variant
  names = set()
  wall, cpu = time.perf_counter(), time.process_time()
  for i in range(1, n_steps + 1):
    state, m = compiled(state, batch)
    if i % log_every == 0:
      metrics = {k: float(v) for k, v in jax.device_get(m).items()}
      if probe:
        metrics.update(probe(state["params"], batch))
      names |= set(metrics)
  jax.block_until_ready(state)
  variant[1] = state
  return time.perf_counter() - wall, time.process_time() - cpu, names


def machine():
  import flax
  return {"cpu": flops.processor(), "cores": os.cpu_count(), "jax": jax.__version__, "flax": flax.__version__,
          "backend": jax.default_backend(), "date": datetime.datetime.now().isoformat(timespec="minutes")}


def measure(config, reps, n_steps, log_every, variants=VARIANTS, pairs=200):
  cfg = load_config(os.path.join(ROOT, "configs", config), [f"train.log_every={log_every}"])
  built = {}
  for name in variants:
    built[name], batch = build(cfg, name != "off", name == "on")
    run(built[name], batch, log_every, log_every)  # warm: the first log step compiles the probe
  wall = {name: [] for name in variants}
  cpu = {name: [] for name in variants}
  others = [name for name in variants if name != "off"]
  logged = {}
  for r in range(reps):
    for name in variants[r % len(variants):] + variants[:r % len(variants)]:
      w, c, logged[name] = run(built[name], batch, n_steps, log_every)
      wall[name].append(w / n_steps)
      cpu[name].append(c / n_steps)
  ratios = {f"{name}/off": {"wall": [a / b for a, b in zip(wall[name], wall["off"])],
                            "cpu": [a / b for a, b in zip(cpu[name], cpu["off"])]} for name in others}
  total_ratio = {f"{name}/off": {"wall": round(sum(wall[name]) / sum(wall["off"]), 4),
                                 "cpu": round(sum(cpu[name]) / sum(cpu["off"]), 4)} for name in others}
  fastest_ratio = {f"{name}/off": {"wall": round(min(wall[name]) / min(wall["off"]), 4),
                                   "cpu": round(min(cpu[name]) / min(cpu["off"]), 4)} for name in others}
  return {"config": config, "steps_per_run": n_steps, "log_every": log_every, "reps": reps,
          "probe_rows": monitors.probe_rows(cfg.data.batch_size, sharding.make_mesh(cfg.mesh)),
          "batch": [cfg.data.batch_size, cfg.data.seq_len],
          "step_s_median": {n: round(statistics.median(v), 4) for n, v in wall.items()},
          "cpu_s_median": {n: round(statistics.median(v), 4) for n, v in cpu.items()},
          "ratio_median": {k: {m: round(statistics.median(v), 4) for m, v in r.items()} for k, r in ratios.items()},
          "ratio_total": total_ratio,
          "ratio_fastest": fastest_ratio, "parts": parts(built, batch, log_every, pairs),
          "ratios": {k: {m: [round(x, 4) for x in v] for m, v in r.items()} for k, r in ratios.items()},
          "monitor_names": len(logged["on"] - logged["off"]), "load_avg": os.getloadavg()[0]}


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    if args.pairs < args.log_every:
      raise ValueError(f"--pairs={args.pairs}: the parts need at least log_every={args.log_every} pairs (one window).")
  print(json.dumps(machine()))
  for config in args.configs.split(","):
    result = measure(config, args.reps, args.steps, args.log_every, tuple(args.variants.split(",")), args.pairs)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
