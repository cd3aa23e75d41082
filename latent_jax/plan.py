"""python -m latent_jax.plan --config CONFIG --topology TOPO [--slices=S] [--hbm_gib=G] [--config.a.b=v ...]

Lowers and compiles the config's real train step ahead of time for TOPO, on abstract state
(no weights are allocated), and prints per device: parameters, optimiser state, batch,
temporaries, the peak (arguments, outputs not written over the donated state, temporaries and
code), the device's memory and whether the peak fits, the step's FLOPs (active: a sparse MLP counts the
experts a token runs, docs/moe.md) and the compile time; before them N, the non-embedding parameters
(and, with model.moe, those active per token).
XLA:TPU refuses to compile a step whose temporaries exceed the chip; plan then reports the
temporaries its message gives. A TST config plans each phase. Then the same for the steps that
read the trained model on those devices, laid out as the training lays it out: the eval step
and one generation step (a token for each of data.batch_size rows, against a KV cache of
data.seq_len slots). The last line is one JSON object; the exit code is 0 when every train phase
fits, 1 when one does not.

TOPO is one of
  local          this process's devices (the default)
  cpu:N          N CPU devices of this host, which share its RAM (HBM: host RAM / N)
  v5p-128        a Cloud TPU slice by name, compiled through libtpu on any machine; v4 and v5p
                 names count TensorCores (two per chip), v5e and v6e names count chips
  v5p:4x4x4      a TPU slice by its chip grid (for slices whose chip count is no power of two)
--slices=S takes S such slices joined over DCN (multislice; it sets mesh.slices): the data axis
spans them, fsdp and tensor stay inside one; plan then also estimates the bytes a chip sends over
DCN per step (the gradients' all-reduce across slices).
TPU topologies need libtpu: pip install -e ".[tpu]". On a machine without a TPU, the commands keep it
quiet and skip jax's start-up probe for a TPU (distributed.quiet_absent_tpu).
"""
import importlib.util
import json
import math
import os
import re
import time

import jax
import numpy as np
from flax import nnx

import pallas_kernels
from latent_jax.config import trainable_setting, validate
from latent_jax import cli, distributed, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import flops, phases
from latent_jax.train import step as steps
from latent_jax.train.optim import build_optimizer
from latent_jax.infer.sample import cache_shardings, make_decode_step

GIB = 2**30

# Cloud TPU generations: (memory per chip in GiB that XLA:TPU lets a program use, a little under
# the HBM, as libtpu 0.0.42's out-of-memory errors print it; TensorCores per chip that the slice
# name counts; dims of the chip grid). A JAX device is one chip (v4, v5p: two cores as one megacore).
TPUS = {"v4": (30.75, 2, 3), "v5p": (95.74, 2, 3), "v5e": (15.75, 1, 2), "v6e": (31.25, 1, 2)}


def chip_grid(chips, dims):
  """The chip grid of a Cloud TPU slice of `chips` chips (a power of two): from one host's 2x2x1
  (3-D) or 1x1 (2-D), double the smallest dim, the last one among equals. v5p-128 -> 4x4x4."""
  grid = [2, 2, 1] if dims == 3 else [1, 1]
  while math.prod(grid) < chips:
    smallest = min(grid)
    grid[max(i for i, g in enumerate(grid) if g == smallest)] *= 2
  return grid


def tpu_topology(topology):
  """A Cloud TPU name (v5p-128) or chip grid (v5p:4x4x4) -> (generation, grid string)."""
  named = re.fullmatch(r"(v\w+)-(\d+)", topology)
  gridded = re.fullmatch(r"(v\w+):(\d+(?:x\d+)+)", topology)
  generation = (named or gridded).group(1)
  if generation not in TPUS:
    raise ValueError(f"--topology {topology}: unknown TPU generation {generation!r}; use one of {', '.join(TPUS)}.")
  _, cores_per_chip, dims = TPUS[generation]
  if gridded:
    if len(gridded.group(2).split("x")) != dims:
      raise ValueError(f"--topology {topology}: {generation} slices are {dims}-D chip grids, e.g. "
                       f"{generation}:{'x'.join(map(str, chip_grid(64, dims)))}.")
    return generation, gridded.group(2)
  count = int(named.group(2))
  chips = count // cores_per_chip
  smallest = 4 if dims == 3 else 1
  if count % cores_per_chip or chips < smallest or chips & (chips - 1):
    unit = "TensorCores, two per chip" if cores_per_chip == 2 else "chips"
    raise ValueError(f"--topology {topology}: {generation} names count {unit} and the name rule covers "
                     f"powers of two from {generation}-{smallest * cores_per_chip}; "
                     f"give the chip grid instead, e.g. {generation}:{'x'.join(map(str, chip_grid(64, dims)))}.")
  return generation, "x".join(map(str, chip_grid(chips, dims)))


