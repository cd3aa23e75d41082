"""VQ adaptation of a trained tiny ConceptLM (NCP paper Sec. 5.1, Tables 5-7; docs/ncp.md).

Only the PQ codebook and the concept prediction heads train (`optim.trainable = "vq"`); the
encoder, concept module, decoder, embeddings and LM head stay as the source run left them.
Point `train.init_from` at that run (a workdir or an export) and `data.source` at the domain:

  python -m latent_jax.train --config configs/tiny_ncp_adapt.py --workdir runs/adapt \\
      --config.train.init_from=runs/ncp --config.data.source=my_domain/

The paper gives no adaptation hyperparameters; these are a short, constant-rate run.

The adapted model keeps its source's tokenizer, so the source run decides whether the domain's text is
spelt in learnt pieces: a KJV-only tokenizer spells digits as byte-fallback pieces, and the math proxies
then read as noise (docs/data.md, "Capability proxies"). Train the source with a tokenizer that covers the
domains it will be adapted to:

  python -m latent_jax.train --config configs/tiny_ncp.py --workdir runs/ncp \\
      --config.data.tokenizer_sources=arithmetic,python_stdlib,kjv_facts
"""
import tiny_ncp  # configs load with their own folder on sys.path


def get_config():
  c = tiny_ncp.get_config()
  c.optim.trainable = "vq"
  c.optim.update(lr=1e-3, schedule="constant", warmup_steps=10, weight_decay=0.0)
  c.train.update(steps=200, eval_every=50, checkpoint_every=100)
  return c
