"""OLMo-3-7B-shaped baseline: 32 layers at d=4096, the width of NCP-ArchPreview (Table 10).

The vanilla reference of the NCP ablations (configs/ncp_archpreview_8b.py derives from it). RoPE as
in the released OLMo-3 7B's config.json: plain on the sliding-window layers, YaRN on every 4th,
full-attention, layer (factor 8 over an original context of 8,192, beta_fast 32, beta_slow 1,
attention factor 0.1 ln 8 + 1). Not for CPUs: the mesh should shard (e.g. --config.mesh.fsdp=-1
--config.mesh.data=1), and it reads a token store, `data/dolma3_store`, tokenised once from the
pretraining text with OLMo-3's tokenizer (on every host of a slice, with the multi-host flags:
process 0 writes it; docs/data.md, docs/launch.md):

  python -m latent_jax.prepare --config configs/olmo3_7b.py --out data/dolma3_store \
    --config.data.source='/data/dolma3/*.jsonl' --config.data.tokenizer=/data/olmo3/tokenizer.json

Elsewhere (a bucket's FUSE mount), point training at it: --config.data.source=/mnt/bucket/dolma3_store.
Text files as data.source are refused on several hosts (each would tokenise the whole text at every
start) and above data.max_text_gib.
"""
import math

import tiny  # configs load with their own folder on sys.path


def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=100_278, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                 mlp_dim=11_008, rope_base=500_000.0, norm_eps=1e-6, qk_norm="layer", block_order="post",
                 window=4096, full_attention_every=4, tie_embeddings=False, param_dtype="float32",
                 dtype="bfloat16", remat="full")  # float32 master params and optimiser state, bf16 compute
  c.model.update(rope_scaling="yarn", yarn_factor=8.0, yarn_original_context=8192, yarn_beta_fast=32.0,
                 yarn_beta_slow=1.0, yarn_attention_factor=0.1 * math.log(8.0) + 1.0)
  c.data.update(source="data/dolma3_store", seq_len=8192, batch_size=512)  # ~4.2M tokens per step
  c.train.update(steps=1_370_000, z_loss=1e-5, log_every=10, eval_every=5000, eval_batches=64,
                 checkpoint_every=5000)  # ~5.73T tokens (NCP Stage 1)
  c.optim.update(name="muon", lr=6e-5, schedule="cosine", warmup_steps=2000, min_lr_ratio=0.1,
                 weight_decay=0.1, clip_norm=1.0)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  return c
