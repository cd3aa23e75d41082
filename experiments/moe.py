"""A first look at mixture of experts at tiny size: the MoE against the dense model of equal active
FLOPs, and NITP and TST on the MoE against the MoE baseline (issue 37.8, docs/moe.md).

  python experiments/moe.py [--root runs/experiments] [--seeds 0,1] [--steps N]

Every run reads the same batches for the comparison budget of experiments/common.py (300 steps;
the data order depends on the documents only, never on the seed, so a seed's runs are paired).
The MoE is configs/tiny_moe.py: every MLP top-2 of 8 SwiGLU experts of half tiny's width, so a
token's active MLP equals the dense one and the FLOPs per token match but for the router. NITP and
TST on it are configs/tiny_nitp.py and configs/tiny_tst.py with the same MoE; the dense NITP and
TST runs (shared with aux.py and tst.py) show whether the MoE changes a method's effect. TST at the
paper's headline setting (s=16, r=0.25, its 10B-A1B MoE) runs beside the tiny recipe's s=4, r=0.3.
Writes experiments/results/moe.{md,json,png} and moe_load.png (the busiest expert's share per
sparse layer over training), with the hand-written results/moe_notes.md.
"""
import math
import os
import statistics

from common import (CONFIGS, arguments, budget, cost_to_reach, final, run_seeds, summarise,
                    results_dir, wall_seconds, write_results)
from latent_jax import load_config

# The MoE of configs/tiny_moe.py, as overrides for the method configs built on configs/tiny.py.
MOE = ["model.moe.enabled=True", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_dim=192"]
# (label, run folder, config, overrides, the run it is compared with); the dense folders are shared
# with aux.py ("baseline", "nitp") and tst.py ("tst_s4_r0.3").
RUNS = [
    ("dense", "baseline", "tiny.py", [], None),
    ("moe", "moe", "tiny_moe.py", [], "dense"),
    ("dense nitp", "nitp", "tiny_nitp.py", [], "dense"),
    ("moe nitp", "moe_nitp", "tiny_nitp.py", MOE, "moe"),
    ("dense tst s=4 r=0.3", "tst_s4_r0.3", "tiny_tst.py", [], "dense"),
    ("moe tst s=4 r=0.3", "moe_tst_s4_r0.3", "tiny_tst.py", MOE, "moe"),
    ("moe tst s=16 r=0.25", "moe_tst_s16_r0.25", "tiny_tst.py", [*MOE, "tst.s=16", "tst.r=0.25"], "moe"),
]


def paired(a, b):
  """Mean and standard error of the per-seed differences of final val_loss (a - b)."""
  d = [final(a[s]) - final(b[s]) for s in a if s in b]
  se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
  return statistics.mean(d), se


def layer_loads(rows, key="moe_load_max"):
  """{step: [key/i for each sparse layer]} from the logged rows."""
  out = {}
  for r in rows:
    layers = sorted((int(k.split("/")[1]), v) for k, v in r.items() if k.startswith(key + "/"))
    if layers:
      out[r["step"]] = [v for _, v in layers]
  return out


def load_summary(by_seed):
  """'first -> last' of the busiest expert's load (max over the layers, mean over the seeds), and the
  last router entropy (mean over layers and seeds, in nats; ln 8 = 2.08 is uniform)."""
  loads = [layer_loads(rows) for rows in by_seed.values()]
  if not all(loads):
    return "", ""
  first = statistics.mean(max(l[min(l)]) for l in loads)
  last = statistics.mean(max(l[max(l)]) for l in loads)
  entropy = statistics.mean(statistics.mean(layer_loads(rows, "router_entropy")[max(l)])
                            for rows, l in zip(by_seed.values(), loads))
  return f"{first:.2f} -> {last:.2f}", f"{entropy:.3f}"


def plot_loads(runs, out):
  """moe_load.png: each MoE run's busiest-expert load per sparse layer over training (seed-mean)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  sparse = {name: by_seed for name, by_seed in runs.items() if name.startswith("moe")}
  fig, axes = plt.subplots(1, len(sparse), figsize=(3.2 * len(sparse), 3), sharey=True, squeeze=False)
  for ax, (name, by_seed) in zip(axes[0], sparse.items()):
    loads = [layer_loads(rows) for rows in by_seed.values()]
    steps = sorted(set.intersection(*(set(l) for l in loads)))
    for i in range(len(loads[0][steps[0]])):
      ax.plot(steps, [statistics.mean(l[s][i] for l in loads) for s in steps], label=f"layer {i}")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("step")
  axes[0][0].set_ylabel("busiest expert / mean (moe_load_max)")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "moe_load.png"), dpi=120)


def main():
  args = arguments(__doc__).parse_args()
  moe, dense_plus_moe = (load_config(os.path.join(CONFIGS, c), o).model for c, o in (("tiny_moe.py", []), ("tiny.py", MOE)))
  assert moe == dense_plus_moe, "MOE must be configs/tiny_moe.py's MoE"
  runs = {label: run_seeds(folder, config, [*budget(args.steps), *overrides], args.seeds, args.root)
          for label, folder, config, overrides, _ in RUNS}
  table = summarise(runs)
  flops = {name: statistics.mean(rows[-1]["flops"] for rows in by_seed.values()) for name, by_seed in runs.items()}
  wall = {name: statistics.mean(wall_seconds(rows)[-1] for rows in by_seed.values()) for name, by_seed in runs.items()}
  delta, reach, ratio, load, entropy = {}, {}, {}, {}, {}
  for name, _, _, _, base in RUNS:
    ratio[name] = f"{flops[name] / flops['dense']:.3f} / {wall[name] / wall['dense']:.2f}"
    load[name], entropy[name] = load_summary(runs[name])
    if base:
      mean, se = paired(runs[name], runs[base])
      delta[name] = f"{mean:+.4f} ± {se:.4f} vs {base}"
      got = [c for c in (cost_to_reach(rows, table[base][1]) for rows in runs[name].values()) if c]
      reach[name] = (f"{statistics.mean(f for f, _ in got) / flops[base]:.2f} ({len(got)}/{len(runs[name])})"
                     if got else f"- (0/{len(runs[name])})")
  columns = {"paired difference (mean ± SE over seeds)": delta,
             "FLOPs to reach its base's final loss, share of the base's (seeds)": reach,
             "FLOPs / wall vs dense": ratio, "busiest expert: first -> last log": load,
             "router entropy, last (nats)": entropy}
  footer = ("Paired difference: the run's final validation loss minus its base's, seed by seed (the same "
            "batches), mean ± standard error. FLOPs to reach: where the run's validation loss first reaches "
            "its base's mean final loss, interpolated between evaluations every 25 steps, as a share of the "
            "base's total FLOPs. FLOPs / wall vs dense: the run's total training FLOPs (active, router "
            "included) and training wall time over the dense baseline's. Busiest expert: moe_load_max, the "
            "most-loaded expert's tokens over the mean per expert (1 is balanced, 4 = E / top_k is one pair "
            "taking every token), max over the sparse layers, at the first and last logged step; moe_load.png "
            "has every layer over training.")
  header = (f"# MoE at tiny size: top-2 of 8 against dense at equal active FLOPs, NITP and TST on it "
            f"(KJV, 300 steps, seeds {','.join(map(str, args.seeds))})")
  write_results("moe", table, runs, header, args.root, x="flops", columns=columns, footer=footer,
                out=results_dir(args))
  plot_loads(runs, results_dir(args))
  for name, (values, mean, spread) in table.items():
    print(f"{name}: {values} mean {mean:.4f} std {spread:.4f} {delta.get(name, '')}")


if __name__ == "__main__":
  main()
