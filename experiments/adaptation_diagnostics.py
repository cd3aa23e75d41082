"""Why VQ adaptation moves so little at tiny size (issue 39.2): measurements, not guesses.

  python experiments/adaptation_diagnostics.py [--root runs/experiments] [--seeds 0,1] [--adapt_steps 120]
      [--lrs 0.003,0.01,0.03,0.1] [--size tiny|wide] [--steps N]

1. How much the token decoder uses the injected concept. Each NCP source of adaptation.py
   (ROOT/ncp/seedS, configs/tiny_ncp.py, 300 steps) is scored on its KJV validation batches as trained,
   with the injected mixture p zeroed (the decoder sees its encoder state alone, Eq. 11 with b = 0),
   with p shuffled (each row gets the next row's concepts: in-distribution vectors carrying the wrong
   content), and with the whole concept path cut (p zeroed and the concept module's states kept
   out of the decoder's CRC route, Eq. 20). The baseline source of the same seed is the yardstick.
   Beside it: the share of codewords the source's assignments use on those batches.
2. VQ adaptation with more steps and a learning-rate sweep. For each domain of adaptation.py, VQ
   (configs/tiny_ncp_adapt.py) for --adapt_steps (120; adaptation.py's table used 30) at each rate of
   --lrs, and LoRA at adaptation.py's rate for the same steps as the reference, scored as adaptation.py
   scores (target: the domain's proxy NLL change; general: the KJV validation loss change).

--size wide runs all of it on sources twice tiny's width (d 256, 8 heads, SwiGLU 768: SIZES), under
ROOT/wide, and writes adaptation_diagnostics_wide.{md,json}.

Writes experiments/results/adaptation_diagnostics.{md,json}; what the measurements support is in the
hand-written results/adaptation_notes.md. `--steps N` shortens every run (a smoke test under ROOT/smokeN).
"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import adaptation  # noqa: E402
from common import arguments, budget, results_dir, write_results  # noqa: E402

ABLATIONS = ("as trained", "p zeroed", "p shuffled", "concept path cut")
# Source sizes: overrides of configs/tiny.py and tiny_ncp.py, applied to the sources and their adaptations.
SIZES = {"tiny": [],
         "wide": ["model.d_model=256", "model.num_heads=8", "model.num_kv_heads=4", "model.mlp_dim=768"]}


def ablated(model, ablation):
  """`model` (a ConceptLM) with its forward's concept path changed as `ablation` says. ConceptLM.__call__
  takes the injected mixture p and the concept module's layer states from `predict`, so wrapping that
  one method changes what reaches the decoder and nothing else."""
  import jax.numpy as jnp
  if ablation == "as trained":
    return model
  predict = model.predict

  def changed(*args, **kwargs):
    code_logits, p, states, cache = predict(*args, **kwargs)
    if ablation == "p shuffled":
      p = jnp.roll(p, 1, axis=0)  # row b gets row b-1's concepts (the batch has 16 different rows)
    else:
      p = jnp.zeros_like(p)
    if ablation == "concept path cut":
      states = jnp.zeros_like(states)
    return code_logits, p, states, cache
  object.__setattr__(model, "predict", changed)  # an instance attribute, past nnx.Module's attribute checks
  return model


def kjv_loss(model, cfg, batches):
  """Mean next-token loss (nats) of `model` over `batches` (the objectives' own eval sums)."""
  import jax
  import numpy as np
  from latent_jax import objectives
  score = jax.jit(lambda b: objectives.eval_sums(model, b, cfg))
  nll, count = 0.0, 0
  for b in batches:
    s, labels = score(b)
    nll, count = nll + float(s), count + int(np.sum(np.asarray(labels) >= 0))
  return nll / count


def source_losses(source_dir):
  """{ablation: KJV validation loss} of a source workdir (the baseline: 'as trained' only), on its own
  validation batches, and for an NCP source the share of each segment's codewords its assignments use there."""
  import numpy as np
  from latent_jax import objectives
  from latent_jax.data import build_data, make_val_batches
  from latent_jax.infer import load_model
  model, cfg, _ = load_model(source_dir)
  batches = list(make_val_batches(build_data(cfg, source_dir), cfg.data.seq_len, cfg.data.batch_size,
                                  cfg.train.eval_batches, None))
  if cfg.model.name != "concept":
    return {"as trained": kjv_loss(model, cfg, batches)}
  codes = np.concatenate([np.asarray(model(b["inputs"], b["segment_ids"], b["positions"], logits=False,
                                           **objectives.model_kwargs(cfg)).aux["codes"]).reshape(
      -1, cfg.model.num_segments) for b in batches])
  out = {"codes used": float(np.mean([len(np.unique(codes[:, s])) for s in range(codes.shape[1])])
                             / cfg.model.codebook_size)}
  for ablation in ABLATIONS:
    out[ablation] = kjv_loss(ablated(load_model(source_dir)[0], ablation), cfg, batches)
  return out


def injection_table(args):
  """Part 1: {seed: {"baseline": loss, "ncp": source_losses}} for adaptation.py's sources of every seed."""
  rows = {}
  for seed in args.seeds:
    dirs = {s: adaptation.stage1(s, c, [*budget(args.steps), *SIZES[args.size]], seed, args.root)
            for s, c in adaptation.SOURCES}
    rows[seed] = {"baseline": source_losses(dirs["baseline"])["as trained"], "ncp": source_losses(dirs["ncp"])}
  return rows


def sweep(args, tasks, rank):
  """Part 2: {(domain, method, lr): {seed: run}} for VQ at every rate and LoRA at adaptation.py's, with
  the target and general changes against the source (adaptation.changes)."""
  out = {}
  for seed in args.seeds:
    src_dir = adaptation.stage1("ncp", "tiny_ncp.py", [*budget(args.steps), *SIZES[args.size]], seed, args.root)
    src = adaptation.score_source(src_dir, tasks, os.path.join(args.root, "adaptation", f"ncp_seed{seed}_scores.json"))
    for domain in adaptation.DOMAINS:
      for method, lr in [("lora", adaptation.LR["lora"]), *(("vq", lr) for lr in args.lrs)]:
        r = adaptation.adapt("ncp", method, domain, seed, args, src_dir, tasks, rank, lr=lr,
                             name=f"{method}_lr{lr:g}_{args.adapt_steps}steps", model=SIZES[args.size])
        r.update(adaptation.changes(r, src, domain))
        out.setdefault((domain, method, lr), {})[seed] = r
        print(f"seed {seed} {domain} {method} lr {lr:g}: target {r['target']:+.4f} general {r['general']:+.4f}",
              flush=True)
  return out


def mean_sd(values):
  return f"{statistics.mean(values):+.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def main():
  p = arguments(__doc__)
  p.add_argument("--adapt_steps", type=int, default=120, help="steps of every adaptation run (16 x 128 tokens each)")
  p.add_argument("--lrs", default="0.003,0.01,0.03,0.1", type=lambda t: [float(x) for x in t.split(",")],
                 help="VQ adaptation's learning rates")
  p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="the sources' size (SIZES)")
  args = p.parse_args()
  name = "adaptation_diagnostics" + ("" if args.size == "tiny" else "_" + args.size)
  if args.size != "tiny":
    args.root = os.path.join(args.root, args.size)
  if args.steps:
    args.adapt_steps = args.steps
  tasks = adaptation.task_files(args.root)
  injection = injection_table(args)
  lines = ["| seed | baseline | NCP as trained | p zeroed | p shuffled | concept path cut | codewords used |",
           "|---|---|---|---|---|---|---|"]
  for seed, r in injection.items():
    n = r["ncp"]
    lines.append(f"| {seed} | {r['baseline']:.4f} | {n['as trained']:.4f} | " + " | ".join(
        f"{n[a]:.4f} ({n[a] - n['as trained']:+.4f})" for a in ABLATIONS[1:]) + f" | {n['codes used']:.2f} |")

  rank, _ = adaptation.trainable_counts()
  runs = sweep(args, tasks, rank)
  names = {key: f"{key[0]}/{key[1]} lr {key[2]:g}" for key in runs}
  table = {names[k]: ([r["target"] for r in by.values()], statistics.mean(r["target"] for r in by.values()),
                      statistics.stdev(r["target"] for r in by.values()) if len(by) > 1 else 0.0)
           for k, by in runs.items()}
  sweep_lines = ["| domain | method | lr | target Δ (mean ± sd) | general Δ KJV val | target / general | domain val_loss, last |",
                 "|---|---|---|---|---|---|---|"]
  for (d, m, lr), by in runs.items():
    target, general = [r["target"] for r in by.values()], [r["general"] for r in by.values()]
    ratio = statistics.mean(target) / statistics.mean(general) if statistics.mean(general) > 0 else float("nan")
    sweep_lines.append(f"| {d} | {m} | {lr:g} | {mean_sd(target)} | {mean_sd(general)} | {-ratio:.1f} | "
                       f"{statistics.mean(r['last']['val_loss'] for r in by.values()):.3f} |")
  header = ("# Why VQ adaptation moves little at tiny size: diagnostics (issue 39.2)\n\n"
            f"Sources: adaptation.py's (configs/tiny.py, configs/tiny_ncp.py, {[*budget(args.steps), *SIZES[args.size]]}), "
            f"seeds {args.seeds}.")
  footer = "\n".join([
      "## 1. How much the decoder uses the injected concept", "",
      "KJV validation loss (nats/token) of each source on its own validation batches; the NCP with its injected "
      "mixture p zeroed, shuffled across the batch's rows (row b gets row b-1's), and with the concept path cut "
      "(p zeroed and the concept module's states kept out of the decoder's CRC route); in brackets the change "
      "from the NCP as trained. Codewords used: the share of each segment's codewords its assignments take on "
      "these batches.", "", *lines, "",
      f"## 2. VQ adaptation: {args.adapt_steps} steps, a learning-rate sweep, LoRA at its rate for reference", "",
      "target: the domain's proxy NLL change (negative = gained); general: the KJV validation loss change "
      "(positive = lost); target / general: nats gained per nat of general loss (mean over seeds). Constant "
      "rate after 5 warm-up steps, no weight decay, as adaptation.py.", "", *sweep_lines])
  write_results(name, table, {names[k]: {s: r["rows"] for s, r in by.items()}
                                                  for k, by in runs.items()}, header, args.root, key="Δ target proxy nll", footer=footer,
                plot_key="val_loss", out=results_dir(args))
  with open(os.path.join(results_dir(args), name + ".json"), "w") as f:
    json.dump({"injection": {str(s): r for s, r in injection.items()},
               "sweep": {names[key]: {str(s): {k: v for k, v in r.items() if k not in ("rows", "source_scores")}
                                     for s, r in by.items()} for key, by in runs.items()}}, f)


if __name__ == "__main__":
  main()
