"""The GPT-2-small shape on one GPU (V 50,304, d 768, 12 layers, 12 heads, 1,024 tokens, batch
16): the baseline that benchmarks/gpu_peer.py runs against a nanoGPT-style torch.compile step.

Pre-norm, full causal attention in every layer, multi-head, no QK-norm, tied embeddings (as
nanoGPT); SwiGLU 2048 does the FLOPs of GPT-2's GELU 3072. float32 master parameters and
optimiser state, bfloat16 compute, and no remat: an H200 holds the activations.
"""
import nanogpt_cpu  # configs load with their own folder on sys.path


def get_config(model="baseline"):
  c = nanogpt_cpu.get_config(model)
  c.model.update(vocab_size=50304, d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_dim=2048, tie_embeddings=True, dtype="bfloat16", remat="none",
                 scan_unroll=12)  # unrolled layers: 1.3x the scanned step on an H200 (docs/performance.md)
  c.data.update(seq_len=1024, batch_size=16)
  c.optim.update(lr=6e-4, warmup_steps=100)
  return c
