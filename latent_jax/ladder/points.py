"""A ladder config -> its points: for each seed, budget, method and size, one ordinary training run.

A point's config is its method's recipe with overrides laid over it (the size, the batch and the
learning rate from the rule, the steps its budget buys, the data store), so it is launched with the
train command like any run (`Point.launch`). Everything is checked here, before anything compiles:
a size that does not fit a recipe, a budget too small for one step, or a plan that would read more
tokens than the store holds (no point sees a token twice) is one ConfigError naming the setting.
"""
import dataclasses
import math
import os
import re

import jax
import numpy as np

from latent_jax.config import ConfigError, load_config
from latent_jax.data import store
from latent_jax.nn import abstract_model
from latent_jax.train import phases

EMBEDDINGS = ("embed", "lm_head")  # left out of N, as Kaplan et al. and NCP's Appendix D leave them out
SIZE = re.compile(r"^(\d+)x(\d+)$")


class TooFewSteps(ConfigError):
  """A budget that buys a size too few steps (another size may do)."""


@dataclasses.dataclass(frozen=True)
class Point:
  name: str               # METHOD_BUDGET_SIZE_sSEED, its workdir's and its result file's name
  method: str
  budget: float           # the planned training FLOPs
  size: str               # WIDTHxDEPTH of the family
  seed: int
  recipe: str             # the method's config file ...
  overrides: tuple        # ... and the "a.b=v" overrides that make this point's config of it
  params: int             # N: non-embedding parameters of the model (training-only heads excluded)
  flops_per_token: float  # training FLOPs per data token, under the ladder's convention
  tokens: int             # data tokens the point reads
  steps: int
  batch_size: int         # rows of seq_len tokens
  lr: float
  flops: float            # tokens x flops_per_token: the budget, to within one step

  def launch(self, workdir):
    """The train command that runs this point in WORKDIR/NAME."""
    overrides = " ".join(f"--config.{o}" for o in self.overrides)
    recipe = os.path.relpath(self.recipe) if os.path.isabs(self.recipe) else self.recipe
    return f"python -m latent_jax.train --config {recipe} {overrides} --workdir {os.path.join(workdir, self.name)}"

  def config(self):
    return load_config(self.recipe, self.overrides)


def budget_name(budget):
  """3e12 -> '3e12', 2.5e13 -> '2.5e13'."""
  mantissa, exponent = f"{budget:.3g}".split("e") if "e" in f"{budget:.3g}" else (f"{budget:.3g}", "0")
  return f"{mantissa}e{int(exponent)}"


def parse_size(size):
  match = SIZE.match(str(size))
  if not match:
    raise ConfigError(f"sizes: {size!r} is not WIDTHxDEPTH (d_model x layers), e.g. '128x4'.")
  return int(match[1]), int(match[2])


def size_overrides(size, family, model_name):
  """The model fields of one size of the family."""
  width, depth = parse_size(size)
  if width % family.head_dim:
    raise ConfigError(f"sizes: {size!r} has d_model {width}, not a multiple of family.head_dim={family.head_dim}; "
                      "choose widths that are.")
  heads = width // family.head_dim
  out = [f"model.d_model={width}", f"model.num_heads={heads}", f"model.num_kv_heads={max(1, heads // family.kv_group)}",
         f"model.head_dim={family.head_dim}", f"model.mlp_dim={round(family.mlp_ratio * width)}"]
  if model_name == "concept":
    e, c, d = (max(1, round(f * depth)) for f in family.concept_split)
    out += [f"model.encoder_layers={e}", f"model.concept_layers={c}", f"model.decoder_layers={d}"]
  else:
    out.append(f"model.num_layers={depth}")
  return out


def non_embedding_params(cfg):
  """N of the inference model (cfg.model): every parameter but the token embedding and the LM head."""
  _, params = abstract_model(cfg.model)
  return sum(int(np.prod(x.shape)) for k, v in params.items() if k not in EMBEDDINGS for x in jax.tree.leaves(v))


def counted_flops(cfg, count_lm_head):
  """(training FLOPs, data tokens) of the whole run, over its phases (TST's bagged phase 1 included);
  without the LM head's matmul (forward + backward: 6 d V per position) when count_lm_head is False."""
  total, tokens = 0.0, 0
  for p in phases.plan(cfg):
    per_step = p.flops_per_step
    if not count_lm_head:
      per_step -= 6 * cfg.model.d_model * cfg.model.vocab_size * cfg.data.batch_size * p.positions
    total += (p.end - p.start) * per_step
    tokens = p.tokens_at(p.end)
  return total, tokens


def rule(ladder, params):
  """(rows per batch, lr) for N = params: batch tokens ~ N^batch_exponent (rows a power of two), lr ~ N^lr_exponent."""
  r = ladder.rule
  batch_tokens = r.batch_tokens * (params / r.params) ** r.batch_exponent
  rows = 2 ** max(0, round(math.log2(batch_tokens / ladder.seq_len)))
  return rows, r.lr * (params / r.params) ** r.lr_exponent


