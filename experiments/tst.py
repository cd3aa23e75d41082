"""Token-Superposition Training against the baseline at equal total FLOPs (TST paper, Fig. 1 and Table 2).

  python experiments/tst.py [--root runs/experiments] [--seeds 0,1] [--steps N]

Every run is configs/tiny.py at the comparison budget of experiments/common.py (300 steps), with
the same FLOPs per step in both phases (tst.budget="flops"), so equal steps are equal FLOPs.
Runs: the baseline; TST with s=4, r=0.3 (configs/tiny_tst.py); an s/r sweep (s in {2, 8} at
r=0.3, r in {0.2, 0.4} at s=4); and the representation-alignment ablation (s=4, r=0.3, a fresh
embedding and LM head at the switch). Reports the final
validation NTP loss and the FLOPs and training wall time each run needs to reach the
baseline's final loss, in experiments/results/tst.*.
"""
import statistics

from common import arguments, budget, cost_to_reach, run_seeds, summarise, wall_seconds, write_results

# (label, run folder, config, overrides); the baseline last: ncp_ablation.py and aux.py share it.
RUNS = [
    ("tst s=4 r=0.3", "tst_s4_r0.3", "tiny_tst.py", []),
    ("tst s=2 r=0.3", "tst_s2_r0.3", "tiny_tst.py", ["tst.s=2"]),
    ("tst s=8 r=0.3", "tst_s8_r0.3", "tiny_tst.py", ["tst.s=8"]),
    ("tst s=4 r=0.2", "tst_s4_r0.2", "tiny_tst.py", ["tst.r=0.2"]),
    ("tst s=4 r=0.4", "tst_s4_r0.4", "tiny_tst.py", ["tst.r=0.4"]),
    ("tst s=4 r=0.3, re-init at switch", "tst_s4_r0.3_reinit", "tiny_tst.py", ["tst.reinit_embeddings_at_switch=True"]),
    ("baseline", "baseline", "tiny.py", []),
]
PAPER = """Paper (TST), final loss baseline -> TST: 270M 3.212 -> 3.142; 600M 3.019 -> 2.943; 3B 2.808 -> 2.676
(TST matches the baseline's final loss at 36k steps of its run); 3B with the embedding and LM head
re-initialised at the switch: 2.938. Superposing only the input: 3.200, only the output: 3.100,
both: 3.000, baseline 3.275 (3B ablation).

"to reach baseline": the FLOPs and training wall time (evaluation excluded, compilation included)
at which the run's validation loss first reaches the baseline's mean final loss, interpolated
between evaluations every 25 steps, as a fraction of the baseline's own totals (mean over seeds;
"-" where no seed got there)."""


def main():
  p = arguments(__doc__)
  args = p.parse_args()
  seeds = args.seeds
  runs = {}
  for label, folder, config, overrides in RUNS:
    runs[label] = run_seeds(folder, config, [*budget(args.steps), *overrides], seeds, args.root)
  runs = {"baseline": runs.pop("baseline"), **runs}
  table = summarise(runs)
  base_rows = list(runs["baseline"].values())
  target = table["baseline"][1]
  base_flops = statistics.mean(rows[-1]["flops"] for rows in base_rows)
  base_wall = statistics.mean(wall_seconds(rows)[-1] for rows in base_rows)
  flops_col, wall_col = {}, {}
  for name, by_seed in runs.items():
    reached = [cost_to_reach(rows, target) for rows in by_seed.values()]
    reached = [r for r in reached if r is not None]
    flops_col[name], wall_col[name] = "-", "-"
    if reached:
      flops_col[name] = f"{statistics.mean(f for f, _ in reached) / base_flops:.2f} ({len(reached)}/{len(by_seed)})"
      wall_col[name] = f"{statistics.mean(w for _, w in reached) / base_wall:.2f}"
  header = f"# TST vs baseline at equal FLOPs (KJV, 300 steps, configs/tiny_tst.py, seeds {','.join(map(str, seeds))})"
  write_results("tst", table, runs, header,
                x="flops", footer=PAPER,
                columns={"FLOPs to reach baseline (seeds)": flops_col, "wall to reach baseline": wall_col})
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
