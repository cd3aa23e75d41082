"""Tokenizers: a SentencePiece `.model` or a Hugging Face `tokenizer.json`, given, the workdir's, or
SentencePiece BPE trained here; one interface (encode, decode, EOS, vocab size, bytes per token).

A tokenizer trained (or adopted from train.init_from) for a workdir stays in memory until
`save()`, which the train loop calls once every check has passed: bad input writes nothing.

The trained tokenizer is lossless: identity normalisation, no dummy prefix, whitespace
kept as is and "\\n" a piece of its own, so `decode(encode(x)) == x` and the bytes of
the pieces (`token_bytes`) add up to the text's UTF-8 length; bits-per-byte is exact.
`model.vocab_size` is the size asked for: on a corpus too small to learn that many merges
the tokenizer comes out smaller. The model's vocabulary may exceed the tokenizer's by padding
only (`max_vocab_size`), as embedding rows past the tokenizer never see a token.

A workdir (an export, a token store) keeps the file it was trained with under its kind's name,
`tokenizer.model` or `tokenizer.json` (`TOKENIZER_FILES`), so eval, export and resume find it.
"""
from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import sentencepiece as spm
import tokenizers

from latent_jax import distributed, paths
from latent_jax.data.corpus import load_documents, split_documents

TOKENIZER_FILES = {"sentencepiece": "tokenizer.model", "huggingface": "tokenizer.json"}
# Special tokens that end (or begin, or pad) a document in Hugging Face tokenizers, by preference.
_HF_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")
_HF_PAD = ("<|pad|>", "<pad>", "[PAD]")
_MAX_SENTENCE_BYTES = 8192
_INPUT_SENTENCES = 300_000  # SentencePiece samples this many sentences; the KJV has ~90k
_SENTENCE_END = re.compile(r"(?<=[.!?;:])(?=\s)")


def tokenizer_kind(proto: bytes, path: str = "") -> str:
  """"huggingface" for a tokenizer.json (JSON text), else "sentencepiece" (a serialised protobuf)."""
  return "huggingface" if path.endswith(".json") or proto.lstrip()[:1] == b"{" else "sentencepiece"


def find_tokenizer(directory: str) -> str | None:
  """The path of the tokenizer file of `directory` (a workdir, an export, a token store), if any."""
  for name in TOKENIZER_FILES.values():
    if paths.path(path := os.path.join(directory, name)).is_file():
      return path
  return None


