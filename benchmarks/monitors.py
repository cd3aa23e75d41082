"""What train.monitors costs: the train step's throughput with the monitors on against off, in one process.

  python benchmarks/monitors.py [--configs=tiny.py,tiny_ncp.py] [--reps=8] [--steps=20] [--log_every=10]
                                [--pairs=200] [--control]

For each config, two variants of the real jitted train step on one random batch, each with its own
train state, run as the train loop runs them: `steps` steps, and at every `log_every`-th step the
metrics fetched:

  off     train.monitors=False: the plain step every step
  on      train.monitors=True: at log steps the step's monitored twin (grad_norm/{group} and
          update_norm/{group}) and the probe (latent_jax/train/monitors.py), else the plain step

`--control` builds `on` as a second `off` (an A/A run): its ratios show what the protocol reads when
nothing differs. `reps` rounds, the variants' order alternated every round, so load from other jobs
falls on both; a round's ratio compares its own runs. Reports wall and process CPU seconds per step,
per round and the median ratio, the ratio of the variants' total times over all rounds, and the
ratio of their fastest rounds. Rounds of log_every steps move by a few percent on this machine even
idle, so the two parts are also measured where the loop pays them (`parts`, `--pairs`): the group
norms, from single plain and monitored steps alternated, as the median over windows of log_every
pairs of the monitored step's time over the plain one's; the probe, as the median of its calls right
after a step; `estimate` = (norms_in_step + probe / step) / log_every. With the CPU model, versions
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
         cli.Flag("pairs", int, 200, "single plain and monitored steps alternated, for the parts",
                  lambda n: n >= 1, ">= 1"),
         cli.Flag("control", bool, False, "an A/A run: `on` built as a second `off`, for the protocol's noise")]
VARIANTS = ("off", "on")


def build(cfg, monitored):
  """A variant: [(plain step, the step for log steps), its fresh train state, the probe or None], and the
  random batch."""
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
  compile_step = lambda twin: steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg),
                                                    monitors=twin).lower(state, batch).compile()
  plain = compile_step(False)
  probe = monitors.make_probe(graphdef, cfg, shardings, mesh) if monitored else None
  return [(plain, compile_step(True) if monitored else plain), state, probe], batch


def timed(variant, batch, logged):
  """One plain (or, `logged`, log-step) step of `variant`, waited for -> seconds; updates its state."""
  start = time.perf_counter()
  variant[1], m = variant[0][logged](variant[1], batch)
  jax.block_until_ready((variant[1], m))
  return time.perf_counter() - start


def parts(on, batch, log_every, pairs):
  """The two parts of the cost, each where the loop pays it. The group norms: single plain and monitored steps
  of `on` alternated `pairs` times (which cancels drift better than runs of log_every steps), the ratio of the
  monitored step's time to the plain one's over each log_every consecutive pairs, the median of those; the
  probe: the median of its calls right after a step."""
  times = {False: [], True: []}
  probes = []
  for i in range(pairs):
    for logged in (False, True) if i % 2 else (True, False):
      times[logged].append(timed(on, batch, logged))
    start = time.perf_counter()
    on[2](on[1]["params"], batch)
    probes.append(time.perf_counter() - start)
  windows = [sum(times[True][i:i + log_every]) / sum(times[False][i:i + log_every])
             for i in range(0, pairs - log_every + 1, log_every)]
  out = {"step_s": statistics.median(times[False]), "norms_in_step": statistics.median(windows) - 1,
         "probe_s": statistics.median(probes)}
  out["estimate"] = (out["norms_in_step"] + out["probe_s"] / out["step_s"]) / log_every
  return {k: round(v, 5) for k, v in out.items()}


def run(variant, batch, n_steps, log_every):
  """n_steps steps as the loop runs them -> (wall seconds, CPU seconds, names logged); updates variant's state."""
  compiled, state, probe = variant
  names = set()
  wall, cpu = time.perf_counter(), time.process_time()
  for i in range(1, n_steps + 1):
    state, m = compiled[i % log_every == 0](state, batch)  # (plain, log-step) indexed by a bool
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


def measure(config, reps, n_steps, log_every, pairs=200, control=False):
  cfg = load_config(os.path.join(ROOT, "configs", config), [f"train.log_every={log_every}"])
  built = {}
  for name in VARIANTS:
    built[name], batch = build(cfg, name == "on" and not control)
    run(built[name], batch, log_every, log_every)  # warm: the first log step compiles the probe
  wall = {name: [] for name in VARIANTS}
  cpu = {name: [] for name in VARIANTS}
  logged = {}
  for r in range(reps):
    for name in VARIANTS if r % 2 else VARIANTS[::-1]:
      w, c, logged[name] = run(built[name], batch, n_steps, log_every)
      wall[name].append(w / n_steps)
      cpu[name].append(c / n_steps)
  times = {"wall": wall, "cpu": cpu}
  ratios = {m: [a / b for a, b in zip(t["on"], t["off"])] for m, t in times.items()}
  return {"config": config, "steps_per_run": n_steps, "log_every": log_every, "reps": reps,
          "probe_rows": monitors.probe_rows(cfg.data.batch_size, sharding.make_mesh(cfg.mesh)),
          "batch": [cfg.data.batch_size, cfg.data.seq_len],
          "step_s_median": {n: round(statistics.median(v), 4) for n, v in wall.items()},
          "cpu_s_median": {n: round(statistics.median(v), 4) for n, v in cpu.items()},
          "ratio_median": {m: round(statistics.median(v), 4) for m, v in ratios.items()},  # on / off, per round
          "ratio_total": {m: round(sum(t["on"]) / sum(t["off"]), 4) for m, t in times.items()},
          "ratio_fastest": {m: round(min(t["on"]) / min(t["off"]), 4) for m, t in times.items()},
          "parts": None if control else parts(built["on"], batch, log_every, pairs), "control": control,
          "ratios": {m: [round(x, 4) for x in v] for m, v in ratios.items()},
          "monitor_names": len(logged["on"] - logged["off"]), "load_avg": os.getloadavg()[0]}


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    if args.pairs < args.log_every:
      raise ValueError(f"--pairs={args.pairs}: the parts need at least log_every={args.log_every} pairs (one window).")
  print(json.dumps(machine()))
  for config in args.configs.split(","):
    result = measure(config, args.reps, args.steps, args.log_every, args.pairs, args.control)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
