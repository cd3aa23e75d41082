"""Proxy task sets for the shipped domains and the KJV, built from each named source's validation split
(corpus.split_documents at `val_fraction`, the configs' 0.05), so that a run trained on that source
never saw their text. Deterministic: the same examples on every machine (python_stdlib's follow the
interpreter's standard library). One JSONL line per example, in the fields that the scoring module
(latent_jax/proxies.py) reads:

  python_stdlib  code       gold continuations: a function's body after its signature and docstring
  arithmetic     math       gold continuations: the worked answer after "A:"; multiple choice: the worked
                            answer against three with another final result
  kjv_facts      knowledge  gold continuations: the answer after "A:" (counts, verse text, testament);
                            multiple choice over book names for the facts whose answer is a book
  kjv            general    gold continuations: a verse's second half after the verse before it and its
                            first half; multiple choice: that second half against three of other verses

`python -m latent_jax.tasks --out DIR` writes them as DIR/NAME.jsonl.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os

from latent_jax.data import domains
from latent_jax.data.corpus import kjv_documents, split_documents

CAPABILITIES = {"python_stdlib": "code", "arithmetic": "math", "kjv_facts": "knowledge", "kjv": "general"}
TASK_SETS = tuple(CAPABILITIES)
MAX_EXAMPLES = 200         # per set (a multiple-choice example counts once)
FUNCTIONS_PER_FILE = 4
MAX_FUNCTION_CHARS = 1200  # prompt + body: short enough for a small model's context
VERSES_PER_CHAPTER = 4


def rank(text: str, salt: str = "") -> int:
  """A stable pseudo-random number from `text`: which distractors, and where the gold one goes."""
  return int.from_bytes(hashlib.sha256((salt + text).encode()).digest()[:8], "big")


def shuffled(gold: str, distractors: list[str], key: str) -> tuple[list[str], int]:
  """(choices, index of the gold one): the gold answer at a position `key` decides."""
  choices = list(distractors)
  at = rank(key, "position") % (len(choices) + 1)
  choices.insert(at, gold)
  return choices, at


def continuation(prompt, text, source):
  return {"prompt": prompt, "continuation": text, "source": source, "capability": CAPABILITIES[source]}


def choice(prompt, choices, gold, source):
  return {"prompt": prompt, "choices": choices, "gold": gold, "source": source, "capability": CAPABILITIES[source]}


def held_out(source: str, val_fraction: float, train: bool = False):
  """The validation documents of a named source (and its training ones, with `train`)."""
  docs = kjv_documents() if source == "kjv" else domains.domain_documents(source)
  train_docs, val_docs = split_documents(docs, val_fraction)
  return (val_docs, train_docs) if train else val_docs


# ----------------------------------------------------------------------------- per source


def function_examples(source_text: str) -> list[dict]:
  """Functions of one file (at most FUNCTIONS_PER_FILE, those of 2 to 20 body lines and at most
  MAX_FUNCTION_CHARS): the prompt is the decorators, signature and docstring, the continuation the rest."""
  try:
    tree = ast.parse(source_text)
  except (SyntaxError, ValueError):
    return []
  lines, found = source_text.split("\n"), []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(found) >= FUNCTIONS_PER_FILE:
      continue
    body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
    if not body or not 2 <= node.end_lineno - body[0].lineno + 1 <= 20:
      continue
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    if lines[body[0].lineno - 1][:body[0].col_offset].strip():
      continue  # the body starts on the signature's (or docstring's) line: "def f(): return 1"
    prompt = "\n".join(lines[start - 1:body[0].lineno - 1])
    code = "\n" + "\n".join(lines[body[0].lineno - 1:node.end_lineno])
    if len(prompt) + len(code) <= MAX_FUNCTION_CHARS and prompt.rstrip().endswith((":", '"""', "'''")):
      found.append(continuation(prompt.rstrip(), code, "python_stdlib"))
  return found


def python_stdlib_examples(val_fraction: float) -> list[dict]:
  """The held-out files' functions, less those that a training file holds too (copied code)."""
  val_docs, train_docs = held_out("python_stdlib", val_fraction, train=True)
  found = {}
  for e in (e for doc in val_docs for e in function_examples(doc)):
    text = e["prompt"] + e["continuation"]
    if text not in found and not any(text in doc for doc in train_docs):
      found[text] = e
  return list(found.values())


