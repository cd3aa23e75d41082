"""NITP on a 1.9B-A0.3B mixture of experts: the smallest MoE of NITP's results table (docs/aux.md, docs/moe.md).

From the paper: a 1.9B-total, 0.3B-active MoE trained with L_NTP + lambda L_NITP, lambda 1.0 (0.8 only at
3B dense and 9B MoE), the target the hidden state after ~20% of the layers (3 of 16), a SwiGLU d -> 4d -> d
projector, cosine loss, stop-gradient on the target.

Chosen here, where the paper is silent (its MoE's shape is not given): OLMoE's shape (Muennighoff et al.
2024: 16 layers, 64 experts, a softmax router choosing top 8 with no renormalisation, every layer sparse)
at half its width: d 1024, 16 heads of 64, experts of f 512. N (train/flops.py parameter_counts, as plan prints it): 1.69B
non-embedding parameters, 0.28B active per token (each with NITP's training-only projector, 13M); with the
embedding and LM head (OLMo-3's 100,278-token vocabulary, untied: 0.21B) 1.90B total, the paper's 1.9B. OLMo-3's post-norm block with QK-norm, full
attention, 4,096 tokens a row; OLMoE's load-balancing loss 0.01, router z-loss 0.001, AdamW at 4e-4 with a
WSD schedule. Batch: 512 rows (2.1M tokens a step); 100,000 steps (~210B tokens).

Mesh for a v5p-128 (64 chips, a 4x4x4 torus): expert = 16 (4 experts a chip) x fsdp = 4, the batch over both
(docs/moe.md, "Expert parallelism"); plan it first:

  python -m latent_jax.plan --config configs/nitp_moe_2b.py --topology v5p-128
"""
import tiny_moe  # configs load with their own folder on sys.path
from tiny_nitp import add_nitp


def get_config():
  c = tiny_moe.flexolmo(tiny_moe.get_config(), d_model=1024, num_layers=16, head_dim=64, num_experts=64,
                        expert_dim=512, batch_size=512, steps=100_000)
  add_nitp(c, weight=1.0)
  c.nitp.layer = 3                     # 3 of 16, as the paper's 16-layer models
  return c
