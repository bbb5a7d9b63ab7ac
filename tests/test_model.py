"""The model: stages compose to the full model exactly; partitions are balanced and valid."""

import pytest
import torch

from adapipe_cli.model import GPTConfig, build_full_model, build_stages, partition
from adapipe_cli.model.partition import balanced_bounds

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=6, d_model=32, n_head=2)


@pytest.mark.parametrize("stages", [1, 2, 3, 6])
@pytest.mark.parametrize("tied", [False, True])
def test_stages_compose_to_the_full_model(stages, tied):
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    full = build_full_model(cfg, seed=3)
    parts = build_stages(cfg, partition(cfg, stages), seed=3)
    x = torch.randint(0, 64, (3, 16))
    h = x
    for st in parts:
        h = st(h)
    assert torch.equal(full(x), h)
    assert sum(p.numel() for st in parts for p in st.parameters()) == (
        sum(p.numel() for p in full.parameters()) + (64 * 32 if tied and stages > 1 else 0))


def test_initialisation_does_not_depend_on_the_cut():
    a = build_stages(CFG, [(0, 2), (2, 6)], seed=1)
    b = build_stages(CFG, [(0, 4), (4, 6)], seed=1)
    wa = torch.cat([p.flatten() for st in a for p in st.parameters()])
    wb = torch.cat([p.flatten() for st in b for p in st.parameters()])
    assert torch.equal(wa, wb)
    c = build_stages(CFG, [(0, 2), (2, 6)], seed=2)
    assert not torch.equal(wa, torch.cat([p.flatten() for st in c for p in st.parameters()]))


def test_tied_head_starts_as_a_copy_of_the_embedding():
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": True})
    first, last = build_stages(cfg, [(0, 3), (3, 6)], seed=0)
    assert torch.equal(first.embed.wte.weight, last.head.lm_head.weight)
    (one,) = build_stages(cfg, [(0, 6)], seed=0)
    assert one.embed.wte.weight is one.head.lm_head.weight


def test_balanced_partition_minimises_the_largest_stage():
    import itertools

    blocks, head = [1.0, 3.0, 1.0, 1.0, 2.0, 1.0], 2.0

    def worst(cuts):
        edges = (0, *cuts, 6)
        costs = [sum(blocks[a:b]) for a, b in zip(edges, edges[1:])]
        costs[-1] += head
        return max(costs)

    best = min(worst(c) for c in itertools.combinations(range(1, 6), 2))  # brute force over all cuts
    bounds = balanced_bounds(0.0, blocks, head, 3)
    assert worst([b for _, b in bounds[:-1]]) == best == 4.0


@pytest.mark.parametrize("by", ["flops", "params", "uniform"])
def test_partition_covers_every_block_once(by):
    for p in range(1, CFG.n_layer + 1):
        bounds = partition(CFG, p, by)
        assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == CFG.n_layer
        assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(p - 1))
    with pytest.raises(ValueError):
        partition(CFG, CFG.n_layer + 1, by)
