"""Capability proxies (NCP paper, Appendix C): a model's teacher-forced scores on local task files, the one
scoring module that the train loop's evaluation (`train.eval_tasks`) and `python -m latent_jax.eval --tasks`
call, and whose log-likelihood path the lm-evaluation-harness model (latent_jax/harness.py) shares.

A task file is JSONL, one example a line, with exactly these fields:
  gold continuation  {"prompt": str, "continuation": str, "source": str, "capability": str}
  multiple choice    {"prompt": str, "choices": [str, ...], "gold": int, "source": str, "capability": str}
A continuation or choice is appended to the prompt as it is (give it its leading space). Its tokens are
split as lm-evaluation-harness splits a request: the prompt's trailing whitespace moves to the
continuation, prompt + continuation is encoded and the prompt's own tokens dropped (an empty prompt is
EOS). A row longer than data.seq_len + 1 tokens keeps its end.

Metrics (Eq. 28: a mean over each source's examples, then over a capability's sources, so that a large
source does not outweigh the others):
  proxy/S/nll, proxy/C/nll  mean token NLL (nats) of each gold continuation, of source S / capability C
  proxy/C/bpb               bits per UTF-8 byte of each gold continuation's scored tokens
  proxy/C/acc               multiple choice: the gold choice has the highest log-likelihood
  proxy/C/acc_norm          ... the highest log-likelihood per character (lm-eval's acc_norm)
  proxy/C/margin            gold minus the strongest distractor, in log-likelihood per character
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from latent_jax import paths, sharding

MIN_BUCKET = 16
CONTINUATION = ("prompt", "continuation", "source", "capability")
CHOICE = ("prompt", "choices", "gold", "source", "capability")
MAKE = "write the shipped sets with python -m latent_jax.tasks --out DIR"


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  source: str
  capability: str
  where: str                      # FILE:LINE, for errors
  continuation: str | None = None  # a gold-continuation example ...
  choices: tuple[str, ...] = ()   # ... or a multiple-choice one
  gold: int = -1

  @property
  def texts(self) -> tuple[str, ...]:
    """What is scored after the prompt: the continuation, or each choice."""
    return (self.continuation,) if self.continuation is not None else self.choices


# ----------------------------------------------------------------------------- task files


def task_files(spec, origin: str) -> list[str]:
  """`spec` (a comma-separated string, or a sequence of them) -> the file paths, in order; a folder
  stands for its .jsonl files, in name order."""
  parts = [spec] if isinstance(spec, str) else list(spec or ())
  files = []
  for f in (f.strip() for part in parts for f in str(part).split(",") if f.strip()):
    if paths.path(f).is_dir():
      found = sorted(str(p) for p in paths.path(f).glob("*.jsonl"))
      if not found:
        raise FileNotFoundError(f"{origin}: the folder {f} holds no .jsonl task files; {MAKE}.")
      files += found
    else:
      files.append(f)
  if parts and not files:
    raise ValueError(f"{origin}={spec!r} names no task file; give JSONL files or a folder of them ({MAKE}).")
  return files


def read_tasks(files, origin: str) -> list[Example]:
  """The examples of every file, checked: a line that is not an object of exactly the fields above is
  one error naming `origin` (the flag or setting), the file, the line and the field."""
  examples = []
  for path in files:
    if not paths.path(path).is_file():
      raise FileNotFoundError(f"{origin}: task file {path} does not exist; {MAKE}, or write your own "
                              "(docs/data.md, \"Capability proxies\").")
    try:
      lines = paths.path(path).read_bytes().decode("utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as e:
      raise ValueError(f"{origin}: task file {path} is not UTF-8 text (byte offset {e.start}); re-encode it.") from None
    found = [parse_line(line, f"{path}:{n}", origin) for n, line in enumerate(lines, start=1) if line.strip()]
    if not found:
      raise ValueError(f"{origin}: task file {path} holds no examples; one JSON object a line.")
    examples += found
  check_names(examples, origin)
  return examples


def parse_line(line: str, where: str, origin: str) -> Example:
  def bad(field, why):
    return ValueError(f"{origin}: {where}: field {field!r} {why}")
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{origin}: {where} is not valid JSON ({e.msg}); one JSON object a line.") from None
  if not isinstance(record, dict):
    raise ValueError(f"{origin}: {where} is not a JSON object; give {{\"prompt\": ..., ...}}.")
  fields = CHOICE if "choices" in record or "gold" in record else CONTINUATION
  for field in record:
    if field not in fields:
      raise bad(field, f"is not a field of a {'multiple-choice' if fields is CHOICE else 'gold-continuation'} "
                f"example, which has exactly {', '.join(fields)}.")
  for field in fields:
    if field not in record:
      raise bad(field, f"is missing; a {'multiple-choice' if fields is CHOICE else 'gold-continuation'} example "
                f"has exactly {', '.join(fields)}.")
  for field in ("prompt", "source", "capability") + (("continuation",) if fields is CONTINUATION else ()):
    if not isinstance(record[field], str):
      raise bad(field, f"must be a string, got {json.dumps(record[field])[:40]}.")
  for field in ("source", "capability"):
    if not record[field].strip() or "/" in record[field]:
      raise bad(field, f"must be a non-empty name without '/' (it goes into proxy/NAME/...), got {record[field]!r}.")
  if fields is CONTINUATION:
    if not record["continuation"]:
      raise bad("continuation", "is empty; give the text to score after the prompt.")
    return Example(record["prompt"], record["source"], record["capability"], where, continuation=record["continuation"])
  choices, gold = record["choices"], record["gold"]
  if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
    raise bad("choices", "must be a list of two or more non-empty strings.")
  if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
    raise bad("gold", f"must be the index of the gold choice, an integer in [0, {len(choices) - 1}], got {gold!r}.")
  return Example(record["prompt"], record["source"], record["capability"], where, choices=tuple(choices), gold=gold)


def check_names(examples, origin):
  """A name that is both a source and a capability would give proxy/NAME/nll two meanings: refused, unless
  the two are one group (every example of the one is of the other)."""
  sources, capabilities = {e.source for e in examples}, {e.capability for e in examples}
  for name in sorted(sources & capabilities):
    e = next((e for e in examples if e.source == name and e.capability != name), None)
    if e:
      raise ValueError(f"{origin}: {e.where}: field 'source': {name!r} also names a capability, so proxy/{name}/nll "
                       "would mean both; rename the source or the capability.")
    e = next((e for e in examples if e.capability == name and e.source != name), None)
    if e:
      raise ValueError(f"{origin}: {e.where}: field 'capability': {name!r} also names a source, so proxy/{name}/nll "
                       "would mean both; rename the source or the capability.")


# ----------------------------------------------------------------------------- log-likelihoods


def encode_pair(tokenizer, prompt: str, text: str) -> tuple[list[int], list[int]]:
  """(prompt ids, continuation ids) as lm-evaluation-harness splits a request (TemplateLM.loglikelihood):
  the prompt's trailing whitespace moves to the continuation, prompt + continuation is encoded and the
  prompt's own tokens dropped; an empty prompt is EOS (the token a document follows)."""
  if prompt == "":
    ids = tokenizer.encode(text)
    return ([tokenizer.eos_id], ids) if not ids or ids[0] != tokenizer.eos_id else (ids[:1], ids[1:])
  spaces = len(prompt) - len(prompt.rstrip())
  if spaces:
    prompt, text = prompt[:-spaces], prompt[-spaces:] + text
  context = tokenizer.encode(prompt)
  return context, tokenizer.encode(prompt + text)[len(context):]


