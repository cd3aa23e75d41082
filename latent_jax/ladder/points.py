"""A ladder config -> its points: the learning-rate tune, then for each seed, budget, method and size, one run.

A point's config is its method's recipe with overrides laid over it (the size; batch, learning rate,
warmup and Adam's beta2 from the rule; the steps its budget buys; the data store), so it is launched with
the train command like any run (`Point.launch`). The rule is keyed on the reference method's N at the
point's size, so every method trains a size with the same batch, warmup and base learning rate; each
method's learning rate is then scaled by the factor its tune found (`ladder tune`, docs/ladder.md).

Which sizes a method trains at a budget is chosen per method: first the `sizes_per_budget` whose tokens
per parameter (the method's own N) lie nearest `tokens_per_param`; then, while the lowest seed-mean loss
recorded so far sits at an edge of those sizes, the next size on that side, up to `max_sizes_per_budget`,
so that each IsoFLOP minimum ends with a size on either side. The plan therefore grows as results land
(from the recorded results only, so every machine that has them plans the same points).

Everything is checked here, before anything compiles: a size that does not fit a recipe, a budget too
small for one step, or a plan that would read more tokens than the store holds (no point sees a token
twice) is one ConfigError naming the setting.
"""
import dataclasses
import functools
import glob
import json
import math
import os
import re
import zlib

import jax
import numpy as np

from latent_jax.config import ConfigError, load_config
from latent_jax.data import store
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import flops, phases

SIZE = re.compile(r"^(\d+)x(\d+)$")


class TooFewSteps(ConfigError):
  """A budget that buys a size too few steps (another size may do)."""


@dataclasses.dataclass(frozen=True)
class Point:
  name: str               # METHOD_BUDGET_SIZE_sSEED (tune: tune_METHOD_BUDGET_SIZE_lrFACTOR_sSEED)
  stage: str              # "tune" (the learning-rate sweep) or "ladder"
  method: str
  budget: float           # the planned training FLOPs
  size: str               # WIDTHxDEPTH of the family
  seed: int
  recipe: str             # the method's config file ...
  overrides: tuple        # ... and the "a.b=v" overrides that make this point's config of it
  active_params: int      # N: active non-embedding parameters of the model (training-only heads excluded)
  total_params: int       # ... counting every expert of a mixture (= active_params for a dense model)
  reference_params: int   # the reference method's N at this size: the rule's key
  flops_per_token: float  # training FLOPs per data token, under the ladder's convention
  tokens: int             # data tokens the point reads
  steps: int
  batch_size: int         # rows of seq_len tokens
  warmup_steps: int
  lr: float
  lr_factor: float        # lr over the rule's: the tune's factor for the method (or the swept factor)
  flops: float            # tokens x flops_per_token: the budget, to within one step
  lm_head_flops: float    # the LM head's share of the run's training FLOPs (both conventions from one point)

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


def size_overrides(size, family, model):
  """The model fields of one size of the family (model: the recipe's model section). A mixture of experts
  keeps the dense MLP's active width: each of its top_k experts is mlp_ratio x width / top_k wide."""
  width, depth = parse_size(size)
  if width % family.head_dim:
    raise ConfigError(f"sizes: {size!r} has d_model {width}, not a multiple of family.head_dim={family.head_dim}; "
                      "choose widths that are.")
  heads = width // family.head_dim
  out = [f"model.d_model={width}", f"model.num_heads={heads}", f"model.num_kv_heads={max(1, heads // family.kv_group)}",
         f"model.head_dim={family.head_dim}", f"model.mlp_dim={round(family.mlp_ratio * width)}"]
  if model.moe.enabled:
    out.append(f"model.moe.expert_dim={max(1, round(family.mlp_ratio * width / model.moe.top_k))}")
  if model.name == "concept":
    e, c, d = (max(1, round(f * depth)) for f in family.concept_split)
    out += [f"model.encoder_layers={e}", f"model.concept_layers={c}", f"model.decoder_layers={d}"]
  else:
    out.append(f"model.num_layers={depth}")
  return out


@functools.lru_cache(maxsize=None)
def _config(recipe, overrides):
  return load_config(recipe, overrides)


def parameter_counts(cfg):
  """(active, total) non-embedding parameters of the inference model (cfg.model): every parameter but the
  token embedding and the LM head, a routed expert's counted top_k / num_experts in the active count."""
  _, abstract = abstract_model(cfg.model)
  return flops.parameter_counts(abstract, axes_tree(abstract), cfg.model)


@functools.lru_cache(maxsize=None)
def _parameter_counts(recipe, overrides):
  return parameter_counts(_config(recipe, overrides))


