"""The GPU check in one run: the GPU test tier, then kernel and train-step measurements.

    python -m benchmarks.gpu_check [--quick] [--stages tests,attention,ce,mix,step] [--log FILE]

Stages, each a subprocess of its own (this parent never touches the GPU, so no two processes
hold its memory at once) with a time limit, each printed as it finishes:
  tests      `pytest -m gpu tests/test_gpu.py`: the Pallas kernels compiled with Triton against
             naive, every attention implementation against dense (fp32, bf16), a bf16 train step
  attention  benchmarks/attention.py in bf16, forward + backward, at the GPT-2-small shape
             (12 heads of 64) and the 1B shape (16 heads in 8 groups of 128), one and 4
             documents a row
  ce         benchmarks/cross_entropy.py in bf16: naive, xla, pallas at vocabularies 32k-200k
  mix        benchmarks/codebook_mix.py in bf16 at the 8.94B model's shapes
  step       benchmarks/train_throughput.py: configs/baseline_1b.py, MFU against the data-sheet
             peak (without --quick also its ConceptLM, and remat=matmuls at batch 8 and 16)
Ends with a one-screen summary; exits 1 if the tests failed. Everything it prints also goes to
--log. On a lent device machine see docs/kernels.md, "On a GPU", for the wheels to carry.
"""
import argparse
import json
import os
import subprocess
import sys
import time

STAGES = ("tests", "attention", "ce", "mix", "step")


def commands(quick):
  """{stage: [(argv, time limit in seconds)]}; --quick: fewer shapes and repetitions."""
  py = [sys.executable, "-m"]
  reps = "3" if quick else "10"
  attn = py + ["benchmarks.attention", "--impls", "dense,xla_blocked,pallas_gpu,cudnn", "--dtype", "bfloat16",
               "--reps", reps]
  gpt2 = ["--heads", "12", "--groups", "12", "--dim", "64", "--shapes", "16x1024x0"]
  one_b = ["--heads", "16", "--groups", "8", "--dim", "128", "--shapes", "8x4096x0,8x4096x1024"]
  vocabs = "16384x768x50304,8192x2048x200064" if quick else \
      "16384x768x50304,8192x2048x32000,8192x2048x100278,8192x2048x200064"
  step = py + ["benchmarks.train_throughput", "--steps", reps, "--config"]
  steps = [("configs/baseline_1b.py", ["data.batch_size=8"])]
  if not quick:  # ConceptLM at the same token rate, and the remat policies that fit larger batches
    steps += [("configs/baseline_1b.py:ncp", ["data.batch_size=8"]),
              ("configs/baseline_1b.py", ["data.batch_size=8", "model.remat=matmuls"]),
              ("configs/baseline_1b.py", ["data.batch_size=16", "model.remat=matmuls"])]
  return {
      # Tests compare values, not speed: no GEMM autotuning, which dominates their compile time.
      "tests": [(py + ["pytest", "-m", "gpu", "-q", "-n", "8", "--durations=10", "tests/test_gpu.py"], 150,
                 {"XLA_FLAGS": "--xla_gpu_autotune_level=0"})],
      "attention": [(attn + gpt2 + ["--docs", "1"], 60), (attn + gpt2 + ["--docs", "4"], 60),
                    (attn + one_b + ["--docs", "4"], 90),
                    (attn[:3] + ["--impls", "dense,xla_blocked,pallas_gpu", "--dtype", "float32", "--reps", reps] + gpt2
                     + ["--docs", "4"], 60)],
      "ce": [(py + ["benchmarks.cross_entropy", "--impls", "naive,xla,pallas", "--dtype", "bfloat16", "--no-memory",
                    "--reps", reps, "--shapes", vocabs], 150)],
      "mix": [(py + ["benchmarks.codebook_mix", "--impls", "naive,xla,pallas", "--dtype", "bfloat16",
                     "--reps", reps], 60)],
      "step": [(step + [cfg] + [f"--config.{o}" for o in overrides], 150) for cfg, overrides in steps],
  }


class Log:
  def __init__(self, path):
    self.file = open(path, "a") if path else None

  def __call__(self, text=""):
    print(text, flush=True)
    if self.file:
      self.file.write(text + "\n")
      self.file.flush()


def run(cmd, limit, log, env=None):
  """Run one child; its output goes to the log as it comes. (returncode or 'timeout', seconds, output)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", **(env or {}))
  start = time.perf_counter()
  log(f"\n$ {' '.join(cmd[1:])}")
  lines = []
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  try:
    for line in proc.stdout:
      lines.append(line.rstrip())
      log(line.rstrip())
      if time.perf_counter() - start > limit:
        proc.kill()
        break
    rc = proc.wait(timeout=max(1, limit - (time.perf_counter() - start)))
  except subprocess.TimeoutExpired:
    proc.kill()
    rc = "timeout"
  if time.perf_counter() - start > limit:
    rc = "timeout"
  return rc, time.perf_counter() - start, lines


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="fewer repetitions")
  p.add_argument("--stages", default=",".join(STAGES))
  p.add_argument("--log", default="")
  a = p.parse_args()
  log = Log(a.log)
  probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend(), jax.__version__, "
                          "jax.devices()[0].device_kind)"], capture_output=True, text=True,
                         env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  backend = probe.stdout.split()
  if not backend or backend[0] != "gpu":
    sys.exit(f"error: benchmarks.gpu_check needs a GPU; jax says {probe.stdout.strip() or probe.stderr.strip()[-300:]}")
  log(f"# GPU check: jax {backend[1]}, {' '.join(backend[2:])}, {time.strftime('%Y-%m-%d %H:%M')}")
  summary, tests_ok = [], True
  for stage in a.stages.split(","):
    for cmd, limit, *env in commands(a.quick)[stage]:
      rc, seconds, lines = run(cmd, limit, log, *env)
      status = "ok" if rc == 0 else f"FAILED ({rc})"
      if stage == "tests":
        tests_ok = rc == 0
        status += " " + next((l for l in reversed(lines) if " passed" in l or " failed" in l), "")
      if stage == "step" and rc == 0 and lines:
        try:
          r = json.loads(lines[-1])
          status += (f": {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.3f} of {r['peak_source']}, "
                     f"compile {r['compile_s']} s")
        except (ValueError, KeyError):
          pass
      summary.append(f"{stage:9s} {seconds:6.0f} s  {status}  [{' '.join(cmd[2:])[:150]}]")
  log("\n## Summary\n")
  for line in summary:
    log(line)
  sys.exit(0 if tests_ok else 1)


if __name__ == "__main__":
  main()
