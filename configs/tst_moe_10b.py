"""TST on a 10B-A1B mixture of experts: the TST paper's headline MoE run (docs/tst.md, docs/moe.md).

From the paper: a 10B-total, 1B-active MoE, token superposition with bags of s = 16 tokens for the first
r = 0.25 of the steps (then plain next-token training from the same checkpoint), WSD schedule, AdamW (0.9,
0.95), 2,000 warmup steps, decay over the last 10%; it reached the baseline's loss in 4,768 instead of
12,311 B200-hours.

Chosen here, where the paper is silent (its MoE's shape is not given): OLMoE's sparse layer (Muennighoff
et al. 2024: d 2048, 16 heads of 128, a softmax router choosing top 8 with no renormalisation, every layer
sparse) made finer and deeper to reach 10B-A1B. OLMoE's own 64 experts top-8 cannot: a token uses 1/8 of
them, so total / active stays below 8, and 10B-A1B needs 10; so 128 experts of half OLMoE's width (f 512),
top 8 (active expert width 8 x 512 = 4,096, as OLMoE's 8 x 1,024 halved; finer experts did better in
OLMoE's granularity ablation), over 24 layers instead of 16. N (train/flops.py parameter_counts): 10.07B
non-embedding parameters, 1.01B active per token (+0.41B of embedding and LM head, OLMo-3's 100,278-token
vocabulary as the library's other recipes, untied). OLMo-3's post-norm block with QK-norm (FlexOlmo's
shape: OLMoE's MoE in an OLMo-2/3 block), full attention, 4,096 tokens a row; the load-balancing loss at
OLMoE's 0.01 and router z-loss at 0.001. Batch: 1,024 rows (4.2M tokens a step, OLMoE's 4M); 240,000
steps (~1T tokens), the first 60,000 in phase 1 (r = 0.25), where a row holds 16 x 4,096 tokens.

Mesh for a v5p-128 (64 chips, a 4x4x4 torus): expert = 16 (8 experts a chip) x fsdp = 4, the batch over both
(docs/moe.md, "Expert parallelism"); plan it first:

  python -m latent_jax.plan --config configs/tst_moe_10b.py --topology v5p-128
"""
import tiny_moe  # configs load with their own folder on sys.path
import tiny_tst


def get_config():
  c = tiny_moe.flexolmo(tiny_moe.get_config(), d_model=2048, num_layers=24, head_dim=128, num_experts=128,
                        expert_dim=512, batch_size=1024, steps=240_000)
  c.tst = tiny_tst.get_config().tst
  c.tst.update(enabled=True, s=16, r=0.25, budget="flops", carry="all")
  return c
