"""Domain adaptation at tiny size: VQ adaptation vs full fine-tuning vs LoRA (NCP paper Sec. 5.1, Tables 5-7, Fig. 7).

  python experiments/adaptation.py [--root runs/experiments] [--seeds 0,1] [--adapt_steps 30] [--jobs 2] [--steps N]

Stage 1, the sources: the tiny baseline (configs/tiny.py) and the tiny NCP (configs/tiny_ncp.py) on the
KJV at the comparison budget of experiments/common.py (300 steps), the workdirs ROOT/baseline/seedS and
ROOT/ncp/seedS that aux.py, ncp_ablation.py and tst.py share.

Stage 2: each domain (python_stdlib: code, arithmetic: math, kjv_facts: knowledge) adapted from each
source of seed S with seed S, every method reading the same batches (--adapt_steps x 16 x 128 tokens, 30
by default; a constant rate after 5 warm-up steps, no weight decay):
  full  train.init_from=SRC, every parameter trains                    lr 1e-3
  lora  lora.enabled=True: rank auto (NCP: 5, VQ's count), and for
        the baseline the integer rank whose count is nearest the
        NCP's VQ count (trainable_counts(): 8)                         lr 3e-3
  vq    configs/tiny_ncp_adapt.py (optim.trainable=vq), NCP only       lr 3e-3
Each adaptation runs as a child process (ROOT/adaptation/SRC/DOMAIN/METHOD/seedS), which trains, reads
its own peak RSS (host memory: ru_maxrss of that process, there being no accelerator on CPU), then
scores the adapted model on the source's KJV validation batches (the general figure: its own val_loss
is on the domain's validation split). Its last step scores `train.eval_tasks` = the domain's proxy set
and the KJV's (python -m latent_jax.tasks, written to ROOT/adaptation/tasks); the sources are scored on
the same files by the function `python -m latent_jax.eval --tasks` calls (eval.evaluate_dir). The children
share a persistent XLA compilation cache (ROOT/adaptation/jax_cache): a method's first run compiles.

Writes experiments/results/adaptation.{md,json,png}: per source x domain x method, the trainable
parameters, the change of the target proxy proxy/<capability>/nll (adapted minus source), the change of
KJV validation loss and of proxy/general/nll, tokens/s and peak RSS, mean and per seed. `--jobs 2`
runs the seeds' pipelines side by side (each its own processes). `--steps N` shortens every run (stage 1
and adaptation) to prove the script works (a smoke test, written under ROOT/smokeN, never to results/).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import CONFIGS, arguments, budget, finished, results_dir, write_results  # noqa: E402

SOURCES = [("baseline", "tiny.py"), ("ncp", "tiny_ncp.py")]  # shared with aux.py, ncp_ablation.py, tst.py
DOMAINS = {"python_stdlib": "code", "arithmetic": "math", "kjv_facts": "knowledge"}
LR = {"full": 1e-3, "lora": 3e-3, "vq": 3e-3}
METHODS = {"baseline": ["full", "lora"], "ncp": ["full", "lora", "vq"]}
# The paper's NCP 8.94B (Tables 5-7, Fig. 7): target score change and General AVG change, in accuracy points
# (higher = better: the opposite sign of the NLL changes here), and Fig. 7's 8-GPU throughput and memory share.
PAPER = {"python_stdlib": ("code, 4-task mean", {"full": (-1.61, -0.48), "lora": (1.34, -0.11), "vq": (2.65, -0.42)}),
         "arithmetic": ("math, 2-task mean", {"full": (6.16, -0.97), "lora": (3.15, -0.42), "vq": (4.27, 0.39)}),
         "kjv_facts": ("knowledge, TriviaQA EM", {"full": (18.00, -0.29), "lora": (17.48, -0.14), "vq": (9.19, 0.03)})}
PAPER_EFFICIENCY = {"full": (7739, 90.3), "lora": (10400, 49.0), "vq": (15632, 32.4)}


def trainable_counts():
  """(rank, {(source, method): trainable parameters}): rank is the integer LoRA rank of configs/tiny.py whose
  trainable count is nearest the VQ count of configs/tiny_ncp.py (lora.rank=auto is refused for a baseline: it
  has no codebook); the counts are what each adaptation trains (the train loop prints them rounded)."""
  from flax import nnx
  from latent_jax import load_config
  from latent_jax.nn import build_model, lora
  import numpy as np
  counts, per_rank = {}, {}
  for source, config in SOURCES:
    cfg = load_config(os.path.join(CONFIGS, config))
    model = build_model(cfg.model, nnx.Rngs(0))
    params = [("/".join(map(str, p)), int(np.prod(n[...].shape))) for p, n in nnx.iter_graph(model)
              if isinstance(n, nnx.Param)]
    counts[source, "full"] = sum(n for _, n in params)
    per_rank[source] = lora.rank_count([n[...].shape for _, _, n in lora.lora_targets(model, cfg.lora.targets).values()])
    if source == "ncp":
      counts[source, "vq"] = sum(n for name, n in params if re.fullmatch(lora.VQ_PARAMS, name))
  vq = counts["ncp", "vq"]
  rank = max(1, round(vq / per_rank["baseline"]))
  counts["baseline", "lora"] = rank * per_rank["baseline"]
  counts["ncp", "lora"] = max(1, round(vq / per_rank["ncp"])) * per_rank["ncp"]  # lora.rank=auto
  return rank, counts


def adapt_overrides(source, method, domain, steps, seed, src_dir, tasks, rank, lr):
  config = "tiny_ncp_adapt.py" if method == "vq" else dict(SOURCES)[source]
  over = [f"train.init_from={src_dir}", f"data.source={domain}", f"train.seed={seed}", f"train.steps={steps}",
          f"optim.lr={lr}", "optim.schedule=constant", f"optim.warmup_steps={min(5, steps - 1)}",
          "optim.weight_decay=0.0", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
          f"train.log_every={min(10, steps)}", "train.keep_checkpoints=1",
          f"train.eval_tasks={os.path.join(tasks, domain + '.jsonl')}", f"train.eval_tasks={os.path.join(tasks, 'kjv.jsonl')}"]
  if method == "lora":
    over += ["lora.enabled=True", f"lora.rank={'auto' if source == 'ncp' else rank}"]
  return config, over


# ----------------------------------------------------------------------------- the child process


def kjv_val(adapted, source):
  """The adapted model's loss on the source's KJV validation batches (its train.eval_batches, as the source's
  own val_loss), built from the source's config and tokenizer: eval.evaluate_dir with another run's data."""
  from flax import nnx
  from latent_jax import checkpoint, sharding
  from latent_jax.data import build_data, make_val_batches
  from latent_jax.infer import load
  from latent_jax.nn import abstract_model
  from latent_jax.train import step as steps
  saved, step = checkpoint.load_config(adapted)
  cfg = load.inference_config(saved)
  mesh = sharding.inference_mesh(cfg.mesh)
  _, abstract = abstract_model(cfg.model)
  shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
  graphdef, params = load.load_params(adapted, saved, step, checkpoint.by_path(shardings))
  src_cfg = load.inference_config(checkpoint.load_config(source)[0])
  data = build_data(src_cfg, source)
  batches = make_val_batches(data, src_cfg.data.seq_len, src_cfg.data.batch_size, src_cfg.train.eval_batches,
                             sharding.process_rows(src_cfg.data.batch_size, mesh))
  eval_step = steps.make_eval_step(graphdef, cfg, shardings, mesh, data.tokenizer.token_bytes)
  result = steps.evaluate(eval_step, params, batches, mesh, src_cfg.data.batch_size)
  return {"kjv_val_loss": float(result["val_loss"]), "kjv_val_bpb": float(result.get("val_bpb", float("nan")))}


def child(spec):
  """Train one adaptation run, then write WORKDIR/adaptation.json: peak RSS of this process after training
  (ru_maxrss, KiB on Linux), and the adapted model's KJV validation loss."""
  import resource
  from latent_jax import distributed, load_config
  from latent_jax.train.loop import train
  import jax
  distributed.quiet_absent_tpu()
  # One compilation cache for all adaptation runs: a method's runs share their shapes (domains, seeds), so
  # only the first of them compiles; the first logged row (compilation included) is left out of tokens/s.
  jax.config.update("jax_compilation_cache_dir", spec["cache"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  cfg = load_config(os.path.join(CONFIGS, spec["config"]), spec["overrides"])
  train(cfg, spec["workdir"])
  out = {"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  out.update(kjv_val(spec["workdir"], spec["source_dir"]))
  with open(os.path.join(spec["workdir"], "adaptation.json"), "w") as f:
    json.dump(out, f)


# ----------------------------------------------------------------------------- the parent


def sh(cmd, log):
  with open(log, "a") as f:
    r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.path.dirname(HERE))
  if r.returncode:
    raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); see {log}")


def stage1(name, config, overrides, seed, root):
  """run_seeds for one source and seed, in its own process (so that two seeds' pipelines run side by side)."""
  code = ("import sys; sys.path.insert(0, %r); from common import run_seeds; run_seeds(%r, %r, %r, [%d], %r)"
          % (HERE, name, config, overrides, seed, root))
  workdir = os.path.join(root, name, f"seed{seed}")
  os.makedirs(workdir, exist_ok=True)
  sh([sys.executable, "-c", code], os.path.join(root, "adaptation", f"{name}_seed{seed}.log"))
  return workdir


def score_source(src_dir, tasks, cache):
  """The source's proxies on the four task files and its KJV val_loss (eval.evaluate_dir), cached in `cache`."""
  if not os.path.exists(cache):
    code = ("import json, sys; from latent_jax.eval import evaluate_dir; "
            "r = evaluate_dir(%r, tasks=%r); json.dump(r, open(%r, 'w'))"
            % (src_dir, [os.path.join(tasks, f"{d}.jsonl") for d in [*DOMAINS, "kjv"]], cache))
    sh([sys.executable, "-c", code], cache + ".log")
  with open(cache) as f:
    return json.load(f)


def adapt(source, method, domain, seed, args, src_dir, tasks, rank, lr=None, name=None, model=()):
  """One adaptation run (a child process) and what it measured; `lr` (default LR[method]), the run
  folder's `name` (default the method) and the source's `model` overrides let adaptation_diagnostics.py
  sweep beside this table's runs."""
  workdir = os.path.join(args.root, "adaptation", source, domain, name or method, f"seed{seed}")
  config, over = adapt_overrides(source, method, domain, args.adapt_steps, seed, src_dir, tasks, rank, lr or LR[method])
  over = [*model, *over]
  result = os.path.join(workdir, "adaptation.json")
  if not (finished(workdir, args.adapt_steps) and os.path.exists(result)):
    os.makedirs(workdir, exist_ok=True)
    spec = json.dumps({"config": config, "overrides": over, "workdir": workdir, "source_dir": src_dir,
                       "cache": os.path.abspath(os.path.join(args.root, "adaptation", "jax_cache"))})
    sh([sys.executable, os.path.abspath(__file__), "--child", spec], os.path.join(workdir, "log.txt"))
  from latent_jax.train.metrics import read_metrics
  rows = read_metrics(workdir)
  with open(result) as f:
    extra = json.load(f)
  with open(os.path.join(workdir, "log.txt")) as f:
    log = f.read()
  total = float(re.search(r"([\d.]+)M params", log).group(1)) * 1e6
  m = re.search(r"\(([\d.]+)M trainable\)", log)
  speeds = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
  compile_s = float(re.search(r"compiled the train step(?: and its monitored twin)? in ([\d.]+) s", log).group(1))
  return {"rows": rows, "compile_s": compile_s, "trainable": float(m.group(1)) * 1e6 if m else total, "tokens_per_s": statistics.mean(speeds),
          **{k: v for k, v in extra.items() if k != "compiled"}, "last": [r for r in rows if "val_loss" in r][-1]}


def task_files(root):
  """ROOT/adaptation/tasks: the domains' and the KJV's proxy task sets (python -m latent_jax.tasks), made once."""
  tasks = os.path.join(root, "adaptation", "tasks")
  os.makedirs(os.path.join(root, "adaptation"), exist_ok=True)
  if not all(os.path.exists(os.path.join(tasks, f"{d}.jsonl")) for d in [*DOMAINS, "kjv"]):
    sh([sys.executable, "-m", "latent_jax.tasks", "--out", tasks], os.path.join(root, "adaptation", "tasks.log"))
  return tasks


def pipeline(seed, args, tasks, rank, out, log):
  """Seed `seed`: both sources, then every adaptation of them, a domain at a time (so that a domain's methods
  finish together); results into out[(source, domain, method)][seed]."""
  src_dirs, scores = {}, {}
  for source, config in SOURCES:
    src_dirs[source] = stage1(source, config, budget(args.steps), seed, args.root)
    scores[source] = score_source(src_dirs[source], tasks,
                                  os.path.join(args.root, "adaptation", f"{source}_seed{seed}_scores.json"))
  for domain in DOMAINS:
    for source, _ in SOURCES:
      src_dir, src = src_dirs[source], scores[source]
      for method in METHODS[source]:
        try:
          r = adapt(source, method, domain, seed, args, src_dir, tasks, rank)
        except Exception as e:  # pylint: disable=broad-except
          log.append(f"{source}/{domain}/{method} seed {seed}: {e}")
          print(log[-1], flush=True)
          continue
        r.update(source_scores=src, **changes(r, src, domain))
        out.setdefault((source, domain, method), {})[seed] = r
        print(f"seed {seed} {source}/{domain}/{method}: target {r['target']:+.4f} general {r['general']:+.4f} "
              f"{r['tokens_per_s']:.0f} tok/s {r['maxrss_mib']:.0f} MiB", flush=True)


def changes(r, src, domain):
  """An adapted run's target change (the domain's proxy NLL), general change (KJV validation loss) and
  KJV proxy change, against its source's scores `src` (score_source)."""
  cap = DOMAINS[domain]
  return {"target": r["last"][f"proxy/{cap}/nll"] - src[f"proxy/{cap}/nll"],
          "general": r["kjv_val_loss"] - src["val_loss"],
          "general_proxy": r["last"]["proxy/general/nll"] - src["proxy/general/nll"]}


def acc(key, by):
  """The domain's multiple-choice accuracy, the source's and the adapted model's, mean over seeds ('' if none)."""
  name = f"proxy/{DOMAINS[key[1]]}/acc"
  if not all(name in r["last"] for r in by):
    return ""
  return (f"{statistics.mean(r['source_scores'][name] for r in by):.3f} → "
          f"{statistics.mean(r['last'][name] for r in by):.3f}")


def fmt(values, spec):
  return ", ".join(format(v, spec) for v in values)


def main():
  if len(sys.argv) > 2 and sys.argv[1] == "--child":
    child(json.loads(sys.argv[2]))
    return
  p = arguments(__doc__)
  p.add_argument("--adapt_steps", type=int, default=30, help="steps of every adaptation run (16 x 128 tokens each)")
  p.add_argument("--jobs", type=int, default=2, help="seeds whose pipelines run side by side")
  args = p.parse_args()
  if args.steps:
    args.adapt_steps = args.steps
  seeds = args.seeds
  tasks = task_files(args.root)
  rank, counts = trainable_counts()
  lora_count, vq_count = counts["baseline", "lora"], counts["ncp", "vq"]
  print(f"baseline LoRA rank {rank}: {lora_count:,} trainable against the NCP's VQ {vq_count:,}", flush=True)
  out, log = {}, []
  groups = [seeds[i::args.jobs] for i in range(min(args.jobs, len(seeds)))]
  threads = [threading.Thread(target=lambda g=g: [pipeline(s, args, tasks, rank, out, log) for s in g]) for g in groups]
  for t in threads:
    t.start()
  for t in threads:
    t.join()

  for (source, _, method), by in out.items():
    for r in by.values():
      r["trainable"] = counts[source, method]  # exact; the log's figure is rounded to 1,000
  order = [(s, d, m) for s, _ in SOURCES for d in DOMAINS for m in METHODS[s] if (s, d, m) in out]
  name = lambda key: "/".join(key)  # noqa: E731
  runs = {name(k): {seed: out[k][seed]["rows"] for seed in sorted(out[k])} for k in order}
  table = {}
  lines = ["| source | domain | method | lr | trainable | Adam moments MiB | target Δ proxy nll per seed | mean "
           "| general Δ KJV val per seed | mean | Δ proxy/general/nll (mean) | tokens/s mean (per seed) "
           "| peak RSS MiB mean (per seed) | train-step compile s (per seed) | target MC acc, source → adapted (mean) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for k in order:
    by = [out[k][s] for s in sorted(out[k])]
    get = lambda key: [r[key] for r in by]  # noqa: E731
    table[name(k)] = (get("target"), statistics.mean(get("target")),
                      statistics.stdev(get("target")) if len(by) > 1 else 0.0)
    lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {LR[k[2]]:g} | {statistics.mean(get('trainable')):,.0f} | "
                 f"{8 * statistics.mean(get('trainable')) / 2**20:.2f} | "
                 f"{fmt(get('target'), '+.4f')} | {statistics.mean(get('target')):+.4f} | {fmt(get('general'), '+.4f')} | "
                 f"{statistics.mean(get('general')):+.4f} | {statistics.mean(get('general_proxy')):+.4f} | "
                 f"{statistics.mean(get('tokens_per_s')):,.0f} ({fmt(get('tokens_per_s'), '.0f')}) | "
                 f"{statistics.mean(get('maxrss_mib')):,.0f} ({fmt(get('maxrss_mib'), '.0f')}) | {fmt(get('compile_s'), '.0f')} | {acc(k, by)} |")
  sources = {}
  for (s, _, _), by in out.items():
    for seed, r in by.items():
      sources.setdefault(s, {})[seed] = r["source_scores"]
  src_lines = ["| source | seed | KJV val_loss | proxy/code/nll | proxy/math/nll | proxy/knowledge/nll | proxy/general/nll |",
               "|---|---|---|---|---|---|---|"]
  for s in sorted(sources):
    for seed in sorted(sources[s]):
      v = sources[s][seed]
      src_lines.append(f"| {s} | {seed} | {v['val_loss']:.4f} | " + " | ".join(
          f"{v[f'proxy/{c}/nll']:.4f}" for c in ["code", "math", "knowledge", "general"]) + " |")
  header = ("# Domain adaptation at tiny size: full fine-tuning vs LoRA vs VQ adaptation (NCP Tables 5-7)\n\n"
            f"Sources: configs/tiny.py and configs/tiny_ncp.py on the KJV, {budget(args.steps)}, seeds {seeds}. "
            f"Adaptation: {args.adapt_steps} steps of 16 x 128 tokens of each domain, constant lr after "
            f"{min(5, args.adapt_steps - 1)} warm-up steps, no weight decay; lr {LR}; LoRA rank auto for the NCP, "
            f"{rank} for the baseline ({lora_count:,} trainable, nearest the NCP's VQ count {vq_count:,}). The table "
            "below `summarise`s the target change (adapted minus source proxy/<capability>/nll of the domain's "
            "task set; negative = gained).")
  footer = "\n".join([
      "## Per source x domain x method", "",
      "target: the domain's proxy/<capability>/nll (nats/token of the gold continuations) after adaptation minus "
      "the source's, same file. general: the adapted model's loss on the source's KJV validation batches minus "
      "the source's (positive = general ability lost); Δ proxy/general/nll the same on the KJV task set. "
      "Adam moments: 2 x 4 bytes per trainable parameter (what the optimiser keeps; LoRA here also "
      "materialises the adapted weights and their full gradient, docs/lora.md). tokens/s: mean of metrics.jsonl's "
      "logged rows after the first (which holds the compilation). Peak RSS: ru_maxrss of the training process after "
      "training (host memory; these are CPU runs, no accelerator memory), which at this size is the JAX runtime, "
      "the data and XLA's compilation rather than the model (1.3-1.8M parameters): runs share a persistent "
      "compilation cache, so a method's first run compiles (the compile column: tens of seconds) and its later "
      "runs load (a few seconds). Throughput and RSS were measured with 2-3 of these processes and other "
      "users' jobs sharing 2 cores.", "", *lines, "",
      "## The paper (NCP 8.94B, Tables 5-7 and Fig. 7)", "",
      "Accuracy points, higher = better (the opposite sign of the NLL changes above); the paper's domains are "
      "Magicoder, Orca-Math and TriviaQA-RC, its LoRA and VQ train ~17M parameters, and Fig. 7 is 8 GPUs at "
      "micro-batch 1 (tokens/s/GPU, share of GPU memory).", "",
      "| domain | method | target change | General AVG change | tokens/s/GPU | memory |", "|---|---|---|---|---|---|",
      *[f"| {d} ({PAPER[d][0]}) | {m} | {PAPER[d][1][m][0]:+.2f} | {PAPER[d][1][m][1]:+.2f} | "
        f"{PAPER_EFFICIENCY[m][0]:,} | {PAPER_EFFICIENCY[m][1]}% |" for d in DOMAINS for m in ("full", "lora", "vq")], "",
      "## Sources (stage 1, scored by eval.evaluate_dir)", "", *src_lines,
      *(["", "Failed or unfinished: " + "; ".join(log)] if log else [])])
  write_results("adaptation", table, runs, header, args.root, key="Δ target proxy nll", footer=footer,
                plot_key="val_loss", out=results_dir(args))
  with open(os.path.join(results_dir(args), "adaptation.json"), "w") as f:
    json.dump({"lr": LR, "adapt_steps": args.adapt_steps, "baseline_lora_rank": rank, "baseline_lora_count": lora_count,
               "ncp_vq_count": vq_count, "sources": {s: {str(k): v for k, v in d.items()} for s, d in sources.items()},
               "runs": {name(k): {str(seed): {kk: vv for kk, vv in r.items() if kk != "source_scores"}
                                  for seed, r in out[k].items()} for k in order}}, f)
  plot(out, order, results_dir(args))
  for line in lines[2:]:
    print(line)


def plot(out, order, folder):
  """Fig. 7 at tiny size: target gain (source minus adapted proxy NLL) against general loss (KJV val increase)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, axes = plt.subplots(1, len(DOMAINS), figsize=(4 * len(DOMAINS), 3.6))
  marks = {"full": "o", "lora": "s", "vq": "^"}
  for ax, domain in zip(axes, DOMAINS):
    for k in order:
      if k[1] != domain:
        continue
      color = "C0" if k[0] == "baseline" else "C1"
      xs = [r["general"] for r in out[k].values()]
      ys = [-r["target"] for r in out[k].values()]
      ax.scatter(xs, ys, marker=marks[k[2]], color=color, alpha=0.5)
      ax.scatter([statistics.mean(xs)], [statistics.mean(ys)], marker=marks[k[2]], color=color, s=90,
                 edgecolors="k", label=f"{k[0]} {k[2]}")
    ax.set_title(f"{domain} ({DOMAINS[domain]})")
    ax.set_xlabel("general loss: Δ KJV val loss")
    ax.set_ylabel("target gain: -Δ proxy nll")
    ax.axvline(0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(folder, "adaptation.png"), dpi=120)


if __name__ == "__main__":
  main()
