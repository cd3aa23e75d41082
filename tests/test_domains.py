"""The shipped domains (latent_jax/data/domains.py) as named data sources, and their proxy task sets
(latent_jax/data/task_sets.py, python -m latent_jax.tasks): deterministic, split train / validation with no
document in both, the task sets drawn from the validation split only; each trains and prepares by name."""
import hashlib
import json
import os
import sysconfig

import numpy as np
import pytest

from conftest import TINY, TINY_OVERRIDES

from latent_jax import load_config, proxies
from latent_jax.data import build_data, domains, load_documents, split_documents, task_sets
from latent_jax.data.corpus import NAMED_SOURCES, kjv_documents


@pytest.mark.parametrize("name", domains.DOMAINS)
def test_a_domain_is_deterministic_and_splits_disjointly(name):
  docs = load_documents(name)
  assert name in NAMED_SOURCES and docs == load_documents(name) and len(set(docs)) == len(docs) > 500
  train, val = split_documents(docs, 0.05)
  assert not set(train) & set(val) and len(val) == round(0.05 * len(docs)) and len(train) + len(val) == len(docs)


def test_arithmetic_and_kjv_facts_are_the_same_everywhere():
  """Pinned: the generators draw only with random.Random.random (whose sequence Python keeps) or read the KJV."""
  digest = lambda docs: hashlib.sha256("\n".join(docs).encode()).hexdigest()
  arithmetic, facts = domains.arithmetic_documents(), domains.kjv_facts_documents()
  assert (len(arithmetic), digest(arithmetic)) == (
      4000, "c8daadf80f745e297f1e5a35e8aafa58725a1ce96bb1f74f40b616a15e6ecc94")
  assert (len(facts), digest(facts)) == (3891, "7172dce68b466a5aa64c04ab6e886d09b2e971a0d25d3d05d9ec9bdc44733426")
  assert "Q: What is 299 + 8?\nA: 299 + 8 = 307. The answer is 307." == arithmetic[0]
  for fact in ("Q: How many chapters are in the book of Ruth?\nA: 4.",
               "Q: Which book begins 'In the beginning God created'?\nA: Genesis.",
               "Q: What does Psalms 23:1 say?\nA: The LORD is my shepherd; I shall not want.",
               "Q: How many verses are in Genesis 1?\nA: 31.", "Q: Which book comes after Ruth?\nA: 1 Samuel.",
               "Q: Is Jude in the Old Testament or the New Testament?\nA: The New Testament."):
    assert fact in facts, fact
  for doc in arithmetic:  # every worked answer is right
    question, _, answer = doc.partition("\nA: ")
    steps = [s for s in answer.split(". ") if "=" in s]
    for step in steps:
      left, right = step.rstrip(".").split(" = ")
      assert eval(left) == int(right), doc  # pylint: disable=eval-used  # digits and + - * / only
    assert answer.endswith(f"The answer is {steps[-1].split(' = ')[1].rstrip('.')}.")


def test_python_stdlib_is_this_interpreters_library():
  root = sysconfig.get_paths()["stdlib"]
  files = domains.stdlib_files()
  relative = [os.path.relpath(f, root) for f in files]
  assert relative == sorted(relative) and "json/decoder.py" in relative
  assert not any(part in domains.SKIPPED_DIRS for r in relative for part in r.split(os.sep)[:-1])
  docs = domains.python_stdlib_documents()
  with open(os.path.join(root, "json", "decoder.py"), encoding="utf-8") as f:
    assert f.read() in docs
  with open(np.__file__, encoding="utf-8") as f:  # site-packages: left out
    assert f.read() not in docs


