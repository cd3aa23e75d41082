"""Data: corpus -> document split -> SentencePiece tokenizer -> packed, checkpointable batches.

  check_text_source(cfg.data, process_count)           # text a host should not tokenise: refused
  data = build_data(cfg, workdir)                      # Data: tokenizer, token streams (in memory,
                                                       # or a token store's, read on demand)
  save_tokenizer(data, workdir)                        # a trained tokenizer, once checks pass
  it = make_train_iterator(data, seq_len, batch_size, seed, rows)  # rows: this host's, None = all
  batch = next(it)            # {"inputs", "targets", "segment_ids", "positions"} int32
  val = make_val_batches(data, seq_len, batch_size, max_batches)

The data position is the number of batches read (`start`): checkpoints hold no iterator state.
A large corpus is tokenised once by `python -m latent_jax.prepare` into a token store (store.py).
"""
from latent_jax.data import store
from latent_jax.data.corpus import load_documents, split_documents
from latent_jax.data.pipeline import (FEATURES, Data, build_data, check_text_source, make_train_iterator,
                                      make_val_batches, pack_rows, save_tokenizer, token_stream,
                                      unigram_entropy)
from latent_jax.data.tokenizer import TOKENIZER_FILES, Tokenizer, find_tokenizer, load_or_train_tokenizer

__all__ = [
    "FEATURES", "Data", "TOKENIZER_FILES", "Tokenizer", "build_data", "check_text_source", "find_tokenizer", "load_documents",
    "load_or_train_tokenizer", "make_train_iterator", "make_val_batches", "pack_rows",
    "save_tokenizer", "split_documents", "store", "token_stream", "unigram_entropy",
]
