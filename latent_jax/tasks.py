"""python -m latent_jax.tasks --out DIR [--sets=python_stdlib,arithmetic,kjv_facts,kjv] [--val_fraction=0.05]
   [--max_examples=200]

Writes the proxy task sets of the shipped domains and the KJV as DIR/NAME.jsonl (latent_jax/data/task_sets.py),
from each named source's validation split at --val_fraction (a run's data.val_fraction: 0.05 in every
recipe), so a run trained on that source never saw them: code (python_stdlib: function bodies), math
(arithmetic: worked answers, and multiple choice against other final results), knowledge (kjv_facts: answers,
and multiple choice over book names) and general (kjv: verse continuations, and multiple choice against other
verses). The same files on every machine (python_stdlib's follow this interpreter's standard library). Score
them with python -m latent_jax.eval --tasks FILE[,FILE...], or at every evaluation of a training with
--config.train.eval_tasks=FILE[,FILE...]; prints one JSON line: {set: [path, examples]}.
"""
import json

from latent_jax import cli
from latent_jax.data import task_sets

FLAGS = [
    cli.Flag("out", str, cli.REQUIRED, "the folder to write NAME.jsonl into"),
    cli.Flag("sets", str, ",".join(task_sets.TASK_SETS), "comma-separated sets to write"),
    cli.Flag("val_fraction", float, 0.05, "the named sources' held-out fraction (the run's data.val_fraction)",
             lambda f: 0 < f < 1, "in (0, 1)"),
    cli.Flag("max_examples", int, task_sets.MAX_EXAMPLES, "examples per set at most, spread over all it has",
             lambda n: n >= 1, ">= 1"),
]


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in task_sets.TASK_SETS]
    if unknown or not names:
      raise ValueError(f"--sets={args.sets!r}: {', '.join(map(repr, unknown)) or 'no set'}; the sets are "
                       f"{', '.join(task_sets.TASK_SETS)}.")
    cli.writable_dir(args.out, "--out")
    written = task_sets.write_task_sets(args.out, names, args.val_fraction, args.max_examples)
    print(json.dumps({name: [path, sum(1 for _ in open(path, encoding="utf-8"))] for name, path in written.items()}))


if __name__ == "__main__":
  main()
