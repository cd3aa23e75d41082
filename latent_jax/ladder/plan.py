"""ladder plan: one line per point, the total compute, a wall-time estimate, and each point's launch line.

The estimate times one train step of each shape (method, size, batch) on the devices at hand,
after compiling it, and multiplies by the point's steps; the measured step times are kept in
WORKDIR/step_times.json, so that planning again measures only new shapes.
"""
import json
import os
import time

import jax
import numpy as np

from latent_jax import paths, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import phases
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer


def shape_key(point):
  return f"{point.method}_{point.size}_b{point.batch_size}"


def measure_step(point, repeats=3):
  """(seconds of one train step of the point's shape, seconds to compile it), on random tokens.
  TST: the plain step of phase 2 (phase 1's costs the same FLOPs with tst.budget='flops')."""
  cfg = point.config()
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract_params = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract_params))
  shardings = steps.state_shardings(abstract_params, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  b, length = cfg.data.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, length + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, length), np.int32),
           "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()}
  batch = sharding.global_batch(batch, mesh, b)
  start = time.perf_counter()
  train_step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, phases.plan(cfg)[-1].objective)
  state, _ = jax.block_until_ready(train_step(state, batch))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, _ = jax.block_until_ready(train_step(state, batch))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), compile_s


def step_times(points, workdir, log=print):
  """{shape: (step seconds, compile seconds)}, measured for shapes not yet in WORKDIR/step_times.json."""
  path = os.path.join(workdir, "step_times.json")
  known = json.loads(paths.path(path).read_text()) if paths.path(path).exists() else {}
  device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  known = {k: v for k, v in known.items() if v.get("device") == device}  # measured elsewhere: measure again
  for p in points:
    key = shape_key(p)
    if key not in known:
      log(f"measuring a step of {key} ...")
      step_s, compile_s = measure_step(p)
      known[key] = {"step_s": step_s, "compile_s": compile_s, "device": device}
      os.makedirs(workdir, exist_ok=True)
      paths.write_atomic(path, lambda f: f.write(json.dumps(known, indent=1).encode()))
  return known


def plan(ladder, workdir, points, notes=(), measure=True, log=print):
  """Print the plan; returns its total FLOPs and the estimated seconds (None without measuring)."""
  from latent_jax.data import store
  if measure and not store.is_store(ladder.data):
    log(f"no token store at {ladder.data}: the plan from the recorded results, without the time estimate "
        "or the one-epoch check (docs/ladder.md makes the store)")
    measure = False
  times = step_times(points, workdir, log) if measure else {}
  log(f"{'point':40s} {'method':9s} {'N':>9s} {'FLOPs/token':>12s} {'tokens':>11s} {'steps':>7s} {'batch':>5s} "
      f"{'lr':>8s} {'budget':>8s} {'est.':>8s}")
  total_flops, total_s = 0.0, 0.0
  for p in points:
    est = ""
    if measure:
      t = times[shape_key(p)]
      seconds = p.steps * t["step_s"] + t["compile_s"]
      total_s += seconds
      est = f"{seconds / 60:.1f} min"
    total_flops += p.flops
    log(f"{p.name:40s} {p.method:9s} {p.active_params:>9,} {p.flops_per_token:>12.4g} {p.tokens:>11,} {p.steps:>7,} "
        f"{p.batch_size:>5} {p.lr:>8.2e} {p.budget:>8.2g} {est:>8s}")
  convention = "with the LM head" if ladder.count_lm_head else "without the LM head (NCP's C = F_tok x D)"
  estimate = f"; estimated {total_s / 3600:.2f} h on {jax.device_count()} x {jax.devices()[0].device_kind}" \
      if measure else ""
  log(f"{len(points)} points planned so far, {total_flops:.4g} training FLOPs in all ({convention}){estimate}")
  for n in notes:
    log(n)
  log("launch lines (each point is an ordinary train run; docs/launch.md launches it on a pod):")
  for p in points:
    log("  " + p.launch(workdir))
  return total_flops, (total_s if measure else None)
