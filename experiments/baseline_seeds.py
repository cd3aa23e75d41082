"""How much does the tiny baseline's final validation loss move with the seed alone?

  python experiments/baseline_seeds.py [--root runs/experiments] [--seeds 0,1,2]

The spread sets the scale for every method comparison at this size: a difference smaller
than a few seed standard deviations is not a result. Writes experiments/results/baseline_seeds.*.
"""
from common import arguments, run_seeds, summarise, results_dir, write_results


def main():
  args = arguments(__doc__, seeds="0,1,2", smoke=False).parse_args()
  seeds = args.seeds
  runs = {"baseline (configs/tiny.py)": run_seeds("baseline_600", "tiny.py", [], seeds, args.root)}
  table = summarise(runs)
  write_results("baseline_seeds", table, runs,
                "# Seed spread of the tiny baseline (KJV, 600 steps x 16 x 128 tokens)", args.root,
                out=results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
