"""NCP-ArchPreview 8.94B (Table 10): E/C/D = 16/8/16 at OLMo-3-7B width, k=4, S=32, N=128.

Derived from configs/olmo3_7b.py (same backbone, data and optimiser); docs/ncp.md lists the
choices the paper leaves open. It reads the same token store, `data/dolma3_store`, prepared once
as that file's docstring says (python -m latent_jax.prepare --config configs/olmo3_7b.py --out
data/dolma3_store --config.data.source=... --config.data.tokenizer=...). 8,939,886,208
parameters; the codebook has N*d = 524,288.
"""
import olmo3_7b  # configs load with their own folder on sys.path
import tiny_ncp


def get_config():
  c = tiny_ncp.add_ncp(olmo3_7b.get_config())
  c.model.update(encoder_layers=16, concept_layers=8, decoder_layers=16, chunk_size=4, num_segments=32,
                 codebook_size=128)
  # 8 rows per chip on v5p-128 (fsdp=64) peak at 109.5 GiB with one microbatch, 89.7 GiB with two
  # (94% of HBM; both with bf16 params), 48.4 GiB with four and float32 master params (51%;
  # python -m latent_jax.plan, docs/performance.md).
  c.train.microbatches = 4
  return c  # ncp.alpha, ncp.beta follow d and S (tiny_ncp.per_dimension_weights)