def topology_devices(topology, slices=1):
  """TOPO (`slices` of it) -> (devices, how they are named, HBM per device in bytes or None, where that
  figure comes from)."""
  if topology == "local":
    devices = jax.devices()
    return devices, f"local {devices[0].platform}", *device_memory(devices)
  name = topology if slices == 1 else f"{slices} x {topology}"
  cpus = re.fullmatch(r"cpu:(\d+)", topology)
  if cpus:
    n = int(cpus.group(1)) * slices  # fake slices: runs of CPU devices
    if n < 1:
      raise ValueError(f"--topology {topology}: needs at least one device, e.g. cpu:4.")
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # jax already started in this process: take the CPU devices it has
      pass
    devices = jax.devices("cpu")
    if len(devices) < n:
      raise ValueError(f"--topology {topology}: jax already started here with {len(devices)} CPU devices; "
                       "plan in a fresh process.")
    return devices[:n], name, host_memory() / n, "host RAM / N"
  if not re.fullmatch(r"v\w+(-\d+|:\d+(x\d+)+)", topology):
    raise ValueError(f"--topology {topology}: unknown topology; use local, cpu:N, a Cloud TPU name such as "
                     "v5p-128 or v5e-256, or a chip grid such as v5p:4x4x4.")
  generation, grid = tpu_topology(topology)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(f"--topology {topology} compiles through libtpu, which is not installed; "
                     'pip install -e ".[tpu]".')
  from jax.experimental import topologies
  options = {"chip_config_name": "megacore"} if TPUS[generation][1] == 2 else {}
  if slices > 1:
    options["num_slices"] = slices
  try:
    devices = topologies.get_topology_desc(topology_name=f"{generation}:{grid}", platform="tpu", **options).devices
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"--topology {topology}: libtpu refuses the slice {generation}:{grid} ({e}); "
                     "give another chip grid.") from None
  return devices, f"{name} ({generation}:{grid})", TPUS[generation][0] * GIB, "XLA:TPU's limit"


def device_memory(devices):
  """(bytes, source) of the memory one local device may use: the device's own, or a CPU's share of host RAM."""
  if devices[0].platform == "cpu":
    return host_memory() / len(devices), "host RAM / N"
  stats = devices[0].memory_stats() or {}
  return stats.get("bytes_limit"), "the device"


def host_memory():
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bytes_per_device(tree):
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (evenly split: every shard alike)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# XLA:TPU refuses a program whose temporaries exceed the chip's memory; its message then is the
# only measure of them (XLA prints bytes in binary units: G = GiB).
REFUSED = re.compile(r"memory required for HLO temporaries \(([\d.]+)G\) exceeds available HBM")
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")


def peak_bytes(memory):
  """What a device holds while the step runs: its arguments, the outputs not written over donated
  arguments, the temporaries (one block, which XLA packs by live range) and the program.
  (XLA's own peak_memory_in_bytes reads less than the temporaries' block alone, on CPU and on TPU.)"""
  return memory["argument"] + memory["output"] - memory["alias"] + memory["temp"] + memory["generated_code"]


