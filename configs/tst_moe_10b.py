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
  c = tiny_moe.get_config()
  c.model.update(vocab_size=100_278, d_model=2048, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128,
                 mlp_dim=8192, rope_base=500_000.0, norm_eps=1e-6, qk_norm="layer", block_order="post",
                 window=4096, full_attention_every=1, tie_embeddings=False, param_dtype="float32",
                 dtype="bfloat16", remat="full")  # mlp_dim: unused with every layer sparse
  c.model.moe.update(enabled=True, num_experts=128, top_k=8, expert_dim=512, shared_experts=0, every=1,
                     first_dense=0, router="softmax", norm_topk_prob=False, capacity_factor=0.0,
                     lb_loss_weight=0.01, z_loss_weight=0.001)
  tst = tiny_tst.get_config().tst
  c.tst = tst
  c.tst.update(enabled=True, s=16, r=0.25, budget="flops", carry="all")
  c.data.update(source="data/dolma3_store", seq_len=4096, batch_size=1024)
  c.train.update(steps=240_000, z_loss=1e-5, log_every=10, eval_every=5000, eval_batches=64, checkpoint_every=5000)
  c.optim.update(name="adamw", lr=4e-4, b1=0.9, b2=0.95, schedule="wsd", warmup_steps=2000, weight_decay=0.1,
                 clip_norm=1.0)
  c.mesh.update(data=-1, fsdp=4, expert=16, tensor=1)
  return c
