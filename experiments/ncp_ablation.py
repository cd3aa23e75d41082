"""NCP against its baselines at equal tokens: the NCP paper's Fig. 3 / Table 2 at tiny size.

  python experiments/ncp_ablation.py [--root runs/experiments] [--seeds 0,1] [--rungs ...] [--steps N]

Runs the rungs of configs/ncp_ladder.py (default: vanilla, compute-aligned and size-aligned
baselines, and the full NCP model; `--rungs` adds +CM, +Residual and the Table 3 residual
variants) for each seed on the embedded corpus at the comparison budget of experiments/common.py
(300 steps of 16 x 128 tokens), every run reading the same tokens, and writes
the final validation NTP loss, FLOPs per token and parameters to experiments/results/ncp_ablation.*.
"""
import jax
from flax import nnx

from common import CONFIGS, arguments, budget, run_seeds, summarise, results_dir, write_results
from latent_jax import build_model, load_config
from latent_jax.train import flops

# Run names shared with the other experiments: the vanilla rung is configs/tiny.py, the NCP rung
# configs/tiny_ncp.py, so those runs train once for every script.
SHARED = {"vanilla": ("baseline", "tiny.py"), "ncp": ("ncp", "tiny_ncp.py")}
DEFAULT_RUNGS = "vanilla,compute_aligned,size_aligned,ncp"
PAPER = ("Paper (NCP-ArchPreview, Fig. 3 and Table 2, first 200B tokens): the 16/8/16 ConceptLM "
         "(34 blocks per token, 40 blocks of parameters) is compared with vanilla (32 layers), "
         "compute-aligned (34) and size-aligned (40) baselines, and beats all three; residual variants "
         "at 1B / 150B tokens (Table 3): none 2.2588, IRC 2.2315, IRC+CRC 2.2265.")


def describe(config):
  cfg = load_config(f"{CONFIGS}/{config}")
  model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return flops.flops_per_token(cfg.model, cfg.data.seq_len), params


def main():
  p = arguments(__doc__)
  p.add_argument("--rungs", default=DEFAULT_RUNGS)
  args = p.parse_args()
  seeds = args.seeds
  overrides = budget(args.steps)
  runs, cost = {}, {}
  for rung in args.rungs.split(","):
    name, config = SHARED.get(rung, (f"ladder_{rung}", f"ncp_ladder.py:{rung}"))
    runs[rung] = run_seeds(name, config, overrides, seeds, args.root)
    cost[rung] = describe(config)
  table = summarise(runs)
  ref_flops = cost.get("vanilla", next(iter(cost.values())))[0]
  columns = {"MFLOPs / token": {r: f"{f / 1e6:.2f} ({f / ref_flops:.3f}x)" for r, (f, _) in cost.items()},
             "params": {r: f"{n / 1e6:.3f}M" for r, (_, n) in cost.items()}}
  write_results("ncp_ablation", table, runs,
                f"# NCP ablation ladder at tiny size (KJV, 300 steps, configs/ncp_ladder.py, seeds {','.join(map(str, seeds))})",
                args.root, columns=columns, footer=PAPER, out=results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
