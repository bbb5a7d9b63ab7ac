"""A tokenized text corpus as a DataSource: shared by text, tinyshakespeare and wikitext.

Raw text (text.py) -> byte-level BPE trained on the train split (bpe.py) -> token arrays, cached
on disk (cache.py). Train batches are random windows of the train tokens; validation is the start
of the validation tokens cut into consecutive windows.
"""

from __future__ import annotations

import numpy as np
import torch

from adapipe_cli.data import cache
from adapipe_cli.data.bpe import decode, encode, train_bpe
from adapipe_cli.data.source import (
    Batch,
    DataError,
    DataSource,
    batched,
    eval_windows,
    n_eval_windows,
    split_xy,
    train_generator,
)
from adapipe_cli.data.text import RawText, load_raw_text


class TextSource(DataSource):
    def __init__(
        self, name: str, entry: cache.Entry, origin: str, seq_len: int, seed: int, eval_tokens: int
    ):
        self.name, self.origin, self.seq_len, self.seed = name, origin, seq_len, seed
        self.tokenizer = entry.tokenizer
        self.vocab_size = entry.tokenizer.get_vocab_size()
        self.train_tokens, self.valid_tokens, self.cache_path = entry.train, entry.valid, entry.path
        self.min_ppl = None  # unknown for natural text

        if len(self.train_tokens) < seq_len + 1:
            raise too_short(name, "train", len(self.train_tokens), seq_len)
        n_val = n_eval_windows(len(self.valid_tokens), seq_len, eval_tokens)
        if n_val < 1:
            raise too_short(name, "validation", len(self.valid_tokens), seq_len)
        self._val_windows = eval_windows(self.valid_tokens, seq_len, n_val)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.origin}; byte-level BPE V={self.vocab_size}, "
            f"{len(self.train_tokens):,} train / {len(self.valid_tokens):,} valid tokens, "
            f"{len(self._val_windows) * self.seq_len:,} evaluated; cache {self.cache_path}"
        )

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Windows of seq_len+1 tokens at offsets uniform in [0, n_train - seq_len - 1]."""
        n_starts = len(self.train_tokens) - self.seq_len
        offsets = torch.randint(
            0, n_starts, (batch_size,), generator=train_generator(self.seed, step)
        )
        index = offsets.numpy()[:, None] + np.arange(self.seq_len + 1)
        return split_xy(self.train_tokens[index])

    def val_batches(self, batch_size: int) -> list[Batch]:
        return batched(self._val_windows, batch_size)

    def encode(self, text: str) -> np.ndarray:
        return encode(self.tokenizer, text)

    def decode(self, ids) -> str:
        return decode(self.tokenizer, ids)


def too_short(name: str, split: str, n_tokens: int, seq_len: int) -> DataError:
    return DataError(
        f"data={name}: the {split} text is {n_tokens:,} tokens, less than one sequence of "
        f"seq_len+1 = {seq_len + 1} tokens; use more text or a smaller model.block_size"
    )


def build_text_source(cfg, seq_len: int, seed: int) -> TextSource:
    raw = load_raw_text(cfg)
    entry = tokenized(raw, cfg.vocab_size, cfg.cache_dir)
    return TextSource(cfg.name, entry, raw.origin, seq_len, seed, cfg.eval_tokens)


def tokenized(raw: RawText, vocab_size: int, cache_dir: str | None) -> cache.Entry:
    """The cached tokenizer and token arrays for this text and vocabulary size, built on a miss."""
    key = cache.entry_key(raw.train, raw.valid, vocab_size)
    path = cache.entry_path(cache.cache_root(cache_dir), key, vocab_size)
    entry = cache.load(path)
    if entry is not None:
        return entry
    tokenizer = train_bpe(raw.train, vocab_size)
    train, valid = encode(tokenizer, raw.train), encode(tokenizer, raw.valid)
    meta = {
        "format": cache.FORMAT,
        "key": key,
        "origin": raw.origin,
        "requested_vocab_size": vocab_size,
        "vocab_size": tokenizer.get_vocab_size(),
        "train_chars": len(raw.train),
        "valid_chars": len(raw.valid),
        "train_tokens": len(train),
        "valid_tokens": len(valid),
    }
    return cache.store(path, tokenizer, train, valid, meta)