def counted_flops(cfg):
  """(training FLOPs with the LM head, the LM head's share, data tokens) of the whole run, over its phases
  (TST's bagged phase 1 included). The head's share is its matmul, forward + backward, 6 d V per position
  it scores (MTP scores each position twice)."""
  from latent_jax.config import mtp_enabled
  total, head, tokens = 0.0, 0.0, 0
  uses = 2 if mtp_enabled(cfg) else 1
  for p in phases.plan(cfg):
    steps = p.end - p.start
    total += steps * p.flops_per_step
    head += steps * uses * 6 * cfg.model.d_model * cfg.model.vocab_size * cfg.data.batch_size * p.positions
    tokens = p.tokens_at(p.end)
  return total, head, tokens


def rule(ladder, params):
  """(rows per batch, base lr) for N = params: batch tokens ~ N^batch_exponent (rows a power of two), lr ~ N^lr_exponent."""
  r = ladder.rule
  batch_tokens = r.batch_tokens * (params / r.params) ** r.batch_exponent
  rows = 2 ** max(0, round(math.log2(batch_tokens / ladder.seq_len)))
  return rows, r.lr * (params / r.params) ** r.lr_exponent


def store_data(ladder, required=True):
  """(training tokens, the data.* overrides that read the ladder's token store as it was prepared).

  Without the store and not `required` (plan, status): (None, data.source only); nothing that names a
  point or counts its FLOPs depends on the rest."""
  path = ladder.data
  if not store.is_store(path):
    if not required:
      return None, [f"data.source={path}"]
    recipe = ladder.get("data_recipe") or (f"python -m latent_jax.prepare --config configs/tiny.py "
                                           f"--config.data.source=TEXT --out {path}")
    raise ConfigError(f"data: {path!r} is not a token store; make it with: {recipe} (docs/ladder.md).")
  manifest, _ = store.open_store(path)
  data = [f"data.source={path}", f"data.val_fraction={manifest['val_fraction']}"]
  if manifest["doc_separator"]:
    data.append(f"data.doc_separator={manifest['doc_separator']}")
  return manifest["splits"]["train"]["tokens"], data


def _sized(ladder, name, size, seed, data):
  """(recipe, the overrides of the method at `size`, its N)."""
  m = ladder.methods[name]
  base = list(m.overrides) + data + [f"data.seq_len={ladder.seq_len}", f"train.seed={seed}", "train.monitors=False"]
  try:
    model = _config(m.recipe, tuple(base)).model
  except ConfigError as e:
    raise ConfigError(f"methods.{name}: {e}") from None
  sized = tuple(base + size_overrides(size, ladder.family, model))
  try:
    return m.recipe, sized, _parameter_counts(m.recipe, sized)
  except ConfigError as e:
    raise ConfigError(f"sizes: {size!r} does not fit method {name!r} ({m.recipe}): {e}") from None


def make_point(ladder, name, budget, size, seed, train_tokens, data, lr_factor=1.0, stage="ladder"):
  """One point: the recipe at `size`, trained for the steps that spend `budget`, with the rule's settings
  for the reference's N at that size and the method's lr scaled by `lr_factor`."""
  recipe, sized, (active_params, total_params) = _sized(ladder, name, size, seed, data)
  reference_params = _sized(ladder, ladder.reference, size, seed, data)[2][0]
  rows, base_lr = rule(ladder, reference_params)
  lr = float(f"{base_lr * lr_factor:.4g}")
  batch_tokens = rows * ladder.seq_len
  # FLOPs per step, averaged over the phases, from a long trial run: then the steps the budget buys.
  trial = _config(recipe, sized + (f"data.batch_size={rows}", "train.steps=1000"))
  total, head, _ = counted_flops(trial)
  per_step = (total if ladder.count_lm_head else total - head) / 1000
  steps = round(budget / per_step)
  if steps < 1 or ("tst" in trial and trial.tst.enabled and steps < 4):
    raise TooFewSteps(f"budgets: {budget:.3g} FLOPs buys {name} at {size} {steps} steps of {rows} x {ladder.seq_len} "
                      "tokens, too few to train; raise the budget or use smaller sizes.")
  # Warmup in tokens proportional to N (the reference's at this size), as OLMo-core's ladder; at least one step.
  warmup = min(max(1, round(ladder.rule.warmup_tokens_per_param * reference_params / batch_tokens)), max(1, steps - 1))
  checkpoint_every = max(1, round(ladder.train.checkpoint_fraction * steps))
  extra = [f"optim.b2={ladder.rule.beta2}"] if batch_tokens < ladder.rule.beta2_below_batch_tokens else []
  overrides = sized + tuple([
      f"data.batch_size={rows}", f"optim.lr={lr:.6g}", f"optim.warmup_steps={warmup}", *extra,
      f"train.steps={steps}", f"train.eval_every={steps}", f"train.eval_batches={ladder.train.eval_batches}",
      f"train.log_every={min(ladder.train.log_every, steps)}", f"train.checkpoint_every={checkpoint_every}"])
  try:
    cfg = _config(recipe, overrides)
  except ConfigError as e:
    raise ConfigError(f"point {name} {budget_name(budget)} {size}: {e}") from None
  total, head, tokens = counted_flops(cfg)
  run_flops = total if ladder.count_lm_head else total - head
  if train_tokens is not None and tokens > train_tokens:
    raise ConfigError(f"budgets: {name} at {size} with {budget:.3g} FLOPs reads {tokens:,} tokens, {tokens / train_tokens:.2f}x "
                      f"the {train_tokens:,} training tokens of {ladder.data}: it would see tokens twice. Lower the "
                      "budget, drop the smallest sizes, or prepare a larger corpus (docs/ladder.md).")
  base_name = f"{name}_{budget_name(budget)}_{size}"
  point_name = f"tune_{base_name}_lr{lr_factor:g}_s{seed}" if stage == "tune" else f"{base_name}_s{seed}"
  return Point(point_name, stage, name, float(budget), size, int(seed), recipe, overrides, active_params, total_params,
               reference_params,
               run_flops / tokens, tokens, steps, rows, warmup, lr, float(lr_factor), run_flops, head)


