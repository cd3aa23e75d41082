"""The scaling ladder (python -m latent_jax.ladder, docs/ladder.md): does a method buy compute?

  points.py   a ladder config -> its points, each an ordinary train run (recipe + overrides)
  plan.py     one line per point, the total, a wall-time estimate from measured steps, launch lines
  run.py      trains the points here (or every N-th: --shard), resumable; records each result
  status.py   done / partial / missing, with each point's validation loss
  fit.py      IsoFLOP minima, frontiers L(C), L(N, D), and compute multipliers with bootstrap
              intervals: numpy and scipy only, so `fit --points FILE.csv` runs anywhere
  plot.py     the IsoFLOP curves and the frontiers (matplotlib)

Nothing is imported here: `fit --points` must not pull in jax.
"""
