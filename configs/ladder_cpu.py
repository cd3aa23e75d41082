"""The CPU ladder (docs/ladder.md): baseline, NCP, NITP, TST and a tiny MoE, 3 budgets x 3-5 sizes x 3 seeds, on 2 cores.

  apt-get install -y dict-gcide python3.11-doc python3.11
  python experiments/ladder_corpus.py --out data/ladder_text
  python -m latent_jax.prepare --config configs/tiny.py --config.data.source=data/ladder_text \
      --config.data.val_fraction=0.01 --out data/ladder_store --workers=2 --sample_mb=16
  python -m latent_jax.ladder plan --config configs/ladder_cpu.py --workdir runs/ladder_cpu
  python -m latent_jax.ladder run --config configs/ladder_cpu.py --workdir runs/ladder_cpu

Each method is a recipe (a config file beside this one) plus overrides; every point of the ladder
is that recipe at one size of the family, trained for budget / FLOPs-per-token tokens, with batch,
warmup and learning rate from the rule (keyed on the reference's N at the size) times the method's
tuned factor. Finished points are recorded under `results`, committed, and never trained again.
"""
import os

import ml_collections

HERE = os.path.dirname(os.path.abspath(__file__))


def method(recipe, *overrides):
  """A method: a recipe beside this file, and "a.b=v" overrides laid over it."""
  return ml_collections.ConfigDict({"recipe": os.path.join(HERE, recipe), "overrides": tuple(overrides)})


def get_config():
  c = ml_collections.ConfigDict()
  c.data = "data/ladder_store"         # a token store (python -m latent_jax.prepare) that every point reads
  c.data_recipe = ("apt-get install -y dict-gcide python3.11-doc python3.11 && python experiments/ladder_corpus.py "
                   "--out data/ladder_text && python -m latent_jax.prepare --config configs/tiny.py "
                   "--config.data.source=data/ladder_text --config.data.val_fraction=0.01 --out data/ladder_store "
                   "--workers=2 --sample_mb=16")  # how to make the store (named by the error when it is missing)
  c.results = "experiments/results/ladder"  # finished points' results, one JSON file each; "" = WORKDIR/results
  c.seq_len = 128

  c.methods = ml_collections.ConfigDict()
  c.methods.baseline = method("tiny.py")
  c.methods.ncp = method("tiny_ncp.py")
  c.methods.nitp = method("tiny_nitp.py")
  c.methods.tst = method("tiny_tst.py")
  c.methods.moe = method("tiny_moe.py")  # top-2 of 8 experts, each mlp_ratio x width / 2 wide; N = active parameters
  c.reference = "baseline"             # the method every multiplier is measured against

  c.budgets = (2e12, 5e12, 1.2e13)     # training FLOPs of each point
  c.count_lm_head = True               # budgets count the LM head's matmul (False: leave it out, as NCP's C = F_tok x D)
  c.sizes = ("32x2", "48x2", "64x2", "80x3", "96x3", "128x4")  # the size family: WIDTHxDEPTH (d_model x layers)
  c.sizes_per_budget = 3               # per method and budget, first the sizes whose tokens per parameter (its own N)
  c.tokens_per_param = 20.0            # are nearest tokens_per_param (0 sizes_per_budget: every size); then
  c.max_sizes_per_budget = 5           # one more size on the side of the lowest loss while it is at an edge, up to this
  c.seeds = (0, 1, 2)

  c.family = ml_collections.ConfigDict()
  c.family.head_dim = 16               # heads = d_model / head_dim; kv heads = heads / kv_group
  c.family.kv_group = 1
  c.family.mlp_ratio = 3.0             # SwiGLU hidden = mlp_ratio * d_model
  c.family.concept_split = (0.5, 0.5, 0.5)  # ConceptLM: encoder / concept / decoder layers as fractions of depth

  # Batch in tokens proportional to N^(2/3) and learning rate to N^(-1/3) (OLMo-core's ladder rule),
  # anchored at configs/tiny.py: N = 0.79M non-embedding parameters, 16 x 128 tokens, lr 3e-3. N is the
  # reference method's at the point's size, so every method trains a size with one batch and warmup.
  c.rule = ml_collections.ConfigDict()
  c.rule.params = 788_352
  c.rule.batch_tokens = 2048
  c.rule.batch_exponent = 2 / 3
  c.rule.lr = 3e-3
  c.rule.lr_exponent = -1 / 3
  c.rule.warmup_tokens_per_param = 1.0  # warmup tokens = this x N (OLMo-core's ladder: N tokens)
  c.rule.beta2 = 0.99                  # Adam's beta2 for batches below beta2_below_batch_tokens (OLMo-core's rule,
  c.rule.beta2_below_batch_tokens = 524_288  # after Porian et al. 2024); larger batches keep the recipe's

  # The learning-rate tune (python -m latent_jax.ladder tune; run does it first): each method at two sizes
  # and every factor of the rule's lr; the best factors, interpolated in ln N between the two sizes (held beyond),
  # scale the method's lr at every size.
  c.tune = ml_collections.ConfigDict()
  c.tune.budget = 2e12
  c.tune.sizes = ("32x2", "64x2")      # () = no tune: every method at the rule's lr
  c.tune.lr_factors = (0.5, 1.0, 2.0)
  c.tune.max_factors = 5               # a best factor at the sweep's edge adds the next one beyond it, up to this many
  c.tune.seed = 0

  c.train = ml_collections.ConfigDict()  # laid over every point's recipe
  c.train.log_every = 25
  c.train.checkpoint_fraction = 0.25   # a checkpoint every quarter of a point (a stopped ladder resumes mid-point)
  c.train.eval_batches = 0             # 0: the whole validation split, scored once at the end of each point
  return c
