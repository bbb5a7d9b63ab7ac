"""A sparse random Markov source: infinite, deterministic, and with a known entropy rate.

The state is the last ``order`` tokens, s = t[-order] * V^(order-1) + ... + t[-1], one of
V^order states. Each state has ``branching`` distinct successor tokens with probabilities drawn
from a symmetric Dirichlet(concentration). Emitting token a from state s moves to
s' = (s * V + a) mod V^order. The structure depends on ``source_seed`` only, so runs with different
training seeds learn the same distribution from different samples.

Because the distribution is known, so is the best a model can do: the entropy rate
H = sum_s pi(s) H(P(.|s)) nats per token, and min perplexity = exp(H).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from adapipe_cli.data.source import (
    VALID_STREAM,
    Batch,
    DataError,
    DataSource,
    batched,
    eval_windows,
    generator,
    n_eval_windows,
    split_xy,
    train_generator,
)

# Bound on states * branching: four [S, b] tables of 8-byte numbers, 2 GiB at the limit.
MAX_TRANSITIONS = 2**26


class MarkovSource(DataSource):
    """Synthetic order-k Markov source; ``sample`` and ``log_prob`` expose the true process."""

    def __init__(
        self,
        vocab_size: int = 256,
        order: int = 2,
        branching: int = 4,
        concentration: float = 0.5,
        source_seed: int = 1234,
        seq_len: int = 64,
        seed: int = 0,
        eval_tokens: int = 8192,
    ):
        check_params(vocab_size, order, branching, concentration)
        self.name = "synthetic"
        self.vocab_size, self.order, self.branching = vocab_size, order, branching
        self.concentration, self.source_seed = concentration, source_seed
        self.seq_len, self.seed = seq_len, seed
        self.n_states = vocab_size**order

        rng = np.random.default_rng(source_seed)
        self.successors = distinct_choices(rng, self.n_states, vocab_size, branching)  # [S, b]
        self.probs = rng.dirichlet(np.full(branching, concentration), size=self.n_states)  # [S, b]
        self.cdf = np.cumsum(self.probs, axis=1)
        self.cdf[:, -1] = 1.0  # so that a uniform u < 1 always falls inside the table

        self.pi = stationary_distribution(self.next_states(), self.probs)
        self.pi_cdf = np.cumsum(self.pi)
        self.entropy_rate = float(self.pi @ row_entropy(self.probs))
        self.min_ppl = math.exp(self.entropy_rate)

        n_val = n_eval_windows(10**18, seq_len, eval_tokens)  # an endless stream always fits
        stream = self.sample(n_val * seq_len + 1, generator(VALID_STREAM, source_seed)).numpy()
        self._val_windows = eval_windows(stream, seq_len, n_val)

    # -- the true process ---------------------------------------------------------------------

    def next_states(self) -> np.ndarray:
        """[S, b] table of the state reached from s by emitting successors[s, j]."""
        s = np.arange(self.n_states, dtype=np.int64)[:, None]
        return (s * self.vocab_size + self.successors) % self.n_states

    def state_tokens(self, states: np.ndarray) -> np.ndarray:
        """The ``order`` tokens a state stands for, oldest first: [n] -> [n, order]."""
        powers = self.vocab_size ** np.arange(self.order - 1, -1, -1)
        return (states[:, None] // powers) % self.vocab_size

    def sample_rows(self, rows: int, length: int, gen: torch.Generator) -> np.ndarray:
        """``rows`` independent stationary sequences of ``length`` tokens, [rows, length] int64.

        Each row starts in a state drawn from pi (its tokens are the first ``order`` tokens), then
        walks the chain by inverse-CDF sampling: token j is the first with u < cdf[s, j]."""
        u0 = torch.rand(rows, generator=gen, dtype=torch.float64).numpy()
        u = torch.rand(
            rows, max(length - self.order, 0), generator=gen, dtype=torch.float64
        ).numpy()
        states = np.searchsorted(self.pi_cdf, u0 * self.pi_cdf[-1], side="right")
        states = np.minimum(states, self.n_states - 1)
        out = np.empty((rows, length), dtype=np.int64)
        out[:, : self.order] = self.state_tokens(states)[:, :length]
        for t in range(u.shape[1]):
            j = (u[:, t, None] >= self.cdf[states]).sum(axis=1)
            tokens = self.successors[states, j]
            out[:, self.order + t] = tokens
            states = (states * self.vocab_size + tokens) % self.n_states
        return out

    def sample(self, n_tokens: int, gen: torch.Generator) -> torch.Tensor:
        """One stationary sequence of n_tokens tokens, LongTensor [n_tokens]."""
        return torch.from_numpy(self.sample_rows(1, n_tokens, gen)[0])

    def log_prob(self, tokens: torch.Tensor | np.ndarray) -> float:
        """Mean log p(t_i | t_{i-order..i-1}) in nats over a sequence [T] or rows [B, T], skipping
        the first ``order`` tokens of each row (they have no full context). Its negative is the
        cross-entropy of the sample under the true source; for a long sample it tends to H."""
        t = np.asarray(tokens, dtype=np.int64)
        t = t.reshape(-1, t.shape[-1])
        k, T = self.order, t.shape[1]
        if T <= k:
            raise ValueError(f"log_prob needs more than order={k} tokens per row, got {T}")
        states = sum(t[:, i : T - k + i] * self.vocab_size ** (k - 1 - i) for i in range(k))
        hit = self.successors[states] == t[:, k:, None]  # [B, T-k, b]
        p = (self.probs[states] * hit).sum(axis=-1)
        with np.errstate(divide="ignore"):  # a transition the source never makes is log 0
            return float(np.log(p).mean())

    # -- DataSource ----------------------------------------------------------------------------

    def describe(self) -> str:
        return (
            f"synthetic order-{self.order} Markov, V={self.vocab_size}, "
            f"branching {self.branching}, Dirichlet({self.concentration:g}), "
            f"source_seed {self.source_seed}, "
            f"entropy rate {self.entropy_rate:.4f} nats, min ppl {self.min_ppl:.3f}"
        )

    def train_batch(self, step: int, batch_size: int) -> Batch:
        rows = self.sample_rows(batch_size, self.seq_len + 1, train_generator(self.seed, step))
        return split_xy(rows)

    def val_batches(self, batch_size: int) -> list[Batch]:
        return batched(self._val_windows, batch_size)


def check_params(vocab_size: int, order: int, branching: int, concentration: float) -> None:
    if vocab_size < 2:
        raise DataError(f"data.vocab_size={vocab_size}: the synthetic source needs at least 2")
    if order not in (1, 2):
        raise DataError(f"data.order={order}: the synthetic source supports order 1 or 2")
    if not 1 <= branching <= vocab_size:
        raise DataError(
            f"data.branching={branching}: must be between 1 and data.vocab_size={vocab_size}"
        )
    if not concentration > 0:
        raise DataError(
            f"data.concentration={concentration}: the Dirichlet concentration must be > 0"
        )
    if vocab_size**order * branching > MAX_TRANSITIONS:
        raise DataError(
            f"data.vocab_size={vocab_size} with data.order={order} and data.branching={branching} "
            f"is too large a transition table; lower one of them"
        )


def distinct_choices(rng: np.random.Generator, rows: int, n: int, k: int) -> np.ndarray:
    """For each row, k distinct integers from [0, n), uniformly: [rows, k] int64.

    When collisions are rare (k(k-1) < n, expected duplicate pairs < 1/2) redraw only the rows
    that have a duplicate; otherwise take the k smallest of n random keys per row, a block of rows
    at a time to bound the memory."""
    if k * (k - 1) >= n:
        block = max(1, 2**22 // n)
        keys = (rng.random((min(block, rows - i), n)) for i in range(0, rows, block))
        smallest = [np.argpartition(z, k - 1, axis=1)[:, :k] for z in keys]
        return np.concatenate(smallest).astype(np.int64)
    out = rng.integers(0, n, size=(rows, k))
    while True:
        s = np.sort(out, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if bad.size == 0:
            return out
        out[bad] = rng.integers(0, n, size=(bad.size, k))


def row_entropy(probs: np.ndarray) -> np.ndarray:
    """H(P(.|s)) = -sum_j p_j log p_j in nats, per row, with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probs > 0, probs * np.log(probs), 0.0)
    return -terms.sum(axis=1)


def stationary_distribution(
    next_states: np.ndarray, probs: np.ndarray, tol: float = 1e-13, max_iter: int = 5000
) -> np.ndarray:
    """pi = pi P by power iteration from the uniform distribution on the sparse chain.

    One step is a scatter-add: pi'(s') = sum over (s, j) with next_states[s, j] = s' of
    pi(s) probs[s, j]. The lazy chain (I + P) / 2 has the same pi but is aperiodic, so the
    iteration converges even where P alone would cycle. Stops when the L1 change < tol."""
    n = len(next_states)
    pi = np.full(n, 1.0 / n)
    flat_next = next_states.ravel()
    for _ in range(max_iter):
        moved = np.bincount(flat_next, weights=(pi[:, None] * probs).ravel(), minlength=n)
        new = 0.5 * (pi + moved)
        new /= new.sum()
        done = np.abs(new - pi).sum() < tol
        pi = new
        if done:
            break
    return pi