def store_data(path):
  """(training tokens, the data.* overrides that read the ladder's token store as it was prepared)."""
  if not store.is_store(path):
    raise ConfigError(f"data: {path!r} is not a token store; make one with python -m latent_jax.prepare "
                      f"--config configs/tiny.py --config.data.source=TEXT --out {path} (docs/ladder.md).")
  manifest, _ = store.open_store(path)
  data = [f"data.source={path}", f"data.val_fraction={manifest['val_fraction']}"]
  if manifest["doc_separator"]:
    data.append(f"data.doc_separator={manifest['doc_separator']}")
  return manifest["splits"]["train"]["tokens"], data


def make_point(ladder, name, budget, size, seed, train_tokens, data):
  """One point: the recipe at `size`, trained for the steps that spend `budget`."""
  m = ladder.methods[name]
  recipe = m.recipe
  base = list(m.overrides) + data + [f"data.seq_len={ladder.seq_len}", f"train.seed={seed}"]
  try:
    model_name = load_config(recipe, base).model.name
  except ConfigError as e:
    raise ConfigError(f"methods.{name}: {e}") from None
  sized = base + size_overrides(size, ladder.family, model_name)
  try:
    cfg = load_config(recipe, sized)
  except ConfigError as e:
    raise ConfigError(f"sizes: {size!r} does not fit method {name!r} ({recipe}): {e}") from None
  params = non_embedding_params(cfg)
  rows, lr = rule(ladder, params)
  # FLOPs per step, averaged over the phases, from a long trial run: then the steps the budget buys.
  trial = load_config(recipe, sized + [f"data.batch_size={rows}", "train.steps=1000"])
  steps = round(budget / (counted_flops(trial, ladder.count_lm_head)[0] / 1000))
  if steps < 1 or ("tst" in trial and trial.tst.enabled and steps < 4):
    raise TooFewSteps(f"budgets: {budget:.3g} FLOPs buys {name} at {size} {steps} steps of {rows} x {ladder.seq_len} "
                      "tokens, too few to train; raise the budget or use smaller sizes.")
  warmup = max(1, round(ladder.rule.warmup_fraction * steps))
  checkpoint_every = max(1, round(ladder.train.checkpoint_fraction * steps))
  overrides = tuple(sized + [
      f"data.batch_size={rows}", f"optim.lr={lr:.6g}", f"optim.warmup_steps={min(warmup, steps - 1) or 1}",
      f"train.steps={steps}", f"train.eval_every={steps}", f"train.eval_batches={ladder.train.eval_batches}",
      f"train.log_every={min(ladder.train.log_every, steps)}", f"train.checkpoint_every={checkpoint_every}"])
  try:
    cfg = load_config(recipe, overrides)
  except ConfigError as e:
    raise ConfigError(f"point {name} {budget_name(budget)} {size}: {e}") from None
  flops, tokens = counted_flops(cfg, ladder.count_lm_head)
  if tokens > train_tokens:
    raise ConfigError(f"budgets: {name} at {size} with {budget:.3g} FLOPs reads {tokens:,} tokens, {tokens / train_tokens:.2f}x "
                      f"the {train_tokens:,} training tokens of {ladder.data}: it would see tokens twice. Lower the "
                      "budget, drop the smallest sizes, or prepare a larger corpus (docs/ladder.md).")
  return Point(f"{name}_{budget_name(budget)}_{size}_s{seed}", name, float(budget), size, int(seed), recipe, overrides,
               params, flops / tokens, tokens, steps, rows, lr, flops)


def pick_sizes(ladder, budget, seed, data):
  """The sizes every method trains at `budget`: the sizes_per_budget whose tokens per parameter D/N,
  for the reference method, lie nearest tokens_per_param (log scale). One set of sizes for all methods
  pairs their points size by size (the paired bootstrap of fit.py)."""
  candidates = []
  for size in ladder.sizes:
    try:
      candidates.append(make_point(ladder, ladder.reference, budget, size, seed, float("inf"), data))
    except TooFewSteps:
      pass  # a smaller size may do; none at all is refused below
  k = ladder.sizes_per_budget or len(ladder.sizes)
  chosen = sorted(candidates, key=lambda p: abs(math.log(p.tokens / p.params / ladder.tokens_per_param)))[:k]
  if len(chosen) < min(k, len(ladder.sizes)):
    raise ConfigError(f"budgets: {budget:.3g} FLOPs is too small: only {len(chosen)} of the sizes {list(ladder.sizes)} "
                      f"get a few steps of {ladder.reference}; raise the budget or add smaller sizes.")
  return [p.size for p in sorted(chosen, key=lambda p: p.params)]


def ladder_points(ladder):
  """Every point of the ladder, in the order `run` trains them: seed, budget (ascending), size, method."""
  train_tokens, data = store_data(ladder.data)
  points = []
  for seed in ladder.seeds:
    for budget in sorted(ladder.budgets):
      for size in pick_sizes(ladder, budget, seed, data):
        points += [make_point(ladder, name, budget, size, seed, train_tokens, data) for name in ladder.methods]
  return points


def shard(points, spec):
  """--shard I/N: every N-th point from the I-th (0 <= I < N), so N jobs split a ladder with no coordinator."""
  if not spec:
    return points
  match = re.match(r"^(\d+)/(\d+)$", spec)
  if not match or not 0 <= int(match[1]) < int(match[2]):
    raise ConfigError(f"--shard {spec!r}: give I/N with 0 <= I < N, e.g. --shard 0/4 (the first of 4 jobs).")
  i, n = int(match[1]), int(match[2])
  return points[i::n]
