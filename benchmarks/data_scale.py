"""Training from a token store: memory and start-up against the corpus size; prepare and loader throughput.

  python benchmarks/data_scale.py [--dir=/tmp/latent_jax_data_scale] [--gb=0.1,1] [--workers=2] [--steps=10]
      [--repeats=5] [--config=configs/tiny.py]

1. corpus   DIR/corpus/part-NNNNN.jsonl: synthetic documents of 4 to 120 KJV sentences drawn at random
            (seeded by the file's number), about 100 MB of text per file. The 0.1 GB corpus is the
            first file, the 1 GB corpus the first ten. Reused when present.
2. prepare  python -m latent_jax.prepare --workers=W into DIR/store-GB (the tokenizer trained once, on
            its bounded sample of --sample_mb=64): MB/s of text per worker, over the whole prepare
            and over what follows the tokenizer (the shards, then the manifest's checksums and
            counts); the seconds to the tokenizer (scan + training it); peak RSS of its largest
            process (the main one or a worker). A finished store is reused, with the figures its
            prepare recorded (DIR/store-GB.json).
3. train    python -m latent_jax.train from the store (train.steps=--steps, log_every=1, no eval), in a
            fresh process, --repeats times per size, the sizes interleaved: peak RSS (wait4's
            ru_maxrss), seconds from the process start to its first completed step (the first row
            of metrics.jsonl) and, of them, compiling the step; rows/s the step consumes (median
            over steps 2..).
4. loader   build_data + make_train_iterator alone, in a fresh process: seconds to the first batch
            (opening the store included), rows/s over 2000 batches, peak RSS. The store was just
            written, so its files are in the page cache.

One JSON line per measurement, then the largest corpus against the smallest (time: the median of the
repeats, as a shared machine disturbs some runs; RSS: the largest), and the loader's rows/s over the fastest step's. MB = 10^6 bytes of
document text (UTF-8). Delete DIR when done.
"""
import concurrent.futures
import json
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from latent_jax import cli, load_config
from latent_jax.data import build_data, make_train_iterator
from latent_jax.data.corpus import kjv_documents

FILE_BYTES = 100 * 10**6
FLAGS = [
    cli.Flag("dir", str, os.path.join(tempfile.gettempdir(), "latent_jax_data_scale"), "corpus, stores and runs"),
    cli.Flag("gb", str, "0.1,1", "corpus sizes, GB of text: multiples of 0.1"),
    cli.Flag("workers", int, 2, "prepare's tokenising processes", lambda n: n >= 1, ">= 1"),
    cli.Flag("steps", int, 10, "training steps per run", lambda n: n >= 2, ">= 2"),
    cli.Flag("repeats", int, 5, "training runs per corpus", lambda n: n >= 1, ">= 1"),
    cli.Flag("config", str, "configs/tiny.py", "the model and data.seq_len / batch_size of the runs"),
]