# ----------------------------------------------------------------------------- results

def read_results(results_dir):
  """{point name: its recorded result} of a ladder's results folder (points/ and tune/)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(results_dir, "points", "*.json")) +
                     glob.glob(os.path.join(results_dir, "tune", "*.json"))):
    with open(path) as f:
      result = json.load(f)
    out[result["name"]] = result
  return out


def _loss(result):
  """A recorded point's validation loss; inf when it diverged; None when it is not recorded."""
  if not result:
    return None
  return result["val_loss"] if result.get("status") == "done" else math.inf


# ----------------------------------------------------------------------------- the tune

def sweep(ladder, name, size, recorded):
  """The lr factors `name` trains at `size` in the tune: tune.lr_factors, then, while the lowest recorded
  loss is at the smallest or largest factor tried, one more step of the sweep's ratio beyond it, up to
  tune.max_factors (as the ladder widens sizes: a best factor at an edge is not a best factor)."""
  t = ladder.tune
  factors = sorted(t.lr_factors)
  ratio = factors[-1] / factors[-2]
  prefix = f"tune_{name}_{budget_name(t.budget)}_{size}_lr"
  while len(factors) < t.max_factors:
    losses = [_loss(recorded.get(f"{prefix}{f:g}_s{t.seed}")) for f in factors]
    if any(x is None for x in losses):
      break
    best = int(np.argmin(losses))
    if 0 < best < len(factors) - 1:
      break
    factors = [float(f"{factors[0] / ratio:.4g}")] + factors if best == 0 else factors + [float(f"{factors[-1] * ratio:.4g}")]
  return factors


def tune_points(ladder, data, train_tokens=None, recorded=None):
  """The learning-rate sweep: each method at each of tune.sizes and tune.budget, every factor of its sweep."""
  t, recorded = ladder.tune, recorded or {}
  return [make_point(ladder, name, t.budget, size, t.seed, train_tokens, data, lr_factor=f, stage="tune")
          for name in ladder.methods for size in t.sizes for f in sweep(ladder, name, size, recorded)]


def tuned(ladder, points, recorded):
  """{method: its tune summary (latent_jax/ladder/tune.py, numpy only)} for every method whose tune points
  are all recorded; without a tune, every method with no summary (factor 1)."""
  from latent_jax.ladder.tune import tune_summary
  if not ladder.tune.sizes:
    return {name: None for name in ladder.methods}
  return {m: s for m, s in tune_summary(tune_rows(points, recorded)).items() if s["complete"]}


def tune_rows(points, recorded):
  """The tune points as latent_jax/ladder/tune.py reads them (loss: None until recorded, inf if diverged)."""
  return [{"method": p.method, "size": p.size, "params": p.reference_params, "factor": p.lr_factor,
           "loss": _loss(recorded.get(p.name))} for p in points]


def lr_factor(summary, params):
  """The method's lr factor at the rule's key N = params: 1 without a tune (tune.factor_at)."""
  from latent_jax.ladder.tune import factor_at
  return 1.0 if summary is None else factor_at(summary, params)


# ----------------------------------------------------------------------------- sizes per method and budget

