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


def flexolmo(c, *, d_model, num_layers, head_dim, num_experts, expert_dim, batch_size, steps):
  """The large MoE recipes' shared shape (configs/nitp_moe_2b.py, tst_moe_10b.py): OLMo-3's post-norm block with
  QK-norm and full attention over 4,096-token rows, OLMo-3's untied 100,278-token vocabulary, and OLMoE's
  sparse layer in every block (a softmax router, top 8 with no renormalisation, load-balancing loss 0.01,
  router z-loss 0.001, dropless); AdamW at 4e-4 (0.9, 0.95) on a WSD schedule with 2,000 warmup steps."""
  heads = d_model // head_dim
  c.model.update(vocab_size=100_278, d_model=d_model, num_layers=num_layers, num_heads=heads, num_kv_heads=heads,
                 head_dim=head_dim, mlp_dim=4 * d_model, rope_base=500_000.0, norm_eps=1e-6, qk_norm="layer",
                 block_order="post", window=4096, full_attention_every=1, tie_embeddings=False,
                 param_dtype="float32", dtype="bfloat16", remat="full")  # mlp_dim: unused with every layer sparse
  c.model.moe.update(enabled=True, num_experts=num_experts, top_k=8, expert_dim=expert_dim, shared_experts=0,
                     every=1, first_dense=0, router="softmax", norm_topk_prob=False, capacity_factor=0.0,
                     lb_loss_weight=0.01, z_loss_weight=0.001)
  c.data.update(source="data/dolma3_store", seq_len=4096, batch_size=batch_size)
  c.train.update(steps=steps, z_loss=1e-5, log_every=10, eval_every=5000, eval_batches=64, checkpoint_every=5000)
  c.optim.update(name="adamw", lr=4e-4, b1=0.9, b2=0.95, schedule="wsd", warmup_steps=2000, weight_decay=0.1,
                 clip_norm=1.0)
  c.mesh.update(data=-1, fsdp=4, expert=16, tensor=1)  # a v5p-128: experts over 16 chips, the batch over all
  return c
