"""latent_jax's train step against a nanoGPT-style PyTorch step on the same GPU, side by side.

    python -m benchmarks.gpu_peer [--steps=20] [--variants=NAME,...] [--profile]

At the GPT-2-small shape (vocab 50,304, d 768, 12 layers, 12 heads, 1,024 tokens, batch 16):
  torch   a nanoGPT-style GPT: learned positions, pre-LayerNorm blocks, fused QKV, causal SDPA
          (flash), GELU MLP 3072, tied LM head, fused AdamW (b 0.9/0.95, weight decay 0.1 on
          matrices), gradient clipping 1.0, bf16 autocast over float32 parameters,
          torch.compile; random tokens. The GPU machine's own torch; nothing in this project
          depends on it.
  jax     configs/nanogpt_gpu.py (the same sizes; SwiGLU 2048 has GELU 3072's FLOPs) through
          benchmarks/train_throughput.py's step timer, once per variant (VARIANTS: overrides
          and XLA flags), each in its own process so that the flags take effect.
Each side runs in a fresh process (no two allocators share the GPU); prints a table of
tokens/s and the ratio to torch, then one JSON line. --profile also traces the jax variants'
steps (jax.profiler) and prints where the device time went, by kernel.
"""
import argparse
import json
import os
import subprocess
import sys
import time

SHAPE = dict(vocab=50304, d=768, layers=12, heads=12, seq=1024, batch=16)
CONFIG = "configs/nanogpt_gpu.py"

# name -> (config overrides, extra XLA flags). "default" is the config as shipped (kernels "auto",
# layers unrolled); the others change one thing, or restore an earlier default.
VARIANTS = {
    "default": ([], ""),
    "scanned": (["model.scan_unroll=1"], ""),
    "naive_ce": (["kernels.impl=naive"], ""),
    "pallas_attention": (["kernels.attention=pallas_gpu"], ""),
    "remat_matmuls": (["model.remat=matmuls"], ""),
    "no_triton_gemm": ([], "--xla_gpu_enable_triton_gemm=false"),
    "before": (["kernels.impl=pallas", "kernels.attention=pallas_gpu", "model.scan_unroll=1"], ""),  # main at dd920a3
}


# --------------------------------------------------------------------------------- torch
def torch_step_times(steps):
  import torch
  import torch.nn.functional as F
  from torch import nn

  s = SHAPE
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      d = s["d"]
      self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
      self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
      self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
      b, t, d = x.shape
      q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
      q, k, v = (a.view(b, t, s["heads"], d // s["heads"]).transpose(1, 2) for a in (q, k, v))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
      x = x + self.c_proj(y)
      return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.wte, self.wpe = nn.Embedding(s["vocab"], s["d"]), nn.Embedding(s["seq"], s["d"])
      self.blocks = nn.ModuleList(Block() for _ in range(s["layers"]))
      self.ln_f = nn.LayerNorm(s["d"], bias=False)
      self.lm_head = nn.Linear(s["d"], s["vocab"], bias=False)
      self.lm_head.weight = self.wte.weight
      for p in self.parameters():
        if p.dim() == 2:
          nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
      x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
      for block in self.blocks:
        x = block(x)
      logits = self.lm_head(self.ln_f(x))
      return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

  torch.manual_seed(0)
  model = GPT().cuda()
  decay = [p for p in model.parameters() if p.dim() >= 2]
  rest = [p for p in model.parameters() if p.dim() < 2]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                          lr=6e-4, betas=(0.9, 0.95), fused=True)
  forward = torch.compile(model)
  tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), device="cuda")
  x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

  def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = forward(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

  start = time.perf_counter()
  step()
  torch.cuda.synchronize()
  compile_s = time.perf_counter() - start
  for _ in range(3):
    step()
  torch.cuda.synchronize()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  return {"side": "torch", "torch": torch.__version__, "compile_s": round(compile_s, 1), "times": times,
          "tokens_per_step": s["batch"] * s["seq"]}


# ----------------------------------------------------------------------------------- jax
def jax_step_times(config, overrides, steps, profile_dir):
  import jax
  from benchmarks.train_throughput import run_steps, setup
  from latent_jax import load_config

  cfg = load_config(config, overrides)
  compiled, state, batch, compile_s = setup(cfg)
  state, _, _ = run_steps(compiled, state, batch, 3)
  state, times, _ = run_steps(compiled, state, batch, steps)
  out = {"side": "jax", "jax": jax.__version__, "compile_s": round(compile_s, 1), "times": times,
         "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len}
  if profile_dir:
    out["profile"] = profile(compiled, state, batch, profile_dir)
    with open(os.path.join(profile_dir, "step.hlo.txt"), "w") as f:  # fusion names -> their HLO
      f.write(compiled.as_text())
  return out


def profile(compiled, state, batch, trace_dir, steps=3):
  """Device time per step by kernel and by XLA op, from a jax.profiler trace of `steps` steps."""
  import glob

  import jax
  from jax.profiler import ProfileData

  jax.profiler.start_trace(trace_dir)
  for _ in range(steps):
    state, m = compiled(state, batch)
  jax.block_until_ready(m)
  jax.profiler.stop_trace()
  data = ProfileData.from_file(sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1])
  kernels, ops, busy, lines = {}, {}, 0.0, []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      lines.append(f"{plane.name}/{line.name}: {len(list(line.events))}")
      for ev in line.events:
        ms = ev.duration_ns / 1e6 / steps
        if line.name.startswith("Stream"):
          name = ev.name[:100]
          hlo = dict(ev.stats).get("hlo_op")  # the fusion or custom call the kernel belongs to
          name = f"{name} [{hlo}]" if hlo and hlo != ev.name else name
          kernels[name] = kernels.get(name, 0.0) + ms
          busy += ms
        elif line.name == "XLA Ops":
          ops[ev.name] = ops.get(ev.name, 0.0) + ms
  categories = {}
  for name, ms in kernels.items():
    cat = kernel_category(name)
    categories[cat] = categories.get(cat, 0.0) + ms
  top = lambda d, n: [(k, round(v, 3)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]
  return {"busy_ms": round(busy, 2), "categories": top(categories, 10), "kernels": top(kernels, 40),
          "ops": top(ops, 25), "lines": lines}


def kernel_category(name):
  n = name.lower()
  for cat, keys in [("attention", ("fmha", "sdpa", "flash", "attention", "cudnn")),
                    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "dot")),
                    ("copy", ("memcpy", "memset", "copy")), ("triton", ("triton",)),
                    ("reduce", ("reduce", "reduction"))]:
    if any(k in n for k in keys):
      return cat
  return "elementwise/fusion"


