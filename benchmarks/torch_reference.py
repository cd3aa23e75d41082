"""The nanoGPT-sized baseline of configs/nanogpt_cpu.py in plain PyTorch: the CPU speed reference.

  python benchmarks/torch_reference.py [--compile] [--steps=10] [--threads=N]

The same model and step as latent_jax's train step on that config: token embedding, 4 pre-norm
blocks (RMSNorm, q/k/v/o without bias, rotate-half RoPE with base 5e5, causal full attention
through F.scaled_dot_product_attention, SwiGLU 683), a final RMSNorm, an untied LM head, mean
cross-entropy, gradient clipping at 1.0 and AdamW (b 0.9/0.95, eps 1e-8, weight decay 0.1 on
matrices but the embedding), fp32, batch 16 x 256 random tokens. `--compile` wraps the model's
forward (and so its backward) in torch.compile, as nanoGPT does; the optimiser step stays eager,
torch's default (foreach) AdamW. Prints one JSON line: compile (first-step) time, the median step
time over `steps` timed steps, tokens/s. torch is only in the `bench` extra (pyproject.toml).
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SHAPES = dict(vocab=8192, d=256, layers=4, heads=4, head_dim=64, mlp=683, seq=256, batch=16)
EPS, ROPE_BASE, STD = 1e-6, 500_000.0, 0.02


def rope_tables(seq, head_dim):
  inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
  angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq   # [T, D/2]
  return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]  # [T, 1, D/2]


def rope(x, cos, sin):
  """x [B, T, H, D], rotate-half form."""
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def linear(d_in, d_out):
  layer = nn.Linear(d_in, d_out, bias=False)
  nn.init.normal_(layer.weight, std=STD)
  return layer


class Block(nn.Module):
  def __init__(self, s):
    super().__init__()
    d, h, hd = s["d"], s["heads"], s["head_dim"]
    self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=EPS), nn.RMSNorm(d, eps=EPS)
    self.q, self.k, self.v, self.o = linear(d, h * hd), linear(d, h * hd), linear(d, h * hd), linear(h * hd, d)
    self.gate, self.up, self.down = linear(d, s["mlp"]), linear(d, s["mlp"]), linear(s["mlp"], d)
    self.heads, self.head_dim = h, hd

  def forward(self, x, cos, sin):
    b, t, _ = x.shape
    a = self.attn_norm(x)
    q, k, v = (p(a).view(b, t, self.heads, self.head_dim) for p in (self.q, self.k, self.v))
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    x = x + self.o(out.transpose(1, 2).reshape(b, t, -1))
    m = self.mlp_norm(x)
    return x + self.down(F.silu(self.gate(m)) * self.up(m))


class GPT(nn.Module):
  def __init__(self, s):
    super().__init__()
    self.embed = nn.Embedding(s["vocab"], s["d"])
    nn.init.normal_(self.embed.weight, std=STD)
    self.blocks = nn.ModuleList(Block(s) for _ in range(s["layers"]))
    self.final_norm = nn.RMSNorm(s["d"], eps=EPS)
    self.lm_head = linear(s["d"], s["vocab"])
    cos, sin = rope_tables(s["seq"], s["head_dim"])
    self.register_buffer("cos", cos, persistent=False)
    self.register_buffer("sin", sin, persistent=False)

  def forward(self, tokens, targets):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, self.cos, self.sin)
    logits = self.lm_head(self.final_norm(x))
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model):
  decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed")]
  rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.startswith("embed"))]
  return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                           lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def measure(compile_model, n_steps, threads, s=SHAPES):
  torch.manual_seed(0)
  torch.set_num_threads(threads)
  model = GPT(s)
  opt = make_optimizer(model)
  forward = torch.compile(model) if compile_model else model
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, s["vocab"], size=(s["batch"], s["seq"] + 1)))
  inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

  def step():
    loss = forward(inputs, targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()  # waits for the step, like block_until_ready

  start = time.perf_counter()
  step()
  first_s = time.perf_counter() - start
  step()
  times = []
  for _ in range(n_steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  return {"impl": "torch.compile" if compile_model else "torch eager", "torch": torch.__version__,
          "threads": torch.get_num_threads(), "first_step_s": round(first_s, 2), "step_s": round(step_s, 4),
          "step_times": [round(t, 4) for t in times], "tokens_per_s": round(s["batch"] * s["seq"] / step_s, 1)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--compile", action="store_true")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  args = parser.parse_args()
  print(json.dumps(measure(args.compile, args.steps, args.threads)), flush=True)


if __name__ == "__main__":
  main()
