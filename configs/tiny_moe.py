"""Tiny mixture-of-experts baseline (docs/moe.md): configs/tiny.py with every MLP top-2 of 8 SwiGLU experts.

Each expert is half the dense MLP's width, so a token's active MLP (2 x 192) matches tiny's (384) and
the total MLP parameters are 4x.
"""
import tiny  # configs load with their own folder on sys.path


def get_config():
  c = tiny.get_config()
  c.model.moe.enabled = True
  c.model.moe.num_experts = 8
  c.model.moe.top_k = 2
  c.model.moe.expert_dim = c.model.mlp_dim // 2
  return c
