"""The phases of a run: one for a plain run, two for Token-Superposition Training (docs/tst.md).

A `Phase` says which global steps it covers, what its data iterator reads, which objective
and learning-rate schedule train it, and what one step costs in data tokens and FLOPs. The
train loop runs the phases in order; TST's switch goes through the phase-1 checkpoint.

TST phase 1 (steps 1..n1, n1 = round(tst.r * train.steps)) trains on bags of tst.s tokens:
  budget "flops":  rows of seq_len*s tokens -> seq_len bags (same FLOPs per step as phase 2)
  budget "tokens": rows of seq_len tokens -> seq_len/s bags (same data tokens per step)
  superpose "output": plain rows of seq_len tokens (the budget does not apply)
Phase 2 (steps n1+1..train.steps) is plain next-token prediction on rows of seq_len tokens.
"""
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from latent_jax.config import ConfigError, tst_enabled, tst_phase1_steps
from latent_jax.data.pipeline import num_windows
from latent_jax.nn import build_model
from latent_jax import objectives
from latent_jax.train import flops

# Parameters that TST's Table-2 ablation re-initialises at the switch.
EMBEDDING_PARAMS = ("embed", "lm_head")


@dataclasses.dataclass(frozen=True)
class Phase:
  number: int | None      # 1 or 2 in a TST run; None in a plain run (its rows carry no `phase`)
  start: int              # global step before the phase's first step
  end: int                # global step after its last step
  seq_len: int            # data tokens per row that the phase's iterator reads
  positions: int          # model positions per row (bags in TST phase 1)
  data_seed: int          # seed of the phase's train iterator
  objective: Callable     # (model, batch, cfg) -> (total loss, metrics)
  schedule_steps: int     # length of the LR schedule this phase's optimiser follows
  schedule_start: int     # global step at which that schedule is at its step 0
  fresh_optimizer: bool   # start from a fresh optimiser state rather than the carried one
  reinit_embeddings: bool # re-initialise the input embedding and LM head on entry
  tokens_per_step: int    # data tokens read per step (global batch)
  flops_per_step: float   # training FLOPs per step (global batch)
  tokens_start: int = 0   # data tokens read before the phase
  flops_start: float = 0.0

  def tokens_at(self, step):
    return self.tokens_start + (step - self.start) * self.tokens_per_step

  def flops_at(self, step):
    return self.flops_start + (step - self.start) * self.flops_per_step

  def describe(self, batch_size):
    name = "run" if self.number is None else f"phase {self.number}"
    rows = (f"rows of {self.seq_len} tokens" if self.seq_len == self.positions else
            f"rows of {self.seq_len} tokens -> {self.positions} bags of {self.seq_len // self.positions}")
    return (f"{name}: steps {self.start + 1}..{self.end}, batch {batch_size} {rows}, "
            f"{self.flops_per_step / self.tokens_per_step / 1e6:.2f} MFLOPs per data token")


def step_flops(cfg, batch_size, positions):
  """Training FLOPs of one step over `batch_size` rows of `positions` model positions (cfg: as flops_per_token)."""
  return batch_size * positions * flops.flops_per_token(cfg, positions)


def plan(cfg):
  """The run's phases, in order."""
  n, b, length, seed = cfg.train.steps, cfg.data.batch_size, cfg.data.seq_len, cfg.train.seed
  ntp = objectives.objective_for(cfg)
  plain_flops = step_flops(cfg, b, length)
  if not tst_enabled(cfg):
    return [Phase(None, 0, n, length, length, seed, ntp, n, 0, False, False, b * length, plain_flops)]

  t, n1 = cfg.tst, tst_phase1_steps(cfg)
  if t.superpose == "output":
    row, positions = length, length
  elif t.budget == "flops":
    row, positions = length * t.s, length
  else:
    row, positions = length, length // t.s
  cfg1 = cfg.copy_and_resolve_references()  # what a phase-1 step computes, for its FLOPs
  if t.superpose != "output":
    if "mtp" in cfg1:
      cfg1.mtp.enabled = False  # objectives.tst_objective: no MTP over bags
    if t.positions == "token" and cfg1.model.window > 0:
      # Bag positions s tokens apart: a window of w tokens spans about ceil(w / s) bags.
      cfg1.model.window = math.ceil(cfg1.model.window / t.s)
  carry_all = t.carry == "all"
  # Phase 1 reads its own shuffle (seed + 1), so that with budget "tokens" it does not read
  # the very rows phase 2 then starts with; phase 2 reads the baseline's batch sequence.
  phase1 = Phase(1, 0, n1, row, positions, seed + 1, objectives.tst_objective,
                 schedule_steps=n if carry_all else n1, schedule_start=0, fresh_optimizer=False,
                 reinit_embeddings=False, tokens_per_step=b * row,
                 flops_per_step=step_flops(cfg1, b, positions))
  phase2 = Phase(2, n1, n, length, length, seed, ntp,
                 schedule_steps=n if carry_all else n - n1, schedule_start=0 if carry_all else n1,
                 fresh_optimizer=not carry_all, reinit_embeddings=t.reinit_embeddings_at_switch,
                 tokens_per_step=b * length, flops_per_step=plain_flops,
                 tokens_start=phase1.tokens_at(n1), flops_start=phase1.flops_at(n1))
  return [phase1, phase2]


def phase_at(phases, step):
  """The phase that ran global step `step` (and saved a checkpoint there)."""
  return next(p for p in phases if p.start < step <= p.end)


def check_data(phases, train_tokens, batch_size):
  """Every phase's rows must give at least one batch (TST phase 1 reads longer rows)."""
  for p in phases:
    if p.seq_len != phases[-1].seq_len and num_windows(train_tokens, p.seq_len) < batch_size:
      raise ConfigError(
          f"tst.budget: phase 1 reads rows of data.seq_len * tst.s = {p.seq_len} tokens, but the training "
          f"split ({train_tokens} tokens) holds only {num_windows(train_tokens, p.seq_len)} of them, fewer than "
          f"data.batch_size={batch_size}; lower tst.s, data.seq_len or data.batch_size, or set tst.budget='tokens'.")


def reinit_embeddings(state, model_cfg, seed, shardings):
  """TST Table 2 ablation: a fresh input embedding and LM head (init seed + 1), their moments zeroed."""
  def fresh(state):
    new = nnx.to_pure_dict(nnx.state(build_model(model_cfg, nnx.Rngs(seed + 1))))
    names = [k for k in EMBEDDING_PARAMS if k in state["params"]]
    params = {**state["params"], **{k: new[k] for k in names}}
    zero = lambda path, x: jnp.zeros_like(x) if path and getattr(path[-1], "key", None) in names else x
    opt_state = jax.tree_util.tree_map_with_path(zero, state["opt_state"])
    return {**state, "params": params, "opt_state": opt_state}
  return jax.jit(fresh, out_shardings=shardings, donate_argnums=0)(state)