def arithmetic_examples(val_fraction: float) -> list[dict]:
  """Each held-out problem as a gold continuation, then as a multiple choice (alternating, in order)."""
  problems = {p.text: p for p in domains.arithmetic_problems()}
  found = []
  for i, doc in enumerate(held_out("arithmetic", val_fraction)):
    p = problems[doc]
    prompt = f"Q: {p.question}\nA:"
    if i % 2 == 0:
      found.append(continuation(prompt, p.worked(p.answer), "arithmetic"))
    else:
      wrong = [p.answer + 1, p.answer + 10, p.answer - 1 if p.answer > 0 else p.answer + 2]
      choices, gold = shuffled(p.worked(p.answer), [p.worked(w) for w in wrong], doc)
      found.append(choice(prompt, choices, gold, "arithmetic"))
  return found


def kjv_facts_examples(val_fraction: float) -> list[dict]:
  """A held-out fact whose answer is a book: multiple choice against three other books; any other:
  its answer as a gold continuation."""
  facts = {f.text: f for f in domains.kjv_facts()}
  books = list(domains.book_names().values())
  found = []
  for doc in held_out("kjv_facts", val_fraction):
    f = facts[doc]
    prompt = f"Q: {f.question}\nA:"
    if f.book_answer:
      others = sorted((b for b in books if b != f.answer), key=lambda b: rank(doc + b))[:3]
      choices, gold = shuffled(f" {f.answer}.", [f" {b}." for b in others], doc)
      found.append(choice(prompt, choices, gold, "kjv_facts"))
    else:
      found.append(continuation(prompt, f" {f.answer}.", "kjv_facts"))
  return found


def kjv_examples(val_fraction: float) -> list[dict]:
  """Verses of the held-out chapters (VERSES_PER_CHAPTER, spread over each): the verse before and the
  first half of its words as the prompt, the second half as a gold continuation and, in a second
  example, against the second halves of three other held-out verses."""
  held = set(held_out("kjv", val_fraction))
  chapters = {}
  for v in domains.kjv_verses():
    chapters.setdefault((v.book, v.chapter), []).append(v)
  cases = []
  for doc, verses in zip(kjv_documents(), chapters.values()):  # one document per chapter, in order
    if doc not in held:
      continue
    step = max(1, len(verses) // VERSES_PER_CHAPTER)
    for i in range(1, len(verses), step)[:VERSES_PER_CHAPTER]:
      words = verses[i].text.split()
      if len(words) >= 6:
        half = len(words) // 2
        cases.append((f"{verses[i - 1].text} {' '.join(words[:half])}", " " + " ".join(words[half:])))
  found = []
  for prompt, gold in cases:
    found.append(continuation(prompt, gold, "kjv"))
  for prompt, gold in cases:
    others = sorted((g for _, g in cases if g != gold), key=lambda g: rank(prompt + g))[:3]
    choices, at = shuffled(gold, others, prompt)
    found.append(choice(prompt, choices, at, "kjv"))
  return found


BUILDERS = {"python_stdlib": python_stdlib_examples, "arithmetic": arithmetic_examples,
            "kjv_facts": kjv_facts_examples, "kjv": kjv_examples}


def task_set(name: str, val_fraction: float = 0.05, max_examples: int = MAX_EXAMPLES) -> list[dict]:
  """The examples of one of TASK_SETS: at most `max_examples`, spread evenly over all it has."""
  found = BUILDERS[name](val_fraction)
  if len(found) > max_examples:
    found = [found[i * len(found) // max_examples] for i in range(max_examples)]
  return found


def write_task_sets(out: str, names=TASK_SETS, val_fraction: float = 0.05, max_examples: int = MAX_EXAMPLES):
  """OUT/NAME.jsonl for each set -> {name: path}."""
  os.makedirs(out, exist_ok=True)
  written = {}
  for name in names:
    path = os.path.join(out, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in task_set(name, val_fraction, max_examples))
    written[name] = path
  return written
