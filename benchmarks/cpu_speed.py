"""CPU speed against references measured in the same run, each in its own subprocess, alternated.

  python -m benchmarks.cpu_speed [--rounds=3] [--steps=5] [--parts=torch,gemm,concept]

Needs the `bench` extra (torch) for the torch part. Three comparisons, each repeated `rounds`
times with the order of its runs rotated every round, so load from other jobs falls on all:

  torch    latent_jax's train step on configs/nanogpt_cpu.py against the same model in PyTorch
           (benchmarks/torch_reference.py), eager and torch.compile: tokens/s and their ratios.
  gemm     the configs/d512.py step's FLOP/s (train/flops.py) against this machine's best large
           fp32 GEMM: the fastest of a 2048 and a 4096 square matmul in XLA, NumPy and torch.
  concept  ConceptLM (configs/nanogpt_cpu.py:ncp) against the baseline: step-time ratio over
           their FLOPs ratio (1.0 = ConceptLM runs its extra FLOPs at the baseline's rate).

Both frameworks get the same cores: JAX's XLA:CPU uses every core; torch.set_num_threads(os.cpu_count()).
Each run prints one JSON line; then a summary line per comparison with per-round ratios and medians.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np

from latent_jax import cli

PARTS = ("torch", "gemm", "concept")
FLAGS = [cli.Flag("rounds", int, 3, "rounds of each comparison", lambda n: n >= 1, ">= 1"),
         cli.Flag("steps", int, 5, "timed steps per run", lambda n: n >= 1, ">= 1"),
         cli.Flag("parts", str, ",".join(PARTS), "comparisons to run, a comma list of " + ", ".join(PARTS)),
         cli.Flag("worker", str, None, "internal: run one measurement (jax:CONFIG, gemm) in this process")]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def jax_step(config, n_steps):
  """One run of the real jitted train step on a config: tokens/s and FLOP/s."""
  sys.path.insert(0, HERE)
  from train_throughput import step_times

  from latent_jax import load_config
  from latent_jax.train import flops
  cfg = load_config(os.path.join(ROOT, config))
  compile_s, times, _, _ = step_times(cfg, n_steps)
  step_s, tokens = float(np.median(times)), cfg.data.batch_size * cfg.data.seq_len
  flops_per_token = flops.flops_per_token(cfg, cfg.data.seq_len)
  return {"impl": f"latent_jax {config}", "compile_s": round(compile_s, 2), "step_s": round(step_s, 4),
          "step_times": [round(t, 4) for t in times], "tokens_per_s": round(tokens / step_s, 1),
          "train_flops_per_token": flops_per_token, "flops_per_s": tokens * flops_per_token / step_s}


def gemm(repeats=3):
  """The best FLOP/s of a 2048 and a 4096 square fp32 matmul in XLA (jit), NumPy and torch (if installed)."""
  import jax
  import jax.numpy as jnp
  rates = {}

  def best(name, n, f, a):
    f(a)
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      f(a)
      times.append(time.perf_counter() - start)
    rates[f"{name} {n}"] = 2 * n**3 / min(times)

  matmul = jax.jit(lambda x: x @ x)
  for n in (2048, 4096):
    best("xla", n, lambda x: matmul(x).block_until_ready(), jnp.ones((n, n), jnp.float32))
    best("numpy", n, lambda x: x @ x, np.ones((n, n), np.float32))
  try:
    import torch
  except ImportError:
    torch = None
  if torch is not None:
    torch.set_num_threads(os.cpu_count())
    for n in (2048, 4096):
      best("torch", n, lambda x: x @ x, torch.ones(n, n))
  name = max(rates, key=rates.get)
  return {"impl": "gemm", "rates": {k: round(v / 1e9, 1) for k, v in rates.items()}, "best": name,
          "flops_per_s": rates[name]}


def run(args):
  """A subprocess running `args` (a --worker, or torch_reference.py); its last stdout line as JSON."""
  out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
  result = json.loads(out.stdout.strip().splitlines()[-1])
  result["load_avg_1min"] = round(os.getloadavg()[0], 2)
  print(json.dumps(result), flush=True)
  return result


def rounds(runs, n_rounds):
  """{name: [result per round]}: every round runs all `runs` ({name: args}), order rotated by one."""
  names, results = list(runs), {name: [] for name in runs}
  for r in range(n_rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      results[name].append(run(runs[name]))
  return results


def summary(name, per_round, extra=None):
  line = {"comparison": name, "per_round": [round(x, 3) for x in per_round], "median": round(float(np.median(per_round)), 3)}
  print(json.dumps({**line, **(extra or {})}), flush=True)


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    if args.worker == "gemm":
      print(json.dumps(gemm()))
      return
    if args.worker:
      print(json.dumps(jax_step(args.worker.removeprefix("jax:"), args.steps)))
      return
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
      raise ValueError(f"--parts={args.parts}: each must be one of {', '.join(PARTS)}.")
    me = ["-m", "benchmarks.cpu_speed", f"--steps={args.steps}"]
    torch_ref = ["benchmarks/torch_reference.py", f"--steps={args.steps}", f"--threads={os.cpu_count()}"]
    print(json.dumps({"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}))

    if "torch" in parts:
      r = rounds({"jax": me + ["--worker=jax:configs/nanogpt_cpu.py"], "eager": torch_ref,
                  "compiled": torch_ref + ["--compile"]}, args.rounds)
      tps = {k: [x["tokens_per_s"] for x in v] for k, v in r.items()}
      for ref in ("compiled", "eager"):
        summary(f"latent_jax / torch {ref} tokens/s", [a / b for a, b in zip(tps["jax"], tps[ref])],
                {"median_tokens_per_s": {k: float(np.median(v)) for k, v in tps.items()}})
    if "gemm" in parts:
      r = rounds({"d512": me + ["--worker=jax:configs/d512.py"], "gemm": me + ["--worker=gemm"]}, args.rounds)
      summary("d512 step FLOP/s / best GEMM FLOP/s",
              [a["flops_per_s"] / b["flops_per_s"] for a, b in zip(r["d512"], r["gemm"])],
              {"median_step_gflops": round(float(np.median([a["flops_per_s"] for a in r["d512"]])) / 1e9, 1),
               "median_gemm_gflops": round(float(np.median([b["flops_per_s"] for b in r["gemm"]])) / 1e9, 1)})
    if "concept" in parts:
      r = rounds({"baseline": me + ["--worker=jax:configs/nanogpt_cpu.py"],
                  "concept": me + ["--worker=jax:configs/nanogpt_cpu.py:ncp"]}, args.rounds)
      flops_ratio = r["concept"][0]["train_flops_per_token"] / r["baseline"][0]["train_flops_per_token"]
      summary("ConceptLM / baseline step time, over their FLOPs ratio",
              [c["step_s"] / b["step_s"] / flops_ratio for b, c in zip(r["baseline"], r["concept"])],
              {"flops_ratio": round(flops_ratio, 3),
               "step_time_ratios": [round(c["step_s"] / b["step_s"], 3) for b, c in zip(r["baseline"], r["concept"])]})


if __name__ == "__main__":
  main()
