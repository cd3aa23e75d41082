"""The NCP paper's ablation ladder (Fig. 3, Table 2) and residual variants (Table 3) at tiny size.

  python -m latent_jax.train --config configs/ncp_ladder.py:RUNG --workdir runs/RUNG

The paper's 16/8/16-layer ConceptLM costs E + C/k + D = 34 blocks per token against baselines of
32 (vanilla: E + D layers), 34 (compute-aligned) and 40 (size-aligned: E + C + D layers). Here
the hierarchy is configs/tiny_ncp.py's 2/2/2 with k = 4: 4.5 blocks per token, 6 blocks of
parameters. Layers are whole, so the compute-aligned baseline has 5 layers, half a block more
per token than ConceptLM (the rounding favours the baseline). `experiments/ncp_ablation.py`
runs the ladder and reports the FLOPs per token of each rung.

Rungs (the concept rungs differ from configs/tiny_ncp.py only where named):
  vanilla          baseline, E + D = 4 layers (configs/tiny.py)
  compute_aligned  baseline, 5 layers (E + D + C/k = 4.5, rounded up)
  size_aligned     baseline, E + C + D = 6 layers
  cm               + concept module: ConceptLM, no IRC/CRC, trained on NTP only (alpha = beta = 0)
  residual         + IRC and all CRC routes, still NTP only
  ncp              + the NCP and VQ losses: the full method (= configs/tiny_ncp.py)
  no_residual      Table 3: NCP without IRC or CRC
  irc_only         Table 3: NCP with IRC, no CRC; IRC + CRC is `ncp`
"""
import tiny
import tiny_ncp

from latent_jax.config import ConfigError

NO_CRC = dict(crc_encoder_concept=False, crc_encoder_decoder=False, crc_concept_decoder=False)
RUNGS = {
    "vanilla": ("baseline", dict(num_layers=4), False),
    "compute_aligned": ("baseline", dict(num_layers=5), False),
    "size_aligned": ("baseline", dict(num_layers=6), False),
    "cm": ("concept", dict(irc=False, **NO_CRC), False),
    "residual": ("concept", {}, False),
    "ncp": ("concept", {}, True),
    "no_residual": ("concept", dict(irc=False, **NO_CRC), True),
    "irc_only": ("concept", NO_CRC, True),
}


def get_config(rung=None):
  if rung is None:  # training one rung silently, unnamed, is a run nobody asked for
    raise ConfigError(f"--config configs/ncp_ladder.py needs a rung after a colon, e.g. configs/ncp_ladder.py:ncp; "
                      f"the rungs are {list(RUNGS)}.")
  if rung not in RUNGS:
    raise ConfigError(f"--config configs/ncp_ladder.py:{rung}: unknown rung; pick one of {list(RUNGS)}.")
  name, model, ncp_losses = RUNGS[rung]
  c = tiny.get_config() if name == "baseline" else tiny_ncp.add_ncp(tiny.get_config())
  c.model.update(model)
  if name == "concept" and not ncp_losses:
    c.ncp.alpha = c.ncp.beta = 0.0  # the concept path trains through NTP alone
  return c