class Tokenizer:
  """A SentencePiece `.model` or a Hugging Face `tokenizer.json` (told apart by content), read from
  `path`, or given as `proto` (the file's bytes): then `new` until `save()` writes it to `path`."""

  def __init__(self, path: str, proto: bytes | None = None):
    self.path = os.fspath(path)
    self.new = proto is not None
    if proto is None:
      proto = paths.path(self.path).read_bytes()
    self.proto = proto
    self.kind = tokenizer_kind(proto, self.path)
    self.filename = TOKENIZER_FILES[self.kind]
    if self.kind == "huggingface":
      self.hf = _hf_tokenizer(proto, self.path)
      specials = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
      find = lambda names: next((specials[n] for n in names if n in specials), -1)
      self.eos_id: int = find(_HF_EOS)
      self.bos_id: int = find(_HF_BOS)
      pad_id = find(_HF_PAD)
      if self.eos_id < 0:
        raise ValueError(f"{self.path} has no EOS among its special tokens ({', '.join(sorted(specials)) or 'none'}); "
                         f"documents are separated by EOS: add one of {', '.join(_HF_EOS)} as a special token.")
      self.vocab_size: int = max(self.hf.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
      self.token_bytes = _hf_token_bytes(self.hf, json.loads(proto), self.vocab_size)
    else:
      self.sp = _processor(proto, self.path)
      self.vocab_size: int = self.sp.get_piece_size()
      self.eos_id: int = self.sp.eos_id()
      self.bos_id: int = self.sp.bos_id()  # -1 when the model has none
      pad_id = self.sp.pad_id()
      if self.eos_id < 0:
        raise ValueError(f"data.tokenizer: {self.path} has no EOS piece; documents are "
                         "separated by EOS, so train it with eos_id >= 0.")
      self.token_bytes = _token_bytes(self.sp)
    self.byte_pieces = _byte_pieces(self)
    # Padding is only ever an input under a target of -1; EOS serves when there is no pad token.
    self.pad_id: int = pad_id if pad_id >= 0 else self.eos_id

  def encode(self, text: str) -> list[int]:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if self.kind == "huggingface":  # no BOS/EOS added: documents are joined by EOS (token_stream)
      return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]
    return self.sp.encode(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    return self.hf.decode(ids, skip_special_tokens=False) if self.kind == "huggingface" else self.sp.decode(ids)

  def save(self):
    """Writes the file to `path` atomically: readers never see a half-written file."""
    paths.write_atomic(self.path, lambda f: f.write(self.proto))
    self.new = False

  def __repr__(self) -> str:
    return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _hf_tokenizer(proto: bytes, path: str) -> tokenizers.Tokenizer:
  """The Hugging Face tokenizer of a tokenizer.json; an error naming `path` when the bytes are not one."""
  try:
    return tokenizers.Tokenizer.from_str(proto.decode("utf-8"))
  except Exception as e:  # tokenizers raises plain Exceptions; UnicodeDecodeError for binary files
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({reason}); use the tokenizer.json of a run "
                     "or of a Hugging Face model.") from None


def _hf_token_bytes(hf: tokenizers.Tokenizer, spec: dict, vocab_size: int) -> np.ndarray:
  """UTF-8 bytes each token stands for: `[vocab_size]` int32, for bits-per-byte.

  Byte-level BPE (GPT-2, OLMo) writes every byte as one character of a 256-character alphabet,
  so a piece's length is its byte count. Special tokens count 0, other added tokens their text;
  in other models a token's bytes are those of it decoded alone.
  """
  decoder = spec.get("decoder") or {}
  byte_level = any(d.get("type") == "ByteLevel" for d in [decoder, *decoder.get("decoders", [])])
  added = hf.get_added_tokens_decoder()
  out = np.zeros(vocab_size, np.int32)
  for piece, i in hf.get_vocab(with_added_tokens=True).items():
    if i in added:
      out[i] = 0 if added[i].special else len(added[i].content.encode())
    else:
      out[i] = len(piece) if byte_level else len(hf.decode([i]).encode())
  return out


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


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_pieces(tok: Tokenizer) -> np.ndarray:
  """bool [vocab_size]: the byte-fallback pieces `<0x..>`, which spell text the tokenizer's training never
  saw one byte at a time (SentencePiece's, or a Hugging Face BPE's with byte_fallback; a byte-level BPE has none)."""
  if tok.kind == "sentencepiece":
    return np.array([tok.sp.is_byte(i) for i in range(tok.vocab_size)], bool)
  out = np.zeros(tok.vocab_size, bool)
  for piece, i in tok.hf.get_vocab(with_added_tokens=False).items():
    out[i] = bool(_BYTE_PIECE.fullmatch(piece))
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
                            source: Tokenizer | None = None, shared: bool = True) -> Tokenizer:
  """`data.tokenizer` if given, else the workdir's tokenizer file if present, else `source` (the
  tokenizer of train.init_from), else SentencePiece trained on `train_docs`: by process 0 and sent
  to every process when `shared`, else here (prepare, which runs on process 0 alone). One not
  yet in the workdir is `new` there: `save()` keeps a copy under its kind's file name.

  A workdir's tokenizer is never retrained: a resumed run must see the same ids.
  """
  given = getattr(data_cfg, "tokenizer", "") or ""
  found = find_tokenizer(workdir)
  if given:
    given = paths.expand(given)
    if not paths.path(given).is_file():
      raise FileNotFoundError(f"data.tokenizer: {given!r} does not exist; give a SentencePiece .model or a "
                              "Hugging Face tokenizer.json file, or '' to train one.")
    try:
      tok, origin = Tokenizer(given), f"data.tokenizer={given!r}"
    except ValueError as e:
      raise ValueError(f"data.tokenizer: {str(e).removesuffix('.')}, or '' to train one.") from None
    if found is None:  # the workdir keeps its own copy: eval, export and generate need no data.tokenizer
      tok.path, tok.new = os.path.join(workdir, tok.filename), True
  elif found:
    try:
      tok, origin = Tokenizer(found), found
    except ValueError:
      raise ValueError(f"{found} is damaged (not a tokenizer file), and every checkpoint of this workdir "
                       "needs the token ids it defines, but none holds a copy (saved before checkpoints held one): "
                       "copy it back from an export of this run or a backup; it cannot be retrained to the same "
                       "ids.") from None
  elif source is not None:
    tok, origin = Tokenizer(os.path.join(workdir, source.filename), source.proto), f"train.init_from's {source.path}"
  else:
    # Trained once, by process 0, and sent to the others: every host must see the same ids.
    if not shared or distributed.is_primary():
      proto = train_tokenizer(list(train_docs) + tokenizer_source_docs(data_cfg), vocab_size)
    else:
      proto = b""
    tok = Tokenizer(os.path.join(workdir, TOKENIZER_FILES["sentencepiece"]),
                    distributed.broadcast_bytes(proto) if shared else proto)
    origin = "the tokenizer trained on data.source (whose text holds no more BPE merges)"
  check_vocab(tok, vocab_size, origin, fixed=bool(given))
  return tok


