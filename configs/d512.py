"""A d=512 baseline (8 layers, 33.6M params with the 8k vocab): the CPU throughput reference."""
import tiny  # configs load with their own folder on sys.path


def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=8192, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                 mlp_dim=1536, window=256)
  c.model.remat = "matmuls"  # faster on CPU than none: the scan stacks fewer residuals (docs/performance.md)
  c.data.update(seq_len=512, batch_size=8)
  c.train.update(steps=2000, eval_every=500, checkpoint_every=500)
  c.optim.update(lr=1e-3, warmup_steps=200)
  return c
