"""A block drafter for a trained tiny model (NCP Sec. 5.3; docs/ncp.md, "Concept-injected drafting").

  python -m latent_jax.draft --config configs/tiny_drafter.py --workdir runs/drafter \\
      --config.target=runs/ncp [--config.drafter.concept=none]

The target (a training workdir or an export) stays frozen; the drafter shares its token
embedding and LM head and learns the rest on the target's training split. The run is the
target's config (model, data, kernels) with these sections laid over it, trained by the one
train loop: it logs, evaluates, checkpoints and resumes like any run.
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
  c.drafter.anchors = 16          # anchors a row: random in training, strided in evaluation; each is one K-token block

  # Over the target's sections of the same names.
  c.data = ml_collections.ConfigDict()
  c.data.batch_size = 16          # rows of the target's data.seq_len tokens per step

  c.train = ml_collections.ConfigDict()
  c.train.steps = 400
  c.train.seed = 0                # the drafter's init and anchors, and the data order
  c.train.log_every = 50
  c.train.eval_every = 100        # the drafter's loss on held-out rows (strided anchors)
  c.train.eval_batches = 4
  c.train.checkpoint_every = 200

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"          # weight decay on matrices only; linear warmup, then cosine to 10%
  c.optim.lr = 3e-3
  c.optim.schedule = "cosine"
  c.optim.warmup_steps = 0.1      # a fraction of train.steps (40 of 400), as in configs/tiny.py
  c.optim.min_lr_ratio = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.1
  c.optim.clip_norm = 1.0

  c.mesh = ml_collections.ConfigDict()  # this machine's devices, whatever mesh the target trained on
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.slices = 1

  c.eval = ml_collections.ConfigDict()  # after training: per-slot accuracy and MAL (Eq. 27)
  c.eval.prompts = 64             # validation documents whose first tokens prompt the speculative decoding
  c.eval.prompt_len = 32
  c.eval.max_new_tokens = 64
  return c
