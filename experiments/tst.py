"""Token-Superposition Training against the baseline at equal total FLOPs (TST paper, Fig. 1 and Table 2).

  python experiments/tst.py [--root runs/experiments] [--seeds 0,1] [--steps N]

Every run is configs/tiny.py at the comparison budget of experiments/common.py (300 steps), with
the same FLOPs per step in both phases (tst.budget="flops"), so equal steps are equal FLOPs.
Runs: the baseline; TST with s=4, r=0.3 (configs/tiny_tst.py); an s/r sweep (s in {2, 8} at
r=0.3, r in {0.2, 0.4} at s=4); and the representation-alignment ablation (s=4, r=0.3, a fresh
embedding and LM head at the switch). Reports the final validation NTP loss, the FLOPs and
training wall time each run needs to reach the baseline's final loss and the inverse (the share
of the baseline's FLOPs at which it reaches each run's final loss), beside the paper's figures,
in experiments/results/tst.* (with the hand-written experiments/results/tst_notes.md included).
Finished runs are only read (experiments/common.py).
"""
import statistics

from common import arguments, budget, cost_to_reach, run_seeds, summarise, wall_seconds, results_dir, write_results

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
# The paper's final losses: (size, baseline, TST, TST with the embedding and LM head re-initialised).
PAPER = [("270M", 3.212, 3.142, None), ("600M", 3.019, 2.943, None), ("3B", 2.808, 2.676, 2.938)]
DEFINITIONS = """"TST to reach baseline": the FLOPs and training wall time (evaluation excluded, compilation
included) at which the TST run's validation loss first reaches the baseline's mean final loss.
"baseline to reach TST": the inverse, the FLOPs and wall time at which the *baseline's* validation
loss first reaches the TST run's mean final loss (below 1: the baseline gets there sooner).
Both are interpolated between evaluations every 25 steps, as fractions of the baseline's own
totals, averaged over the seeds that get there ((k/n): how many do; "-": none). "val loss at
the switch": the mean validation NTP loss at the last step of phase 1."""


def reach(by_seed, target, base_flops, base_wall):
  """(FLOPs column, wall column): fractions of the baseline's totals at which the seeds reach `target`."""
  reached = [r for r in (cost_to_reach(rows, target) for rows in by_seed.values()) if r is not None]
  if not reached:
    return "-", "-"
  return (f"{statistics.mean(f for f, _ in reached) / base_flops:.2f} ({len(reached)}/{len(by_seed)})",
          f"{statistics.mean(w for _, w in reached) / base_wall:.2f}")


def at_switch(by_seed):
  """Mean validation loss at the last evaluated step of phase 1."""
  return statistics.mean([r for r in rows if r.get("phase") == 1 and "val_loss" in r][-1]["val_loss"]
                         for rows in by_seed.values())


def paper_table(table):
  ours = table["baseline"][1], table["tst s=4 r=0.3"][1], table["tst s=4 r=0.3, re-init at switch"][1]
  num = lambda v: "" if v is None else f"{v:.3f}"
  lines = ["| final loss | baseline | TST (s=4, r=0.3 here) | TST - baseline | TST, re-init at switch |",
           "|---|---|---|---|---|"]
  for size, base, tst, reinit in PAPER:
    lines.append(f"| paper, {size} | {base:.3f} | {tst:.3f} | {tst - base:+.3f} | {num(reinit)} |")
  lines.append(f"| here, tiny (mean of the seeds) | {ours[0]:.4f} | {ours[1]:.4f} | {ours[1] - ours[0]:+.4f} | "
               f"{ours[2]:.4f} |")
  return "\n".join(lines)


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
  switch, to_base, base_to = {}, {}, {}
  for name, by_seed in runs.items():
    if name == "baseline":  # its own row stays blank in these columns
      continue
    switch[name] = f"{at_switch(by_seed):.4f}"
    to_base[name] = reach(by_seed, target, base_flops, base_wall)
    base_to[name] = reach(runs["baseline"], table[name][1], base_flops, base_wall)
  columns = {"val loss at the switch": switch,
             "TST to reach baseline: FLOPs (seeds)": {k: v[0] for k, v in to_base.items()},
             "TST to reach baseline: wall": {k: v[1] for k, v in to_base.items()},
             "baseline to reach TST: FLOPs (seeds)": {k: v[0] for k, v in base_to.items()},
             "baseline to reach TST: wall": {k: v[1] for k, v in base_to.items()}}
  footer = [DEFINITIONS, "", "Beside the paper's figures (TST, Table 1 and Table 2):", "", paper_table(table), "",
            "Paper, 3B: TST matches the baseline's final loss at 36k steps of its run. Paper's ablation: superposing "
            "only the input 3.200, only the output 3.100, both 3.000, baseline 3.275."]
  header = f"# TST vs baseline at equal FLOPs (KJV, 300 steps, configs/tiny_tst.py, seeds {','.join(map(str, seeds))})"
  write_results("tst", table, runs, header, args.root, x="flops", footer="\n".join(footer), columns=columns,
                out=results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