# ------------------------------------------------------------------------------ parent
def child(argv):
  """Run one side in this process and print its JSON line."""
  if argv[0] == "torch":
    result = torch_step_times(int(argv[1]))
  else:
    result = jax_step_times(argv[2], json.loads(argv[3]), int(argv[1]), argv[4] if len(argv) > 4 else "")
  print("RESULT " + json.dumps(result), flush=True)


def run_child(args, env_flags="", timeout=400):
  env = dict(os.environ)
  if env_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + env_flags).strip()
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_peer", "--child", *args], env=env,
                        capture_output=True, text=True, timeout=timeout)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    return {"error": (proc.stderr or proc.stdout).strip()[-1500:]}
  return json.loads(lines[-1][len("RESULT "):])


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    return child(sys.argv[2:])
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--variants", default="default", help=f"comma-separated, of {', '.join(VARIANTS)}")
  p.add_argument("--profile", default="", help="variants to profile (comma-separated), or 'all'")
  p.add_argument("--trace_dir", default="/tmp/gpu_peer", help="where profiles and step HLO go, a folder per variant")
  p.add_argument("--no-torch", action="store_true", help="jax variants only (ratios then omitted)")
  p.add_argument("--config", default=CONFIG, help="the jax side's config; with another than the default, "
                 "add --no-torch (the torch side has the default's shape), e.g. to profile configs/baseline_1b.py")
  a = p.parse_args()
  import numpy as np
  rows = []
  torch_tps = None
  if not a.no_torch:
    r = run_child(["torch", str(a.steps)])
    if "error" in r:
      print(f"torch: failed: {r['error']}", flush=True)
    else:
      torch_tps = r["tokens_per_step"] / float(np.median(r["times"]))
      print(f"torch {r['torch']}: compile {r['compile_s']} s, {1e3 * float(np.median(r['times'])):.1f} ms/step, "
            f"{torch_tps:,.0f} tokens/s", flush=True)
      rows.append(("torch.compile nanoGPT", torch_tps, r))
  for name in a.variants.split(","):
    overrides, flags = VARIANTS[name]
    prof = name in a.profile.split(",") or a.profile == "all"
    trace = os.path.join(a.trace_dir, name) if prof else ""
    r = run_child(["jax", str(a.steps), a.config, json.dumps(overrides)] + ([trace] if trace else []), flags)
    if "error" in r:
      print(f"{name}: failed: {r['error']}", flush=True)
      continue
    tps = r["tokens_per_step"] / float(np.median(r["times"]))
    ratio = f", {tps / torch_tps:.3f}x torch" if torch_tps else ""
    print(f"{name} (jax {r['jax']}, {overrides} {flags}): compile {r['compile_s']} s, "
          f"{1e3 * float(np.median(r['times'])):.1f} ms/step, {tps:,.0f} tokens/s{ratio}", flush=True)
    if "profile" in r:
      pr = r["profile"]
      print(f"  profile of {name}: device busy {pr['busy_ms']} ms/step; by category {pr['categories']}")
      print(f"  trace lines (events): {pr['lines']}")
      for k, ms in pr["kernels"]:
        print(f"    {ms:8.3f} ms  {k}")
      print("  XLA ops:")
      for k, ms in pr["ops"]:
        print(f"    {ms:8.3f} ms  {k}")
      sys.stdout.flush()
    rows.append((name, tps, r))
  print("\n| step | tokens/s | / torch |\n|---|---|---|")
  for name, tps, _ in rows:
    print(f"| {name} | {tps:,.0f} | {tps / torch_tps:.3f} |" if torch_tps else f"| {name} | {tps:,.0f} | |")
  print(json.dumps({name: round(tps) for name, tps, _ in rows}))


if __name__ == "__main__":
  main()
