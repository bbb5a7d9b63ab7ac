"""What every data source offers the trainer: seeded train batches and a fixed validation set.

A train batch is a function of (seed, step) alone, so pipeline stages in different processes, and a
run resumed from a checkpoint at step t, draw the same tokens without sharing any RNG state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]

# Stream tags keep the train and validation generators apart even when seed == source_seed.
TRAIN_STREAM = 0
VALID_STREAM = 1


class DataError(Exception):
    """A user mistake in the data configuration; the message is one line saying what to change."""


class DataSource(ABC):
    """A token source: ``vocab_size`` tokens, sequences of ``seq_len`` inputs and targets."""

    name: str
    vocab_size: int
    seq_len: int
    # lowest reachable perplexity when the true distribution is known, else None
    min_ppl: float | None = None

    @abstractmethod
    def describe(self) -> str:
        """One line for the logs."""

    @abstractmethod
    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Inputs x and targets y, both LongTensor [batch_size, seq_len], with y[:, i] = x[:, i+1]
        for i < seq_len-1 (y is x shifted by one). A function of (seed, step) only."""

    @abstractmethod
    def val_batches(self, batch_size: int) -> list[Batch]:
        """The fixed validation set (same on every call and for every seed), in batches of at most
        ``batch_size`` sequences."""


def generator(*words: int) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of integers, e.g. (TRAIN_STREAM, seed, step).

    numpy's SeedSequence hashes the tuple, so nearby tuples (step 7 and 8, seed 0 and 1) give
    unrelated streams; Python's hash() would not do, it is salted per process."""
    entropy = [w % 2**64 for w in words]  # SeedSequence wants non-negative words
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def train_generator(seed: int, step: int) -> torch.Generator:
    return generator(TRAIN_STREAM, seed, step)


def split_xy(windows: np.ndarray | torch.Tensor) -> Batch:
    """[B, seq_len+1] token windows -> (x, y) = (windows[:, :-1], windows[:, 1:]) as LongTensors."""
    w = torch.as_tensor(np.asarray(windows, dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def n_eval_windows(n_tokens: int, seq_len: int, eval_tokens: int) -> int:
    """Number of validation sequences: about eval_tokens targets, at least one, at most what
    n_tokens holds (windows of seq_len+1 tokens at stride seq_len need n*seq_len + 1 tokens).
    Returns 0 when not even one sequence fits."""
    fits = max(0, (n_tokens - 1) // seq_len)
    return min(max(1, eval_tokens // seq_len), fits)


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """The first n windows of seq_len+1 tokens, at stride seq_len: window i is
    stream[i*seq_len : (i+1)*seq_len + 1], so every token after the first is a target exactly once
    (windows share their boundary token as one's last target and the next one's first input)."""
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return np.asarray(stream[index], dtype=np.int64)


def batched(windows: np.ndarray, batch_size: int) -> list[Batch]:
    """Windows [n, seq_len+1] -> list of (x, y) batches of at most batch_size rows, in order."""
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size}: the validation batch size must be at least 1")
    return [split_xy(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)]
