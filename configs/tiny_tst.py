"""Tiny Token-Superposition Training run: configs/tiny.py with TST's two phases (docs/tst.md)."""
import ml_collections

import tiny


def get_config():
  c = tiny.get_config()
  c.tst = ml_collections.ConfigDict()
  c.tst.enabled = True
  c.tst.s = 4                          # bag size: tokens averaged into one input / predicted as one bag
  c.tst.r = 0.3                        # phase 1 runs round(r * train.steps) steps, phase 2 the rest
  c.tst.budget = "flops"               # flops: phase-1 rows of seq_len*s tokens -> seq_len bags (the paper)
                                       # tokens: rows of seq_len tokens -> seq_len/s bags (Patch-Level Training)
  c.tst.carry = "all"                  # all: params + optimiser state + one LR schedule carry over (TST)
                                       # params: optimiser state and schedule restart in phase 2 (Patch-Level)
  c.tst.superpose = "both"             # both | input (bags in, next token out) | output (tokens in, next s out)
  c.tst.positions = "bag"              # RoPE position of a bag: bag (its index) | token (its first token's)
  c.tst.reinit_embeddings_at_switch = False  # TST Table 2 ablation: fresh embedding + LM head at phase 2
  return c
