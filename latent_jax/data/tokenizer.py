"""SentencePiece tokenizer: load a given `.model`, reuse the workdir's, or train BPE.

A tokenizer trained (or adopted from train.init_from) for a workdir stays in memory until
`save()`, which the train loop calls once every check has passed: bad input writes nothing.

The trained tokenizer is lossless: identity normalisation, no dummy prefix, whitespace
kept as is and "\\n" a piece of its own, so `decode(encode(x)) == x` and the bytes of
the pieces (`token_bytes`) add up to the text's UTF-8 length; bits-per-byte is exact.
`model.vocab_size` is the size asked for: on a corpus too small to learn that many merges
the tokenizer comes out smaller. The model's vocabulary may exceed the tokenizer's by padding
only (`max_vocab_size`), as embedding rows past the tokenizer never see a token.
"""
from __future__ import annotations

import io
import os
import re
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import sentencepiece as spm

from latent_jax import distributed

TOKENIZER_FILENAME = "tokenizer.model"
_MAX_SENTENCE_BYTES = 8192
_INPUT_SENTENCES = 300_000  # SentencePiece samples this many sentences; the KJV has ~90k
_SENTENCE_END = re.compile(r"(?<=[.!?;:])(?=\s)")


class Tokenizer:
  """A thin wrapper over `sentencepiece.SentencePieceProcessor`, read from the `.model` file at
  `path`, or given as `proto` (a serialised model): then `new` until `save()` writes it to `path`."""

  def __init__(self, path: str, proto: bytes | None = None):
    self.path = os.fspath(path)
    self.new = proto is not None
    if proto is None:
      with open(self.path, "rb") as f:
        proto = f.read()
    self.proto = proto
    self.sp = _processor(proto, self.path)
    self.vocab_size: int = self.sp.get_piece_size()
    self.eos_id: int = self.sp.eos_id()
    self.bos_id: int = self.sp.bos_id()  # -1 when the model has none
    # Padding is only ever an input under a target of -1; EOS serves when the model
    # was trained without a pad piece.
    self.pad_id: int = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
    if self.eos_id < 0:
      raise ValueError(f"data.tokenizer: {self.path} has no EOS piece; documents are "
                       "separated by EOS, so train it with eos_id >= 0.")
    self.token_bytes = _token_bytes(self.sp)

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self.sp.encode(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    return self.sp.decode([int(i) for i in ids])

  def save(self):
    """Writes the model to `path` atomically: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(self.path)), prefix=".tokenizer.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(self.proto)
    os.replace(tmp, self.path)
    self.new = False

  def __repr__(self) -> str:
    return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _processor(proto: bytes, path: str) -> spm.SentencePieceProcessor:
  """The processor of a serialised model; an error naming `path` when the bytes are not one."""
  try:
    sp = spm.SentencePieceProcessor(model_proto=proto) if proto else None  # b"" would load, as nothing
  except RuntimeError:
    sp = None
  if sp is None:
    raise ValueError(f"{path} is not a SentencePiece model; use the tokenizer.model of a run, or a "
                     ".model file that SentencePiece wrote.")
  return sp


def _token_bytes(sp: spm.SentencePieceProcessor) -> np.ndarray:
  """UTF-8 bytes each piece stands for: `[vocab_size]` int32, for bits-per-byte.

  "▁" is one space byte, a byte-fallback piece one byte, control and unknown pieces 0.
  """
  out = np.zeros(sp.get_piece_size(), np.int32)
  for i in range(sp.get_piece_size()):
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
      continue
    out[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode())
  return out


def _sentences(docs: Sequence[str]) -> Iterator[str]:
  """Training sentences: lines, cut after sentence punctuation so that none is too long.

  The whitespace after the punctuation stays at the start of the next piece, so its
  first word is learnt with its "▁" as it appears inside running text.
  """
  for doc in docs:
    for line in doc.split("\n"):
      for piece in _SENTENCE_END.split(line):
        if piece.strip():
          yield piece


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> bytes:
  """Trains SentencePiece BPE on `docs`, in memory -> the serialised model."""
  model = io.BytesIO()
  spm.set_random_generator_seed(0)  # sentence sampling; one thread keeps merges fixed
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sentences(docs), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, byte_fallback=True,
        character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        user_defined_symbols=["\n"], unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        max_sentence_length=_MAX_SENTENCE_BYTES, input_sentence_size=_INPUT_SENTENCES,
        shuffle_input_sentence=True, hard_vocab_limit=False, num_threads=1, minloglevel=2)
  except RuntimeError as e:
    raise ValueError(f"model.vocab_size={vocab_size}: SentencePiece could not train a BPE "
                     f"tokenizer of that size on the training split ({e}); change "
                     "model.vocab_size as it says, or give data.tokenizer.") from e
  return model.getvalue()


def load_or_train_tokenizer(data_cfg, vocab_size: int, workdir: str, train_docs: Sequence[str],
                            source: Tokenizer | None = None) -> Tokenizer:
  """`data.tokenizer` if given, else `WORKDIR/tokenizer.model` if present, else `source` (the
  tokenizer of train.init_from), else one trained on `train_docs`; the last two are `new`.

  A workdir's tokenizer is never retrained: a resumed run must see the same ids.
  """
  given = getattr(data_cfg, "tokenizer", "") or ""
  path = os.path.join(workdir, TOKENIZER_FILENAME)
  if given:
    given = os.path.expanduser(given)
    if not os.path.isfile(given):
      raise FileNotFoundError(f"data.tokenizer: {given!r} does not exist; give a "
                              "SentencePiece .model file, or '' to train one.")
    try:
      tok, origin = Tokenizer(given), f"data.tokenizer={given!r}"
    except ValueError as e:
      raise ValueError(f"data.tokenizer: {str(e).removesuffix('.')}, or '' to train one.") from None
  elif os.path.isfile(path):
    try:
      tok, origin = Tokenizer(path), path
    except ValueError:
      raise ValueError(f"{path} is damaged (not a SentencePiece model), and every checkpoint of this workdir "
                       "needs the token ids it defines: copy it back from an export of this run or a backup; it "
                       "cannot be retrained to the same ids.") from None
  elif source is not None:
    tok, origin = Tokenizer(path, source.proto), f"train.init_from's {source.path}"
  else:
    # Trained once, by process 0, and sent to the others: every host must see the same ids.
    tok = Tokenizer(path, distributed.broadcast_bytes(train_tokenizer(train_docs, vocab_size) if distributed.is_primary()
                                                      else b""))
    origin = "the tokenizer trained on data.source (whose text holds no more BPE merges)"
  check_vocab(tok, vocab_size, origin, fixed=bool(given))
  return tok


def check_vocab(tok: Tokenizer, vocab_size: int, origin: str, fixed: bool):
  """model.vocab_size against the tokenizer's pieces; `fixed`: the tokenizer cannot be retrained."""
  if tok.vocab_size > vocab_size:
    raise ValueError(
        f"{origin} has {tok.vocab_size} pieces but model.vocab_size={vocab_size}; set "
        f"model.vocab_size >= {tok.vocab_size}" +
        ("." if fixed else ", or use a fresh workdir to train a new tokenizer."))
  # A workdir's own tokenizer is taken as it is: its run's model exists already (eval, resume).
  if (fixed or tok.new) and vocab_size > max_vocab_size(tok.vocab_size):
    raise ValueError(
        f"model.vocab_size={vocab_size} is far above the {tok.vocab_size} pieces of {origin}: embedding rows "
        f"past them never see a token. Set model.vocab_size={-(-tok.vocab_size // 128) * 128}; at most "
        f"{max_vocab_size(tok.vocab_size)} is allowed (the pieces rounded up to a multiple of 128, or 10% more, "
        "whichever is larger).")


def store_tokenizer(proto: bytes, store: str, data_cfg, vocab_size: int, workdir: str,
                    source: Tokenizer | None = None) -> Tokenizer:
  """The tokenizer a token store was made with, for a run in `workdir`: data.tokenizer, the workdir's
  own and train.init_from's must be that one (the store's ids are fixed); new to a fresh workdir."""
  path = os.path.join(workdir, TOKENIZER_FILENAME)
  given = os.path.expanduser(getattr(data_cfg, "tokenizer", "") or "")
  others = [(given, f"data.tokenizer={given!r}", "drop data.tokenizer (the store brings its own)"),
            (path, f"this workdir's {path}", "train in a new --workdir")]
  for other, what, fix in others:
    if other and os.path.isfile(other) and _read(other) != proto:
      raise ValueError(f"data.source: the store {store} was made with another tokenizer than {what}; {fix}, or "
                       f"prepare the store again with --config.data.tokenizer={other}.")
  if given and not os.path.isfile(given):
    raise FileNotFoundError(f"data.tokenizer: {given!r} does not exist; give '' to use the store's tokenizer.")
  if source is not None and source.proto != proto:
    raise ValueError(f"data.source: the store {store} was made with another tokenizer than train.init_from's "
                     f"{source.path}; prepare the store again with --config.data.tokenizer={source.path}.")
  tok = Tokenizer(path) if os.path.isfile(path) else Tokenizer(path, proto)
  check_vocab(tok, vocab_size, f"the tokenizer of the store {store}", fixed=True)
  return tok


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def max_vocab_size(pieces: int) -> int:
  """The largest model.vocab_size for a tokenizer of `pieces` pieces: padding, not unused rows."""
  return max(-(-pieces // 128) * 128, pieces + pieces // 10)
