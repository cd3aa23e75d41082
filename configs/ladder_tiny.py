"""A ladder small enough to run end to end in a couple of minutes (the slow tier's test, a first try):
the baseline and TST, two budgets, two sizes, on a small token store with a 320-piece vocabulary.

  python -m latent_jax.prepare --config configs/tiny.py --config.model.vocab_size=320 \
      --config.data.source=TEXT --out data/ladder_tiny_store
  python -m latent_jax.ladder run --config configs/ladder_tiny.py --workdir runs/ladder_tiny
"""
import ladder_cpu  # configs load with their own folder on sys.path
from ladder_cpu import method

SMALL = ("model.vocab_size=320", "model.window=8", "model.full_attention_every=2", "kernels.impl=xla")


def get_config():
  c = ladder_cpu.get_config()
  c.data = "data/ladder_tiny_store"
  c.results = ""                        # WORKDIR/results
  c.seq_len = 32
  c.methods = ladder_cpu.ml_collections.ConfigDict()
  c.methods.baseline = method("tiny.py", *SMALL)
  c.methods.tst = method("tiny_tst.py", *SMALL)
  c.budgets = (2e8, 4e8)
  c.sizes = ("16x1", "24x2")
  c.sizes_per_budget = 0               # both sizes at both budgets
  c.seeds = (0,)                        # one seed: no noise estimate (the fits' intervals are tested on their own)
  c.tune.budget = 2e8
  c.tune.sizes = ("16x1",)
  c.tune.lr_factors = (0.5, 2.0)
  c.tune.max_factors = 2                # no widening: two factors always have their best at an edge
  c.family.head_dim = 8
  c.rule.params = 20_000               # anchored so that the sizes train 8 rows of 32 tokens
  c.rule.batch_tokens = 256
  c.train.log_every = 5
  c.train.eval_batches = 4
  return c