def tokenizer_source_docs(data_cfg) -> list[str]:
  """The training splits of data.tokenizer_sources (comma-separated, each as data.source takes it: a named
  source, files, a folder, a glob), which the trained tokenizer learns from beside the run's own: so that
  it covers a domain the run does not train on (a later adaptation's). Their held-out documents stay out."""
  docs = []
  for part in (p.strip() for p in (getattr(data_cfg, "tokenizer_sources", "") or "").split(",")):
    if part:
      try:
        found = load_documents(part, getattr(data_cfg, "doc_separator", ""))
      except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"data.tokenizer_sources: {str(e).removeprefix('data.source: ')}") from None
      docs += split_documents(found, data_cfg.val_fraction)[0] if len(found) > 1 else found
  return docs


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
  own = find_tokenizer(workdir)
  given = paths.expand(getattr(data_cfg, "tokenizer", "") or "")
  others = [(given, f"data.tokenizer={given!r}", "drop data.tokenizer (the store brings its own)"),
            (own, f"this workdir's {own}", "train in a new --workdir")]
  for other, what, fix in others:
    if other and paths.path(other).is_file() and paths.path(other).read_bytes() != proto:
      raise ValueError(f"data.source: the store {store} was made with another tokenizer than {what}; {fix}, or "
                       f"prepare the store again with --config.data.tokenizer={other}.")
  if given and not paths.path(given).is_file():
    raise FileNotFoundError(f"data.tokenizer: {given!r} does not exist; give '' to use the store's tokenizer.")
  if source is not None and source.proto != proto:
    raise ValueError(f"data.source: the store {store} was made with another tokenizer than train.init_from's "
                     f"{source.path}; prepare the store again with --config.data.tokenizer={source.path}.")
  tok = Tokenizer(own) if own else Tokenizer(os.path.join(workdir, TOKENIZER_FILES[tokenizer_kind(proto)]), proto)
  check_vocab(tok, vocab_size, f"the tokenizer of the store {store}", fixed=True)
  return tok


def max_vocab_size(pieces: int) -> int:
  """The largest model.vocab_size for a tokenizer of `pieces` pieces: padding, not unused rows."""
  return max(-(-pieces // 128) * 128, pieces + pieces // 10)
