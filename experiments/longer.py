"""Do the tiny verdicts on NITP and TST hold with twice the training?

  python experiments/longer.py [--root runs/experiments] [--seeds 0,1] [--steps N]

aux.py and tst.py compare at the shared 300-step budget (experiments/common.py), where NITP and
TST both ended above the baseline. This trains the baseline, NITP (configs/tiny_nitp.py) and TST
(configs/tiny_tst.py: s=4, r=0.3, equal FLOPs per step) at configs/tiny.py's own budget, 600
steps (about one pass over the KJV training split, warmup 50), evaluated every 25 steps, and
tabulates each method's change against the baseline at both budgets (the 300-step runs are
those of aux.py and tst.py, read from the same --root). Writes experiments/results/longer.*.
"""
from common import arguments, budget, run_seeds, summarise, results_dir, write_results

RUNS = [  # name, config; the baseline first: the others are measured against it
    ("baseline", "tiny.py"),
    ("nitp", "tiny_nitp.py"),
    ("tst", "tiny_tst.py"),
]
SHORT = {"baseline": "baseline", "nitp": "nitp", "tst": "tst_s4_r0.3"}  # the 300-step runs' folders


def main():
  args = arguments(__doc__).parse_args()
  long = ["train.eval_every=25"] + ([f"train.steps={args.steps}", "optim.warmup_steps=1"] if args.steps else [])
  runs = {name: run_seeds(f"long_{name}", config, long, args.seeds, args.root) for name, config in RUNS}
  table = summarise(runs)
  short = {name: summarise({name: run_seeds(SHORT[name], config, budget(args.steps), args.seeds, args.root)})[name]
           for name, config in RUNS}
  lines = ["| run | change vs baseline at 300 steps | change vs baseline at 600 steps |", "|---|---|---|"]
  for name, _ in RUNS[1:]:
    lines.append(f"| {name} | {short[name][1] - short['baseline'][1]:+.4f} | {table[name][1] - table['baseline'][1]:+.4f} |")
  write_results("longer", table, runs, "# NITP and TST at twice the comparison budget (KJV, 600 steps x 16 x 128 tokens)\n\n"
                f"Runs: configs/tiny.py, configs/tiny_nitp.py, configs/tiny_tst.py with {' '.join(long)}, seeds "
                f"{args.seeds}. Mean final validation NTP loss (nats/token).", args.root, footer="\n".join(lines),
                columns={"at 300 steps (mean)": {name: f"{short[name][1]:.4f}" for name, _ in RUNS}}, out=results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