def plan(cfg, topology="local", hbm_gib=None, slices=None, reading=True):
  """Compile the train step of every phase for `topology` (`slices` of it, else mesh.slices), and with
  `reading` the eval and generation steps; returns the figures the JSON line prints."""
  if slices:
    cfg.mesh.slices = slices
  validate(cfg)
  slices = cfg.mesh.get("slices", 1)
  devices, name, hbm, hbm_source = topology_devices(topology, slices if topology != "local" else 1)
  if hbm_gib is not None:
    hbm, hbm_source = hbm_gib * GIB, "--hbm_gib"
  if hbm is None:
    raise ValueError(f"--topology {topology}: {devices[0].device_kind} does not report its memory; "
                     "state it with --hbm_gib.")
  mesh = sharding.make_mesh(cfg.mesh, devices)
  sharding.check_batch(cfg.data.batch_size, mesh, cfg.train.microbatches)
  sharding.check_experts(cfg.model, mesh)
  runs = phases.plan(cfg)
  print(f"{len(devices)} x {devices[0].device_kind} ({name}), mesh "
        + " ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f", {hbm / GIB:.2f} GiB per device ({hbm_source})")

  # As in the train loop: the state's shardings and layout are the same in every phase.
  graphdef, abstract_params = abstract_model(cfg)
  axes = axes_tree(abstract_params)
  active, non_embedding = flops.parameter_counts(abstract_params, axes, cfg.model)
  print(f"N: {non_embedding:,} non-embedding parameters" + (f", {active:,} active per token (model.moe: "
        f"top_k {cfg.model.moe.top_k} of {cfg.model.moe.num_experts} experts)" if active != non_embedding else ""))
  tx, _ = build_optimizer(cfg.optim, runs[0].schedule_steps, axes, trainable_setting(cfg),
                          total_steps=cfg.train.steps)
  shardings = steps.state_shardings(abstract_params, tx, mesh)
  state = steps.abstract_state(cfg, tx, shardings)
  results = []
  for phase in runs:
    print(phase.describe(cfg.data.batch_size))
    tx, _ = build_optimizer(cfg.optim, phase.schedule_steps, axes, trainable_setting(cfg),
                            total_steps=cfg.train.steps)
    batch = steps.batch_shapes(cfg.data.batch_size, phase.seq_len, mesh)
    result = {"phase": phase.number, "seq_len": phase.seq_len, "params_bytes": bytes_per_device(state["params"]),
              "opt_state_bytes": bytes_per_device(state["opt_state"]), "batch_bytes": bytes_per_device(batch)}
    result.update(compile_step(lambda: steps.make_train_step(graphdef, tx, cfg, shardings, mesh, phase.objective)
                               .lower(state, batch), devices[0].platform))
    if result["temp_bytes"] is not None and not result["compiled"]:  # the outputs overwrite the donated state
      result["peak_bytes"] = result["temp_bytes"] + result["params_bytes"] + result["opt_state_bytes"] \
          + result["batch_bytes"]
    result["model_flops"] = phase.flops_per_step / len(devices)
    if slices > 1:  # a ring all-reduce of each chip's gradient shard (its parameters' size) over the slices
      result["dcn_bytes"] = round(2 * (slices - 1) / slices * result["params_bytes"])
    results.append(result)
    print(report(result, hbm))
  reading = plan_reading(cfg, mesh, devices[0].platform) if reading else {}
  for name, r in reading.items():
    print(report_reading(name, r, hbm))
  peak = max(r["peak_bytes"] for r in results)
  return {"topology": topology, "slices": slices, "devices": len(devices), "device_kind": devices[0].device_kind,
          "mesh": dict(mesh.shape), "nonembedding_params": non_embedding, "active_params": active, "peak_gib": peak / GIB, "hbm_gib": hbm / GIB, "hbm_source": hbm_source,
          "fits": peak <= hbm, "phases": results, **reading}


def compile_step(lower, platform):
  """Lower (`lower()`) and compile a step for the plan's devices -> its memory figures per device
  and compile time. XLA:TPU refuses a program whose temporaries exceed the chip: then only
  temp_bytes is known (its message), and peak_bytes is None for the caller to estimate."""
  start = time.perf_counter()
  with pallas_kernels.target_backend(platform):  # kernels.impl=auto picks for the plan's devices
    lowered = lower()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    refused = REFUSED.search(str(e))
    if not refused:
      raise
    return {"compile_s": round(time.perf_counter() - start, 1), "compiled": False,
            "temp_bytes": round(float(refused.group(1)) * GIB), "peak_bytes": None, "xla_peak_bytes": None,
            "flops": None}
  analysis = compiled.memory_analysis()
  memory = {k: getattr(analysis, f"{k}_size_in_bytes") for k in MEMORY_FIELDS}
  return {"compile_s": round(time.perf_counter() - start, 1), "compiled": True, "temp_bytes": memory["temp"],
          "peak_bytes": peak_bytes(memory), "xla_peak_bytes": analysis.peak_memory_in_bytes,
          "flops": compiled.cost_analysis()["flops"]}


def plan_reading(cfg, mesh, platform):
  """The steps that read the trained model on the training's devices and layout (what eval,
  generate and export do with sharding.inference_mesh there): the eval step on one batch of
  data.batch_size rows, and one generation step (a token per row) of that many rows against a
  KV cache of data.seq_len slots, split over the batch axes."""
  graphdef, abstract = abstract_model(cfg.model)
  shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nnx.to_pure_dict(abstract), shardings)
  rows, length = cfg.data.batch_size, cfg.data.seq_len
  batch = steps.batch_shapes(rows, length, mesh)
  eval_step = steps.make_eval_step(graphdef, cfg, shardings, mesh, np.zeros(cfg.model.vocab_size, np.int32))
  evaluation = {"params_bytes": bytes_per_device(params), "batch_bytes": bytes_per_device(batch),
                **compile_step(lambda: eval_step.lower(params, batch), platform)}

  model = nnx.merge(graphdef, abstract)
  cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(lambda: model.init_cache(rows, length)),
                       cache_shardings(model, rows, length, mesh))
  tokens = jax.ShapeDtypeStruct((rows, 1), np.int32, sharding=sharding.batch_sharding(mesh))
  index, key = jax.ShapeDtypeStruct((), np.int32), jax.eval_shape(lambda: jax.random.key(0))
  decode = make_decode_step(graphdef, mesh, temperature=0.0)
  generation = {"params_bytes": bytes_per_device(params), "cache_bytes": bytes_per_device(cache),
                **compile_step(lambda: decode.lower(params, tokens, cache, index, key), platform)}
  for r in (evaluation, generation):  # refused: what it is given plus its temporaries
    if r["peak_bytes"] is None:
      r["peak_bytes"] = r["temp_bytes"] + sum(v for k, v in r.items() if k.endswith("_bytes") and k != "temp_bytes"
                                              and k != "peak_bytes")
  return {"eval": evaluation, "generate": generation}


