"""Does the concept signal help a block drafter? NCP Sec. 5.3 (Table 9) on the tiny NCP model.

  python experiments/drafting.py [--root runs/experiments] [--seeds 0,1] [--steps N] [--labels data|target]

For each seed, the tiny NCP target of the comparison budget (shared with ncp_ablation.py and
aux.py: ROOT/ncp/seedS) stays frozen, and three drafters of configs/tiny_drafter.py train on it
with the same init, data and anchors, differing only in Eq. 26's signal: none (the baseline
drafter), predicted (the concept mixture the target injects, the default) and pooled (the
pooled concept of the same chunk). Each is measured by the mean accepted length (MAL, Eq. 27)
of greedy speculative decoding from validation prompts. The drafters learn the data's next tokens;
`--labels target` trains them on the target's greedy tokens instead (drafter.labels=target).
Writes experiments/results/drafting.* (drafting_target_labels.*); `--steps N` shortens every
run to prove the script works (written under ROOT/smokeN, never to results/).
"""
import json
import os

from common import CONFIGS, arguments, budget, run_seeds, summarise, results_dir, write_results

from latent_jax import load_config
from latent_jax.draft import run

ARMS = ["none", "predicted", "pooled"]
PAPER = {"none": "5.933 (Table 9, macro average)", "predicted": "6.180 (+4.17%)", "pooled": "not run"}


def drafter_rows(workdir, cfg):
  """The drafter's training curve and its measurements as metrics rows (`tokens` for the plot)."""
  with open(os.path.join(workdir, "drafter.json")) as f:
    result = json.load(f)
  per_step = cfg.data.batch_size * cfg.drafter.anchors * cfg.drafter.block_size  # block positions drafted
  rows = [{"step": r["step"], "tokens": r["step"] * per_step, "loss": r["loss"]} for r in result["history"]]
  rows[-1].update({k: result[k] for k in ("mal", "val_loss", "slot_accuracy", "rounds", "committed")})
  return rows


def main():
  p = arguments(__doc__)
  p.add_argument("--labels", default="data", choices=["data", "target"])
  args = p.parse_args()
  name = "drafting" if args.labels == "data" else "drafting_target_labels"
  targets = run_seeds("ncp", "tiny_ncp.py", budget(args.steps), args.seeds, args.root)
  smoke = [f"train.steps={args.steps}", "optim.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
           "eval.prompts=4", "eval.max_new_tokens=8", "train.eval_batches=1"] if args.steps else []
  runs = {arm: {} for arm in ARMS}
  for seed in targets:
    for arm in ARMS:
      workdir = os.path.join(args.root, name, arm, f"seed{seed}")
      cfg = load_config(os.path.join(CONFIGS, "tiny_drafter.py"),
                        [f"target={os.path.join(args.root, 'ncp', f'seed{seed}')}", f"drafter.concept={arm}",
                         f"drafter.labels={args.labels}", f"train.seed={seed}", *smoke])
      if not os.path.exists(os.path.join(workdir, "drafter.json")):  # finished drafters are only read
        run(cfg, workdir)
      runs[arm][seed] = drafter_rows(workdir, cfg)
  table = summarise(runs, "mal")
  base = table["none"][1]
  lines = ["| drafter | change in mean MAL vs none | val accuracy per block slot (mean over seeds) | paper MAL |",
           "|---|---|---|---|"]
  for arm in ARMS:
    acc = [sum(rows[-1]["slot_accuracy"][j] for rows in runs[arm].values()) / len(runs[arm])
           for j in range(cfg.drafter.block_size)]
    lines.append(f"| {arm} | {table[arm][1] / base - 1:+.2%} | {' '.join(f'{a:.3f}' for a in acc)} | {PAPER[arm]} |")
  write_results(name, table, runs, "# Concept-injected block drafting on the tiny NCP model (KJV)\n\n"
                f"Targets: configs/tiny_ncp.py {' '.join(budget(args.steps))}, seeds {args.seeds}; drafters: "
                f"configs/tiny_drafter.py drafter.labels={args.labels} {' '.join(smoke)} with train.seed = the "
                "target's seed. "
                "MAL: mean tokens committed per verification round (Eq. 27), greedy.", args.root, key="mal",
                footer="\n".join(lines), plot_key="loss", out=results_dir(args))
  for arm, (values, mean, spread) in table.items():
    print(f"{arm}: MAL {values} mean {mean:.4f} std {spread:.4f}")


if __name__ == "__main__":
  main()
