"""Byte-level BPE: trained on the training text, lossless on any text.

Text is mapped to bytes (the 256 byte symbols are always in the vocabulary, so nothing is ever
unknown), pre-split GPT-2 style (words, numbers, punctuation, whitespace runs), then merged by the
learned BPE merges. Decoding maps the tokens back to bytes, so decode(encode(text)) == text.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from adapipe_cli.data.source import DataError

N_BYTES = 256
CHUNK_CHARS = 1 << 20  # texts are handled in ~1 MB pieces: bounded memory, parallel encoding


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE with at most vocab_size tokens (fewer when the text has fewer merges)."""
    if vocab_size < N_BYTES:
        raise DataError(
            f"data.vocab_size={vocab_size}: a byte-level BPE needs at least {N_BYTES} tokens"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(chunks(text), trainer=trainer)
    return tokenizer


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of text as one array: uint16 when the vocabulary fits, else uint32.

    The text is encoded in pieces cut at line ends; a piece boundary only ends a pre-token early,
    so the ids still decode to exactly the text."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    # a few pieces per call: parallel, yet the per-token Encoding objects never pile up
    ids = [
        np.asarray(e.ids, dtype=dtype)
        for group in groups(chunks(text), 16)
        for e in encode_batch(group)
    ]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)


def decode(tokenizer: Tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in np.asarray(ids).ravel()])


def chunks(text: str, size: int = CHUNK_CHARS):
    """Consecutive pieces of about ``size`` characters that end at a newline where there is one;
    "".join(chunks(text)) == text."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline >= start else end
        yield text[start:end]
        start = end


def groups(items, n: int):
    """Consecutive lists of n items (the last one shorter)."""
    group = []
    for item in items:
        group.append(item)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group