def candidates(ladder, name, budget, seed, data):
  """{size: point} of every size of the family that the budget buys a few steps of (lr factor 1)."""
  out = {}
  for size in ladder.sizes:
    try:
      out[size] = make_point(ladder, name, budget, size, seed, None, data)
    except TooFewSteps:
      pass
  return out


def window(ladder, name, budget, seeds, recorded, data):
  """The sizes `name` trains at `budget`: the initial ones nearest tokens_per_param (its own N), widened
  one size at a time towards the side where the lowest seed-mean loss recorded so far sits, while that
  size is at an edge, its lowest seed is recorded at every size, and fewer than max_sizes_per_budget are
  chosen. Returns (sizes in family order, the note on an edge that cannot be widened, or "")."""
  by_size = candidates(ladder, name, budget, seeds[0], data)
  family = [s for s in ladder.sizes if s in by_size]
  k = ladder.sizes_per_budget or len(ladder.sizes)
  if not by_size or len(by_size) < min(k, len(ladder.sizes)):
    raise ConfigError(f"budgets: {budget:.3g} FLOPs is too small: only {len(by_size)} of the sizes {list(ladder.sizes)} "
                      f"get a few steps of {name}; raise the budget or add smaller sizes.")
  first = sorted(family, key=lambda s: abs(math.log(by_size[s].tokens / by_size[s].active_params / ladder.tokens_per_param)))[:k]
  lo, hi = min(family.index(s) for s in first), max(family.index(s) for s in first)
  prefix = f"{name}_{budget_name(budget)}_"
  while True:
    sizes = family[lo:hi + 1]
    if any(_loss(recorded.get(f"{prefix}{s}_s{seeds[0]}")) is None for s in sizes):
      return sizes, ""
    means = [np.mean([x for x in (_loss(recorded.get(f"{prefix}{s}_s{seed}")) for seed in seeds) if x is not None])
             for s in sizes]
    best = int(np.argmin(means))
    if 0 < best < len(sizes) - 1:
      return sizes, ""
    side = "smallest" if best == 0 else "largest"
    if len(sizes) >= ladder.max_sizes_per_budget:
      return sizes, f"{side} size of {ladder.max_sizes_per_budget} (max_sizes_per_budget)"
    if best == 0 and lo > 0:
      lo -= 1
    elif best == len(sizes) - 1 and hi < len(family) - 1:
      hi += 1
    else:
      return sizes, f"{side} size the budget buys of the family"


def ladder_points(ladder, recorded=None, store_required=True):
  """(points, notes): the tune's points, then every ladder point the recorded results decide so far, in the
  order `run` trains them: tune, then budget (ascending), seed, method, size (a budget's seeds complete
  before the next budget starts, so a stopped ladder has whole budgets with their noise measured). Ladder points wait for their
  method's tune; a method's sizes may widen as its results land (`window`). notes: lines on what is not
  yet planned or cannot be bracketed."""
  recorded = recorded or {}
  train_tokens, data = store_data(ladder, required=store_required)
  tune = tune_points(ladder, data, train_tokens, recorded) if ladder.tune.sizes else []
  summaries = tuned(ladder, tune, recorded)
  points, notes = list(tune), []
  waiting = [name for name in ladder.methods if name not in summaries]
  if waiting:
    notes.append(f"the ladder's points of {', '.join(waiting)} wait for their tune points")
  windows = {}
  for budget in sorted(ladder.budgets):
    for name in ladder.methods:
      sizes, edge = window(ladder, name, budget, list(ladder.seeds), recorded, data)
      windows[budget, name] = sizes
      if edge:
        notes.append(f"{name} at {budget:.3g}: the lowest loss is at the {edge}; its minimum is not bracketed")
  for budget in sorted(ladder.budgets):
    for seed in ladder.seeds:
      for name in ladder.methods:
        # A method still waiting for its tune is checked all the same (every error before anything trains).
        made = [make_point(ladder, name, budget, size, seed, train_tokens, data,
                           lr_factor=lr_factor(summaries.get(name), _sized(ladder, ladder.reference, size, seed, data)[2][0]))
                for size in windows[budget, name]]
        points += made if name in summaries else []
  return points, notes


def shard(points, spec):
  """--shard I/N: the points whose name hashes to I mod N, so N jobs split a ladder with no coordinator
  (by name, not position: the plan grows as results land, and a point stays in its shard)."""
  if not spec:
    return points
  match = re.match(r"^(\d+)/(\d+)$", spec)
  if not match or not 0 <= int(match[1]) < int(match[2]):
    raise ConfigError(f"--shard {spec!r}: give I/N with 0 <= I < N, e.g. --shard 0/4 (the first of 4 jobs).")
  i, n = int(match[1]), int(match[2])
  return [p for p in points if zlib.crc32(p.name.encode()) % n == i]