@pytest.mark.parametrize("name", task_sets.TASK_SETS)
def test_task_sets_come_from_the_validation_split(name, tmp_path):
  """Every example's text is in a held-out document of its source and (whole) in no training one; the
  file reads back through the scoring module; the same file twice."""
  examples = task_sets.task_set(name)
  source = "kjv" if name == "kjv" else name
  docs = kjv_documents() if name == "kjv" else load_documents(name)
  train, val = split_documents(docs, 0.05)
  assert 50 <= len(examples) <= task_sets.MAX_EXAMPLES
  for e in examples:
    gold = e["continuation"] if "continuation" in e else e["choices"][e["gold"]]
    assert e["source"] == source and e["capability"] == task_sets.CAPABILITIES[name]
    if name == "kjv":  # the verse's second half, from a held-out chapter (its words may recur elsewhere)
      assert any(gold.strip() in d for d in val), e
    elif name == "python_stdlib":
      assert any(e["prompt"] in d and gold in d for d in val), e
    else:  # one document per example
      assert e["prompt"] + gold in val, e
  written = task_sets.write_task_sets(str(tmp_path), [name])[name]
  assert len(proxies.read_tasks([written], "--tasks")) == len(examples)
  first = open(written, "rb").read()
  task_sets.write_task_sets(str(tmp_path), [name])
  assert open(written, "rb").read() == first
  if name in ("arithmetic", "kjv_facts", "kjv"):  # multiple choice too, the gold choice not always first
    golds = [e["gold"] for e in examples if "choices" in e]
    assert len(golds) > 20 and len(set(golds)) > 1


def test_tasks_command_writes_the_sets(tmp_path, capsys):
  from latent_jax.tasks import main
  main(["--out", str(tmp_path / "tasks"), "--sets=arithmetic,kjv_facts", "--max_examples=30"])
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert sorted(os.listdir(tmp_path / "tasks")) == ["arithmetic.jsonl", "kjv_facts.jsonl"]
  assert printed["arithmetic"] == [str(tmp_path / "tasks" / "arithmetic.jsonl"), 30]


def test_the_docs_commands_write_where_git_ignores(tmp_path):
  """What the README and docs/ tell a user to run from the repository leaves no untracked files: every relative
  --out, --workdir or --output path they name (python -m latent_jax.tasks --out tasks, runs/..., data/...)
  is ignored by git (.gitignore)."""
  import re
  import shutil
  import subprocess
  from conftest import ROOT
  if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):  # a worktree: a file
    pytest.skip("not a git checkout")
  docs = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                              if f.endswith(".md")]
  named = set()
  for doc in docs:
    text = open(doc, encoding="utf-8").read()
    code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S))
    for path in re.findall(r"--(?:out|workdir|output)[ =]([\w./-]+)(?![\w:])", re.sub(r"#.*", "", "\n".join(code))):
      if not path.startswith(("/", ".", "-")) and not path.isupper():  # DIR, FILE: placeholders
        named.add(path)
  assert "tasks" in named and "runs/tiny" in named, sorted(named)
  check = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], cwd=ROOT, capture_output=True,
                         text=True, input="".join(f"{p}/x\n" for p in sorted(named)))
  missed = [line.split("\t")[-1] for line in check.stdout.splitlines() if line.startswith("::")]
  assert not missed, f"not ignored by git: {missed}"


def test_a_domain_trains_by_name_and_prepares_into_the_same_split(tmp_path):
  """data.source=arithmetic builds its data like kjv; prepare stores it with the same validation documents,
  so its val tokens equal the in-memory ones under the store's tokenizer."""
  from latent_jax.prepare import prepare
  cfg = load_config(TINY, TINY_OVERRIDES + ["data.source=arithmetic", "model.vocab_size=512"])
  manifest = prepare(cfg, str(tmp_path / "store"), workers=1, log=lambda *a: None)
  train, val = split_documents(load_documents("arithmetic"), 0.05)
  assert (manifest["splits"]["train"]["docs"], manifest["splits"]["val"]["docs"]) == (len(train), len(val))
  tokenizer = os.path.join(tmp_path, "store", manifest["tokenizer"]["file"])
  stored = build_data(load_config(TINY, TINY_OVERRIDES + [f"data.source={tmp_path / 'store'}",
                                                          "model.vocab_size=512"]), str(tmp_path / "a"))
  direct = build_data(load_config(TINY, TINY_OVERRIDES + ["data.source=arithmetic", "model.vocab_size=512",
                                                          f"data.tokenizer={tokenizer}"]), str(tmp_path / "b"))
  assert direct.num_docs == {"train": len(train), "val": len(val)}
  np.testing.assert_array_equal(np.asarray(stored.val_tokens[:len(stored.val_tokens)]), direct.val_tokens)
