"""Cutting the model into consecutive pipeline stages."""

from __future__ import annotations

from functools import lru_cache

from .gpt import GPTConfig


def layer_costs(cfg: GPTConfig, by: str) -> tuple[float, list[float], float]:
    """(embedding, [block]*n_layer, head) cost under ``by``:

    - ``flops``: forward FLOPs per token, 2*(4 d^2 + 2 d ff) + 4 T d per block (projections and
      attention), 2 d V for the head, 0 for the embedding (a lookup);
    - ``params``: parameter counts;
    - ``uniform``: 1 per block, 0 for embedding and head.
    """
    d, ff, v, t = cfg.d_model, cfg.ff, cfg.vocab_size, cfg.block_size
    if by == "flops":
        return 0.0, [2.0 * (4 * d * d + 2 * d * ff) + 4.0 * t * d] * cfg.n_layer, 2.0 * d * v
    if by == "params":
        return float(v * d + t * d), [float(4 * d * d + 2 * d * ff)] * cfg.n_layer, float(d * v)
    if by == "uniform":
        return 0.0, [1.0] * cfg.n_layer, 0.0
    raise ValueError(f"unknown partition {by!r}: use flops, params or uniform")


def balanced_bounds(embed: float, blocks: list[float], head: float, stages: int) -> list[tuple[int, int]]:
    """Split ``blocks`` into ``stages`` non-empty consecutive ranges minimising the largest stage
    cost, where the first stage also pays ``embed`` and the last ``head`` (exact, by dynamic
    programming). Returns half-open block ranges."""
    n = len(blocks)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, s: int) -> float:
        return prefix[b] - prefix[a] + (embed if s == 0 else 0.0) + (head if s == stages - 1 else 0.0)

    @lru_cache(maxsize=None)
    def best(a: int, s: int) -> tuple[float, tuple[int, ...]]:
        # blocks [a, n) into stages s..stages-1; returns (max cost, cut points)
        if s == stages - 1:
            return cost(a, n, s), ()
        out = (float("inf"), ())
        for b in range(a + 1, n - (stages - 1 - s) + 1):
            rest, cuts = best(b, s + 1)
            val = max(cost(a, b, s), rest)
            if val < out[0] - 1e-12:
                out = (val, (b,) + cuts)
        return out

    cuts = (0,) + best(0, 0)[1] + (n,)
    return [(cuts[i], cuts[i + 1]) for i in range(stages)]


def partition(cfg: GPTConfig, stages: int, by: str = "flops") -> list[tuple[int, int]]:
    """Block ranges of each stage for a ``stages``-deep pipeline."""
    embed, blocks, head = layer_costs(cfg, by)
    return balanced_bounds(embed, blocks, head, stages)
