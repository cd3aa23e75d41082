"""Loss + gradient of fused_cross_entropy: chunked XLA against naive, time and peak memory.

    python -m benchmarks.cross_entropy                    # big (8192 x 1024 x 100278) and small
    python -m benchmarks.cross_entropy --case small --impls naive,xla,xla:128,xla:512
    python -m benchmarks.cross_entropy --shapes 16384x768x50304,8192x2048x200064 --dtype bfloat16

Each impl is `name[:chunk][+z]`; +z adds a z-loss (1e-4 * mean lse^2) to the objective,
which sends a per-row cotangent to lse and so takes the xla impl's recomputing backward.
What is measured, per impl:
  time      median of --reps timed calls of the compiled jax.value_and_grad (w.r.t. hidden
            and weight) of loss.mean(), after one warm-up call; impls are interleaved call
            by call in one process, so a neighbour's load on the machine hits all alike.
            Wall time, and the CPU time of this process (all threads) over the same call:
            on a shared machine the CPU time is the steadier of the two.
  temp      XLA's own buffer assignment: compiled.memory_analysis().temp_size_in_bytes, the
            scratch the step needs beyond its arguments and outputs (the logits live here).
  peak RSS  a fresh subprocess makes the inputs, resets the kernel's peak-RSS mark
            (/proc/self/clear_refs), then compiles and runs the step once: VmHWM minus the
            VmRSS at the reset. What the OS actually had to give, compiler included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

CASES = {"big": (8192, 1024, 100278), "small": (2048, 512, 32000)}


def _status_mib(field: str) -> float:
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1]) / 1024  # kB
  raise KeyError(field)


def _reset_peak_rss() -> None:
  """Forget the high-water mark left by making the inputs (Linux >= 4.0)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _inputs(n, d, vocab, dtype="float32"):
  k = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(k[0], (n, d)).astype(dtype)
  weight = (jax.random.normal(k[1], (d, vocab)) * d**-0.5).astype(dtype)
  labels = jax.random.randint(k[2], (n, 1), 0, vocab)
  return hidden, weight, labels


def _step(spec: str):
  name, z_loss = spec.removesuffix("+z"), spec.endswith("+z")
  impl, _, chunk = name.partition(":")

  def mean_loss(hidden, weight, labels):
    loss, lse = pk.fused_cross_entropy(hidden, weight, labels, impl=impl, return_lse=True,
                                       chunk_size=int(chunk) if chunk else None)
    return loss.mean() + (1e-4 * jnp.square(lse).mean() if z_loss else 0.0)

  return jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))


def _compile(spec, args):
  t = time.perf_counter()
  compiled = _step(spec).lower(*args).compile()
  return compiled, time.perf_counter() - t


def worker(spec, n, d, vocab, dtype):
  """Subprocess body: compile and run once, report peak RSS above the inputs' baseline."""
  args = _inputs(n, d, vocab, dtype)
  jax.block_until_ready(args)
  _reset_peak_rss()
  base = _status_mib("VmRSS")
  compiled, compile_s = _compile(spec, args)
  jax.block_until_ready(compiled(*args))
  temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
  print(json.dumps(dict(spec=spec, base_rss=base, peak_rss=_status_mib("VmHWM"), temp=temp,
                        compile_s=compile_s)))


def measure_memory(spec, n, d, vocab, dtype):
  cmd = [sys.executable, "-m", "benchmarks.cross_entropy", "--worker", spec,
         "--n", str(n), "--d", str(d), "--vocab", str(vocab), "--dtype", dtype]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
  if out.returncode != 0:  # e.g. killed for memory: say so instead of inventing a number
    return dict(spec=spec, error=f"rc={out.returncode}: {out.stderr.strip()[-300:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def measure_time(specs, n, d, vocab, reps, dtype):
  args = _inputs(n, d, vocab, dtype)
  compiled = {s: _compile(s, args)[0] for s in specs}
  wall, cpu = {s: [] for s in specs}, {s: [] for s in specs}
  for r in range(reps + 1):  # round 0 is the warm-up
    for s in specs:
      t, c = time.perf_counter(), time.process_time()
      jax.block_until_ready(compiled[s](*args))
      if r:
        wall[s].append(time.perf_counter() - t)
        cpu[s].append(time.process_time() - c)
  temps = {s: c.memory_analysis().temp_size_in_bytes / 2**20 for s, c in compiled.items()}
  med = lambda d: {s: float(np.median(v)) for s, v in d.items()}
  return med(wall), med(cpu), temps


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--case", default="all", choices=["all", *CASES])
  p.add_argument("--impls", default="naive,xla", help="comma list of name[:chunk][+z]")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="of hidden and weight (the loss is fp32 either way)")
  p.add_argument("--no-memory", action="store_true", help="skip the RSS subprocesses")
  p.add_argument("--no-time", action="store_true", help="only the RSS subprocesses")
  p.add_argument("--shapes", default="", help="n x d x V cases instead of the named ones: 16384x768x50304,...")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--n", type=int)
  p.add_argument("--d", type=int)
  p.add_argument("--vocab", type=int)
  a = p.parse_args()
  if a.worker:
    return worker(a.worker, a.n, a.d, a.vocab, a.dtype)
  specs = a.impls.split(",")
  cases = CASES if a.case == "all" else {a.case: CASES[a.case]}
  if a.shapes:
    cases = {shape: tuple(map(int, shape.split("x"))) for shape in a.shapes.split(",")}
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {a.dtype}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}")
  print("| case (n, d, V) | impl | wall s | wall / naive | CPU s | CPU / naive | temp MiB "
        "| peak RSS - inputs MiB |")
  print("|---|---|---|---|---|---|---|---|")
  for name, (n, d, vocab) in cases.items():
    mem = {} if a.no_memory else {s: measure_memory(s, n, d, vocab, a.dtype) for s in specs}
    if a.no_time:
      for s, m in mem.items():
        rss = f"{m['peak_rss'] - m['base_rss']:.0f}" if "peak_rss" in m else m["error"]
        print(f"| {name} ({n}, {d}, {vocab}) | {s} | - | - | - | - "
              f"| {m.get('temp', 0):.0f} | {rss} |")
      continue
    wall, cpu, temps = measure_time(specs, n, d, vocab, a.reps, a.dtype)
    for s in specs:
      m = mem.get(s, {})
      rss = f"{m['peak_rss'] - m['base_rss']:.0f}" if "peak_rss" in m else m.get("error", "-")
      base = "naive+z" if s.endswith("+z") and "naive+z" in wall else "naive"
      ratio = lambda t: t[s] / t[base] if base in t else float("nan")
      print(f"| {name} ({n}, {d}, {vocab}) | {s} | {wall[s]:.3f} | {ratio(wall):.2f} "
            f"| {cpu[s]:.2f} | {ratio(cpu):.2f} | {temps[s]:.0f} | {rss} |", flush=True)
  print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
