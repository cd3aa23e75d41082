"""A nanoGPT-sized baseline (V 8192, d 256, 4 layers, 4 heads, seq 256, batch 16): the shapes of
benchmarks/torch_reference.py, which benchmarks/cpu_speed.py runs against this config.

Full causal attention in every layer, pre-norm, no QK-norm, multi-head (no KV groups), SwiGLU
683 (about 8/3 d): the usual small PyTorch GPT, so the two steps do the same work.
`configs/nanogpt_cpu.py:ncp` is ConceptLM at the same sizes (configs/tiny_ncp.py's 2/2/2-layer
hierarchy, k=4: four token-rate layers like the baseline, plus two at the concept rate).
"""
import tiny  # configs load with their own folder on sys.path
import tiny_ncp


def get_config(model="baseline"):
  c = tiny.get_config()
  c.model.update(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64,
                 mlp_dim=683, qk_norm="none", block_order="pre", full_attention_every=1)
  c.model.remat = "matmuls"  # faster on CPU than none: the scan stacks fewer residuals (docs/performance.md)
  c.data.update(seq_len=256, batch_size=16)
  c.optim.update(lr=1e-3, warmup_steps=100)
  return tiny_ncp.add_ncp(c) if model == "ncp" else c