def report(r, hbm):
  """One phase's figures per device, as a small table."""
  gib = lambda key, what: f"  {what:<18}{r[key] / GIB:10.3f} GiB"
  fits = "fits" if r["peak_bytes"] <= hbm else f"does NOT fit ({r['peak_bytes'] / hbm:.2f}x the memory)"
  if r["compiled"]:
    xla = (f"  {'':<18}(the peak above decides the fit; XLA's own peak_memory_in_bytes reads "
           f"{r['xla_peak_bytes'] / GIB:.3f} GiB: less than the temporaries' block on CPU and TPU alike)",
           f"  {'FLOPs per step':<18}{r['model_flops']:10.3e} (the model's count, train/flops.py; XLA's count of "
           f"the program, {r['flops']:.3e}, takes a loop's body once: one of the scanned layers)")
  else:
    xla = (f"  {'':<18}(the compiler refused the program for its temporaries, the one figure it gives)",
           f"  {'FLOPs per step':<18}{r['model_flops']:10.3e} (the model's count; XLA's needs a compiled program)")
  dcn = [gib("dcn_bytes", "sent over DCN") + " per step (estimated: the gradients' all-reduce across slices)"] \
      if "dcn_bytes" in r else []
  return "\n".join([
      "per device:", gib("params_bytes", "parameters"), gib("opt_state_bytes", "optimiser state"),
      gib("batch_bytes", "batch"), gib("temp_bytes", "temporaries"),
      gib("peak_bytes", "peak") + f" of {hbm / GIB:.2f} GiB: {fits}", *xla, *dcn,
      f"  {'compile':<18}{r['compile_s']:10.1f} s"])


def report_reading(name, r, hbm):
  """The eval or generation step's figures per device."""
  gib = lambda key, what: f"  {what:<18}{r[key] / GIB:10.3f} GiB"
  what = {"eval": "eval step (plan_reading): a batch of the run's rows, per device:",
          "generate": "generation step (plan_reading): one token per row against a full KV cache, per device:"}[name]
  inputs = [gib("batch_bytes", "batch")] if "batch_bytes" in r else [gib("cache_bytes", "KV cache")]
  fits = "fits" if r["peak_bytes"] <= hbm else f"does NOT fit ({r['peak_bytes'] / hbm:.2f}x the memory)"
  return "\n".join([what, gib("params_bytes", "parameters"), *inputs, gib("temp_bytes", "temporaries"),
                    gib("peak_bytes", "peak") + f" of {hbm / GIB:.2f} GiB: {fits}",
                    f"  {'compile':<18}{r['compile_s']:10.1f} s"])


FLAGS = [cli.CONFIG,
         cli.Flag("topology", str, "local",
                  "local, cpu:N, a Cloud TPU name (v5p-128, v5e-256, v4-64) or chip grid (v5p:4x4x4)"),
         cli.Flag("slices", int, None, "TPU slices (multislice) of --topology, joined over DCN; sets mesh.slices "
                  "(default: the config's)", lambda n: n >= 1, ">= 1"),
         cli.Flag("hbm_gib", float, None, "memory per device in GiB to fit in; default: the device's, XLA:TPU's "
                  "limit for the chip, or host RAM / N for CPU devices", lambda g: g > 0, "> 0"),
         cli.Flag("reading", bool, True, "also compile the eval and generation steps (--noreading: the train "
                  "step alone, which is what a large model's plan mostly waits for)"),
         ] + cli.DISTRIBUTED  # for --topology=local on several hosts


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    if argv is None:  # from a shell (tests call main in their own process)
      cli.exit_on_interrupt()
    distributed.initialize(args)
    result = plan(args.config, args.topology, args.hbm_gib, args.slices, args.reading)
  print(json.dumps(result))
  raise SystemExit(0 if result["fits"] else 1)


if __name__ == "__main__":
  main()
