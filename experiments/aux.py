"""Do the auxiliary objectives help at tiny scale? NTP vs NITP vs NTP+MTP, and NCP vs NCP+MTP.

  python experiments/aux.py [--root runs/experiments] [--seeds 0,1] [--steps N]

Every run reads the same data for the same steps, at the comparison budget of
experiments/common.py (equal tokens; the heads add FLOPs, logged).
Writes experiments/results/aux.{md,json,png}: final validation loss per seed, and each method's
change against its base run beside the papers' (docs/aux.md). `--steps N` shortens every run
to prove the script works (a smoke test, written under ROOT/smokeN, never to results/).
"""

from common import arguments, budget, run_seeds, summarise, results_dir, write_results

RUNS = [  # name, config, overrides, the run it is compared with (run after its own: they are shared)
    ("baseline", "tiny.py", [], None),
    ("nitp", "tiny_nitp.py", [], "baseline"),
    ("mtp", "tiny.py", ["mtp.enabled=True"], "baseline"),
    ("ncp", "tiny_ncp.py", [], "baseline"),
    ("ncp_mtp", "tiny_ncp.py", ["mtp.enabled=True"], "ncp"),
]
SHARED = ("baseline", "ncp")  # trained by ncp_ablation.py and tst.py too; run last
# Final losses the papers report for the same comparisons (docs/aux.md).
PAPERS = {
    "baseline": "2.3805 (NCP Table 8, 3B)",
    "nitp": "gains at every scale (NITP paper; no shared-setup number)",
    "mtp": "2.3739 (-0.0066)",
    "ncp": "2.3707 (-0.0098)",
    "ncp_mtp": "2.3664 (-0.0043 vs NCP)",
}


def main():
  p = arguments(__doc__)
  args = p.parse_args()
  seeds = args.seeds
  overrides = budget(args.steps)
  order = sorted(RUNS, key=lambda run: run[0] in SHARED)
  runs = {name: run_seeds(name, config, overrides + extra, seeds, args.root) for name, config, extra, _ in order}
  runs = {name: runs[name] for name, *_ in RUNS}
  table = summarise(runs)
  described = ", ".join(f"{n} = configs/{c} {' '.join(e)}".strip() for n, c, e, _ in RUNS)
  lines = ["| run | vs | change in mean val_loss | paper (final loss) |", "|---|---|---|---|"]
  for name, _, _, base in RUNS:
    delta = f"{table[name][1] - table[base][1]:+.4f}" if base else ""
    lines.append(f"| {name} | {base or ''} | {delta} | {PAPERS[name]} |")
  write_results("aux", table, runs, "# Auxiliary objectives on the tiny recipes (KJV, equal tokens)\n\n"
                f"Runs: {described}; overrides {overrides}, seeds {seeds}.", args.root, footer="\n".join(lines), out=results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