def write_corpus(folder, files):
  """part-00000.jsonl .. part-{files-1}.jsonl, each ~FILE_BYTES of text; existing files are kept."""
  os.makedirs(folder, exist_ok=True)
  paths = [os.path.join(folder, f"part-{i:05d}.jsonl") for i in range(files)]
  missing = [i for i, p in enumerate(paths) if not os.path.exists(p)]
  if missing:
    sentences = np.array([s for d in kjv_documents() for s in re.split(r"(?<=[.!?;:])\s+", d) if s], dtype=object)
  for i in missing:
    rng, size, lines = np.random.default_rng([1234, i]), 0, []
    while size < FILE_BYTES:
      k = int(rng.integers(4, 121))
      seps = np.where(rng.random(k) < 0.1, "\n", " ")  # a paragraph break after one sentence in ten
      doc = "".join(s + sep for s, sep in zip(sentences[rng.integers(0, len(sentences), k)], seps))[:-1]
      lines.append(json.dumps({"text": doc}) + "\n")
      size += len(doc.encode())
    with open(paths[i] + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(lines)
    os.replace(paths[i] + ".tmp", paths[i])
  return paths


def run_child(cmd, log, on_line=None, poll=None):
  """Runs cmd (stdout line by line to on_line(line, seconds), else to the log; stderr to the log) ->
  (seconds, rusage of it and its waited children, (seconds, CPU seconds) when poll() first held, or None)."""
  seen = None
  with open(log, "w") as err:
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE if on_line else err, stderr=err, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in p.stdout if on_line else ():
      on_line(line, time.perf_counter() - start)
    while not (done := os.wait4(p.pid, os.WNOHANG))[0]:  # wait4, not p.poll(): it gives the child's rusage
      if poll and seen is None and poll():
        seen = time.perf_counter() - start, cpu_seconds(p.pid)
      time.sleep(0.01)
    seconds = time.perf_counter() - start
  p.returncode = os.waitstatus_to_exitcode(done[1])
  if p.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
  return seconds, done[2], seen


def cpu_seconds(pid):
  """User + system CPU seconds of a running process, all its threads (Linux: /proc/PID/stat)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()  # after the command name: state, ppid, ...
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prepare(a, source, out, gb):
  record = out + ".json"
  if os.path.isfile(os.path.join(out, "manifest.json")) and os.path.isfile(record):
    with open(record) as f:
      return {**json.load(f), "reused": True}
  lines = {}
  seconds, usage, _ = run_child(
      [sys.executable, "-m", "latent_jax.prepare", f"--config={a.config}", f"--out={out}",
       f"--config.data.source={source}", f"--workers={a.workers}"], out + ".log",
      on_line=lambda line, t: lines.setdefault(line.split(":")[0], t))
  with open(os.path.join(out, "manifest.json")) as f:
    manifest = json.load(f)
  text_mb = sum(s["source_bytes"] for s in manifest["shards"]) / 1e6
  result = {"measure": "prepare", "gb": gb, "text_mb": round(text_mb, 1), "workers": a.workers,
            "shards": len(manifest["shards"]), "tokens": sum(s["tokens"] for s in manifest["splits"].values()),
            "seconds": round(seconds, 1), "to_tokenizer_s": round(lines.get("tokenizer", float("nan")), 1),
            "mb_per_s_per_worker": round(text_mb / seconds / a.workers, 2),
            "shards_mb_per_s_per_worker": round(text_mb / (seconds - lines.get("tokenizer", 0)) / a.workers, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "store_mb": round(dir_bytes(out) / 1e6)}
  with open(record, "w") as f:
    json.dump(result, f)
  return result


def dir_bytes(folder):
  return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(folder) for n in names)


def train(a, store, gb, run):
  workdir = os.path.join(a.dir, f"run-{gb}-{run}")
  shutil.rmtree(workdir, ignore_errors=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  seconds, usage, first = run_child(
      [sys.executable, "-m", "latent_jax.train", f"--config={a.config}", f"--workdir={workdir}",
       f"--config.data.source={store}", f"--config.train.steps={a.steps}", "--config.train.log_every=1",
       "--config.train.eval_every=0", f"--config.train.checkpoint_every={a.steps}",
       "--config.optim.warmup_steps=1"], workdir + ".log",
      poll=lambda: os.path.isfile(metrics) and os.path.getsize(metrics) > 0)
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  with open(workdir + ".log") as f:
    compile_s = float(re.search(r"compiled the train step in ([\d.]+) s", f.read()).group(1))
  seq_len = load_config(a.config).data.seq_len
  return {"measure": "train", "gb": gb, "run": run, "peak_rss_mb": round(usage.ru_maxrss / 1024),
          "first_step_s": round(first[0], 2), "first_step_cpu_s": round(first[1], 2), "compile_s": compile_s,
          "seconds": round(seconds, 1),
          "step_rows_per_s": round(float(np.median([r["tokens_per_s"] for r in rows[1:]])) / seq_len, 1)}


def loader(config, store, gb, batches=2000):
  """In a fresh process: the train iterator alone, from the store."""
  start = time.perf_counter()
  cfg = load_config(config, [f"data.source={store}"])
  with tempfile.TemporaryDirectory() as workdir:
    data = build_data(cfg, workdir)
    it = make_train_iterator(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.seed)
    next(it)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
      next(it)
    rows_per_s = batches * cfg.data.batch_size / (time.perf_counter() - start)
  return {"measure": "loader", "gb": gb, "first_batch_s": round(first, 3), "rows_per_s": round(rows_per_s),
          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def in_fresh_process(fn, *args):
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(fn, *args).result()


def main(argv=None):
  with cli.errors():
    a = cli.parse(__doc__, FLAGS, argv)
    sizes = [float(g) for g in a.gb.split(",")]
    if any(round(g * 10) < 1 or abs(g * 10 - round(g * 10)) > 1e-9 for g in sizes):
      raise ValueError(f"--gb={a.gb}: each size must be a multiple of 0.1 (GB).")
  memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  print(json.dumps({"machine": f"{os.cpu_count()} cores, {memory_gib:.0f} GiB", "date": time.strftime("%Y-%m-%d %H:%M"),
                    "load_average": [round(x, 2) for x in os.getloadavg()], "config": a.config}))
  paths = write_corpus(os.path.join(a.dir, "corpus"), round(max(sizes) * 10))
  stores, results = {}, []
  for gb in sizes:
    stores[gb] = os.path.join(a.dir, f"store-{gb:g}")
    results.append(prepare(a, ",".join(paths[:round(gb * 10)]), stores[gb], gb))
    print(json.dumps(results[-1]), flush=True)
  for run in range(a.repeats):
    for gb in sizes:
      results.append(train(a, stores[gb], gb, run))
      print(json.dumps(results[-1]), flush=True)
  for gb in sizes:
    results.append(in_fresh_process(loader, a.config, stores[gb], gb))
    print(json.dumps(results[-1]), flush=True)
  small, large = min(sizes), max(sizes)
  of = lambda measure, gb: [r for r in results if r["measure"] == measure and r["gb"] == gb]
  ratio = lambda measure, key, pick: round(float(pick([r[key] for r in of(measure, large)])
                                                 / pick([r[key] for r in of(measure, small)])), 3)
  print(json.dumps({"summary": f"{large:g} GB / {small:g} GB",
                    "train_peak_rss": ratio("train", "peak_rss_mb", max),
                    "train_first_step": ratio("train", "first_step_s", np.median),
                    "train_first_step_cpu": ratio("train", "first_step_cpu_s", np.median),
                    "loader_first_batch": ratio("loader", "first_batch_s", min),
                    "loader_peak_rss": ratio("loader", "peak_rss_mb", max),
                    "loader_rows_over_step_rows": {gb: round(of("loader", gb)[0]["rows_per_s"]
                                                             / max(r["step_rows_per_s"] for r in of("train", gb)))
                                                   for gb in sizes},
                    "load_average": [round(x, 2) for x in os.getloadavg()]}))

if __name__ == "__main__":
  main()
