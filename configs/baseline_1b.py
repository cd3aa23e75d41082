"""A ~1.2B-parameter OLMo-3-style baseline for one GPU: d 2048, 16 layers, 16 heads in 8 KV groups
of head dim 128, SwiGLU 5632, OLMo-3's vocabulary (100,278), 4,096 tokens a row.

The GPU throughput reference of docs/performance.md (benchmarks/gpu_check.py times it). Post-norm,
QK-norm over the whole projection, as configs/olmo3_7b.py; every layer attends to the whole row.
float32 master parameters and optimiser state, bfloat16 compute.
"""
import tiny  # configs load with their own folder on sys.path
import tiny_ncp


def get_config(model="baseline"):
  c = tiny.get_config()
  c.model.update(vocab_size=100_278, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128,
                 mlp_dim=5632, qk_norm="layer", block_order="post", window=4096, full_attention_every=1,
                 dtype="bfloat16", remat="none", scan_unroll=16)  # unrolled: faster on GPU
  c.data.update(seq_len=4096, batch_size=8)
  c.optim.update(lr=3e-4, warmup_steps=100)
  if model == "ncp":  # ConceptLM at the same token rate: E/C/D = 8/8/8, k = 4
    c = tiny_ncp.add_ncp(c)
    c.model.update(encoder_layers=8, concept_layers=8, decoder_layers=8, num_segments=16, codebook_size=128)
  return c
