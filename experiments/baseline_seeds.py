"""How much does the tiny baseline's final validation loss move with the seed alone?

  python experiments/baseline_seeds.py [--root runs/experiments] [--seeds 0,1,2]

The spread sets the scale for every method comparison at this size: a difference smaller
than a few seed standard deviations is not a result. Writes experiments/results/baseline_seeds.*.
"""
import argparse

from common import run_seeds, summarise, write_results


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", default="runs/experiments")
  p.add_argument("--seeds", default="0,1,2")
  args = p.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {"baseline (configs/tiny.py)": run_seeds("baseline_600", "tiny.py", [], seeds, args.root)}
  table = summarise(runs)
  write_results("baseline_seeds", table, runs,
                "# Seed spread of the tiny baseline (KJV, 600 steps x 16 x 128 tokens)")
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