def bucket(n, cap):
  """The padded length of n tokens: the next power of two, at least MIN_BUCKET, at most cap (or n
  itself, past cap)."""
  return max(n, min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length())))


def score(model, inputs, targets, scored):
  """Per row [B]: the summed log-probability of `targets` [B, T] where `scored`, and whether each
  of them is the argmax; `model`'s ordinary forward logits."""
  logits = model(inputs).logits.astype(jnp.float32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  greedy = jnp.argmax(logits, axis=-1) == targets
  return jnp.where(scored, logp, 0.0).sum(-1), jnp.all(greedy | ~scored, axis=-1)


def window(context, continuation, max_length):
  """(the tokens a request is scored on: its last max_length + 1, the continuation tokens among them)."""
  whole = (list(context) + list(continuation))[-(max_length + 1):]
  return whole, min(len(continuation), len(whole) - 1)


def loglikelihoods(pairs, run, rows, max_length, pad_id, progress=lambda starts: starts):
  """(context ids, continuation ids) pairs -> [(summed log-prob of the continuation, is it greedy)].

  Longest first, `rows` at a time, each batch right-padded to a length bucket (both models are causal:
  padding after a row changes none of its scores); `run(inputs, targets, scored)` scores one batch (numpy
  [rows, T] each) -> (log-probs [rows], greedy [rows]). `progress` wraps the batches' start indices."""
  wholes = [window(c, k, max_length) for c, k in pairs]
  order = sorted(range(len(pairs)), key=lambda i: -len(wholes[i][0]))
  results = [None] * len(pairs)
  for start in progress(range(0, len(order), rows)):
    batch = order[start:start + rows]
    length = bucket(len(wholes[batch[0]][0]) - 1, max_length)
    inputs = np.full((rows, length), pad_id, np.int32)
    targets = np.zeros((rows, length), np.int32)
    scored = np.zeros((rows, length), bool)
    for r, i in enumerate(batch):
      whole, m = wholes[i]
      n = len(whole) - 1
      inputs[r, :n], targets[r, :n], scored[r, n - m:n] = whole[:-1], whole[1:], True
    logp, greedy = run(inputs, targets, scored)
    for r, i in enumerate(batch):
      results[i] = (float(logp[r]), bool(greedy[r]))
  return results


# ----------------------------------------------------------------------------- metrics


def mean_of_means(groups):
  """Eq. 28: {outer: {inner: [values]}} -> {outer: the mean over its inner groups of their means}."""
  return {outer: float(np.mean([np.mean(v) for v in inner.values()])) for outer, inner in groups.items()}


def proxy_metrics(examples, lls, token_counts, token_bytes):
  """The proxy/... metrics from each example's log-likelihoods (one per text: the continuation, or each
  choice), with, for a continuation, its scored tokens and their UTF-8 bytes."""
  per = {name: {} for name in ("nll", "bpb", "acc", "acc_norm", "margin")}
  source_nll = {}
  for e, ll, n, nb in zip(examples, lls, token_counts, token_bytes):
    add = lambda name, value, e=e: per[name].setdefault(e.capability, {}).setdefault(e.source, []).append(value)
    if e.continuation is not None:
      nll = -ll[0] / n[0]
      add("nll", nll)
      add("bpb", -ll[0] / math.log(2) / max(nb[0], 1))
      source_nll.setdefault(e.source, []).append(nll)
    else:
      ll = np.asarray(ll)
      per_char = ll / np.asarray([len(c) for c in e.choices], np.float64)
      add("acc", float(np.argmax(ll) == e.gold))
      add("acc_norm", float(np.argmax(per_char) == e.gold))
      add("margin", float(per_char[e.gold] - np.delete(per_char, e.gold).max()))
  metrics = {f"proxy/{s}/nll": float(np.mean(v)) for s, v in source_nll.items()}
  for name, groups in per.items():
    metrics.update({f"proxy/{c}/{name}": v for c, v in mean_of_means(groups).items()})
  return dict(sorted(metrics.items()))


BYTE_PIECES_WARNING = 0.25  # the share of a source's scored tokens that are byte-fallback pieces: warned above


def warn_byte_pieces(tallies, origin, file=None):
  """One line on stderr (process 0) naming the sources whose scored tokens are largely byte-fallback pieces
  `<0x..>` for this tokenizer: text its training never saw (digits, for a KJV tokenizer), spelt a byte a token,
  which the proxies then score as such (bits per byte can exceed 8, accuracy fall below chance: docs/data.md)."""
  shares = {s: b / n for s, (b, n) in sorted(tallies.items()) if n and b / n >= BYTE_PIECES_WARNING}
  if shares and jax.process_index() == 0:
    listing = ", ".join(f"{s} {100 * share:.0f}%" for s, share in shares.items())
    print(f"warning: {origin}: the model's tokenizer spells much of these task sets' scored text as byte-fallback "
          f"pieces <0x..>, text its training never saw ({listing} of their tokens), so their proxies measure "
          "little (bits per byte can exceed 8, accuracy fall below chance); train the tokenizer on such text too: "
          "data.tokenizer_sources (docs/data.md, \"Capability proxies\").", file=file or sys.stderr, flush=True)


class Proxies:
  """The proxy metrics of task examples (`read_tasks`) for one model layout: encodes them once;
  `proxies(params)` scores them (on every process alike: each builds the same rows, and the scores
  come back replicated).

  graphdef, param_shardings, mesh: the model's (a training's own, or the inference model's);
  `transform(params)` gives the params the model computes with (a LoRA run's merged weights).
  rows: per batch, rounded up to a multiple of the mesh's batch shards; max_length: the tokens of a row.
  """

  def __init__(self, examples, origin, tokenizer, graphdef, param_shardings, mesh, rows=8, max_length=128,
               transform=None):
    self.examples = examples
    self.pairs, self.owners, self.max_length, self.pad_id = [], [], max_length, tokenizer.pad_id
    table = np.asarray(tokenizer.token_bytes)
    self.counts, self.bytes = [], []
    byte_pieces = {}  # source -> [byte-fallback pieces, tokens] among its scored tokens
    for i, e in enumerate(self.examples):
      counts, nbytes = [], []
      for text in e.texts:
        context, continuation = encode_pair(tokenizer, e.prompt, text)
        whole, m = window(context, continuation, max_length)
        if m == 0:
          field = "continuation" if e.continuation is not None else "choices"
          raise ValueError(f"{origin}: {e.where}: field {field!r}: {text[:30]!r} has no tokens of its own after the "
                           "prompt with this tokenizer (it merges into the prompt's last one); end the prompt at a "
                           "word boundary.")
        self.pairs.append((context, continuation))
        self.owners.append(i)
        counts.append(m)
        nbytes.append(int(table[whole[len(whole) - m:]].sum()))
        tally = byte_pieces.setdefault(e.source, [0, 0])
        tally[0] += int(tokenizer.byte_pieces[whole[len(whole) - m:]].sum())
        tally[1] += m
      self.counts.append(counts)
      self.bytes.append(nbytes)
    warn_byte_pieces(byte_pieces, origin)
    self.rows_sharding = sharding.batch_sharding(mesh)
    axes = self.rows_sharding.spec[0] or ()
    shards = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    self.rows = -(-rows // shards) * shards
    transform = transform or (lambda p: p)

    def run(params, inputs, targets, scored):
      with sharding.use_mesh(mesh):
        return score(nnx.merge(graphdef, transform(params)), inputs, targets, scored)[0]
    self._run = jax.jit(run, in_shardings=(param_shardings,) + (self.rows_sharding,) * 3,
                        out_shardings=sharding.replicated(mesh))

  def place(self, array):
    return jax.make_array_from_callback(array.shape, self.rows_sharding, lambda index: array[index])

  def loglikelihoods(self, params) -> list[float]:
    """Each (example, text) pair's summed continuation log-probability, in the order of self.pairs."""
    def run(*rows):
      logp = np.asarray(jax.device_get(self._run(params, *map(self.place, rows))))
      return logp, np.zeros(len(logp), bool)  # the greedy flags: no proxy needs them
    return [ll for ll, _ in loglikelihoods(self.pairs, run, self.rows, self.max_length, self.pad_id)]

  def __call__(self, params) -> dict[str, float]:
    lls = [[] for _ in self.examples]
    for i, ll in zip(self.owners, self.loglikelihoods(params)):
      lls[i].append(ll)
    return proxy_metrics(self.examples, lls, self.counts, self.bytes)


def for_run(cfg, tokenizer, graphdef, param_shardings, mesh, transform=None):
  """The Proxies of a training run's `train.eval_tasks` (None when it names none): read and checked
  before anything is written, scored at every evaluation."""
  files = task_files(cfg.train.get("eval_tasks", ()), "train.eval_tasks")
  if not files:
    return None
  return Proxies(read_tasks(files, "train.eval_tasks"), "train.eval_tasks", tokenizer, graphdef, param_shardings,
                 mesh, max_length=cfg.data.seq_len, transform=transform)
