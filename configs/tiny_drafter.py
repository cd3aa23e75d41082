"""A block drafter for a trained tiny model (NCP Sec. 5.3; docs/ncp.md, "Concept-injected drafting").

  python -m latent_jax.draft --config configs/tiny_drafter.py --workdir runs/drafter \\
      --config.target=runs/ncp [--config.drafter.concept=none]

The target (a training workdir or an export) stays frozen; the drafter shares its token
embedding and LM head and learns the rest on the target's training split.
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ""                   # workdir or export folder of the trained target model (required)

  c.drafter = ml_collections.ConfigDict()
  c.drafter.block_size = 8        # K tokens proposed per round (the paper verifies 16)
  c.drafter.num_layers = 2        # Blocks of the target's width
  c.drafter.context = 16          # W target hidden states before the anchor that the drafter reads
  # Eq. 26's signal c: predicted (the concept mixture ConceptLM injects at the last verified token,
  # the default) | pooled (the mean-pooled concept of that same chunk) | none (the baseline drafter).
  c.drafter.concept = "predicted"
  # What the K proposals learn (the paper does not say): data (the row's next tokens) | target (the
  # target's greedy token at each of those positions, after the data before it: teacher-forced).
  c.drafter.labels = "data"

  c.train = ml_collections.ConfigDict()
  c.train.steps = 400
  c.train.batch_size = 16         # rows of the target's data.seq_len tokens per step
  c.train.anchors = 16            # anchors sampled per row; each is one K-token block to predict
  c.train.lr = 3e-3               # AdamW, linear warmup then cosine to 10%
  c.train.warmup_steps = 40
  c.train.seed = 0                # the drafter's init, anchor sampling and data order
  c.train.log_every = 50

  c.eval = ml_collections.ConfigDict()
  c.eval.batches = 4              # validation batches for the drafter's loss and per-slot accuracy
  c.eval.prompts = 64             # validation documents whose first tokens prompt the speculative decoding
  c.eval.prompt_len = 32
  c.eval.max_new_tokens = 64
  return c
