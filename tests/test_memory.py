"""Memory bounds of each schedule, counted twice: by the simulator (no computation) and by the
local runtime training a tiny GPT (what its stage executors actually hold).

Per stage ``s`` of ``p`` with ``m`` microbatches per step and ``w = p - s - 1`` warm-up forwards:

- 1F1B (sync): at most ``p - s`` microbatches in flight, exactly ``min(p - s, m)`` at the peak;
  one weight version.
- GPipe (sync): all ``m`` microbatches in flight; one weight version.
- PipeDream (async, ``weights=stash``): ``p - s`` microbatches in flight in the steady state, and
  ``ceil((p - s - 1) / m) + 1`` weight versions (derivation in
  :func:`test_pipedream_stash_holds_p_minus_s_microbatches_and_derived_versions`).
- 2BW: at most 2 weight versions at every stage.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from adapipe_cli.config.schema import OptimConfig, ScheduleConfig
from adapipe_cli.model import GPTConfig, build_stages, partition
from adapipe_cli.runtime.local import LocalRuntime
from adapipe_cli.schedules import ASYNC, SYNC, Plan, ScheduleSpec
from adapipe_cli.schedules.mitigations import UpdatePolicy
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from adapipe_cli.simulator.simulate import min_steady_steps, simulate
from adapipe_cli.optim import StageOptimizer
from helpers import one_block_per_stage

V, T = 32, 8
GPT = GPTConfig(vocab_size=V, block_size=T, n_layer=6, d_model=16, n_head=2)


def run_both(p: int, m: int, phase: str, sync: str = "1f1b", weights: str = "stash", steps: int | None = None):
    """(runtime memory, simulator result) of ``steps`` steps of one phase. The runtime trains for
    real: one sequence per microbatch."""
    steps = steps or (3 if phase == SYNC else min_steady_steps(p, m) + 2)
    spec = ScheduleSpec(p, m, sync, weights)
    spec.check()
    ocfg, scfg = OmegaConf.structured(OptimConfig), OmegaConf.structured(ScheduleConfig)
    gpt = one_block_per_stage(p, GPT)
    stages = build_stages(gpt, partition(gpt, p), 0)
    opts = [StageOptimizer(list(st.named_parameters()), ocfg) for st in stages]
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, V, (m, T + 1), generator=g) for _ in range(steps)]

    def batch(t: int, i: int):
        return data[t][i:i + 1, :-1], data[t][i:i + 1, 1:]

    plan = Plan(steps, [phase] * steps)
    rt = LocalRuntime(stages, opts, spec, plan, UpdatePolicy(ocfg, scfg, plan, steps), batch,
                      CostProfile.uniform(p), LinkModel(), 1.0, 0, False)
    for t in range(steps):
        rt.run_step(t)
    mem = rt.memory()
    assert [d["peak_activations"] for d in mem] == [ex.peak_inflight for ex in rt.executors]
    sim = simulate(spec, Plan(steps, [phase] * steps), CostProfile.uniform(p), record=False)
    return mem, sim


def activations(mem) -> list[int]:
    return [d["peak_activations"] for d in mem]


def versions(mem) -> list[int]:
    return [d["peak_weight_versions"] for d in mem]


# (4, 6) and (5, 3) are slow (make test-all): test_ledger's 1f1b runs the same cases, with the
# same activations (and the executors' tensors counted after every action)
@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), pytest.param(4, 6, marks=pytest.mark.slow),
                                 pytest.param(5, 3, marks=pytest.mark.slow), (3, 1)])
def test_1f1b_holds_at_most_p_minus_s_microbatches(p, m):
    mem, sim = run_both(p, m, SYNC, "1f1b")
    expected = [min(p - s, m) for s in range(p)]
    assert activations(mem) == sim.peak_activations == expected
    assert versions(mem) == sim.weight_versions == [1] * p


# (3, 6) is slow (make test-all): test_ledger's gpipe runs it too (m activations at every stage)
@pytest.mark.parametrize("p,m", [(4, 1), (4, 3), pytest.param(3, 6, marks=pytest.mark.slow)])
def test_gpipe_holds_every_microbatch(p, m):
    mem, sim = run_both(p, m, SYNC, "gpipe")
    assert activations(mem) == sim.peak_activations == [m] * p
    assert versions(mem) == sim.weight_versions == [1] * p


def stash_versions(p: int, m: int, s: int) -> int:
    return math.ceil((p - s - 1) / m) + 1


# slow (make test-all): (6, 4), a ceiling with a remainder at m > 1 as (4, 2); (4, 5), m > p - 1
# (two versions at every stage but the last) as test_ledger's stash (4, 3) and (3, 2), which count
# the same versions and activations
@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), (5, 2), pytest.param(6, 4, marks=pytest.mark.slow),
                                 pytest.param(4, 5, marks=pytest.mark.slow), (2, 1)])
def test_pipedream_stash_holds_p_minus_s_microbatches_and_derived_versions(p, m):
    """In-flight microbatches: stage s runs w = p - s - 1 warm-up forwards and then alternates one
    forward and one backward, so it holds w + 1 = p - s.

    Weight versions: V(s) = ceil((p - s - 1) / m) + 1. In the steady state stage s forwards
    microbatch j right after the backward of j - w - 1, so with the stage's latest weights, version
    floor((j - w) / m) (the updates done so far), and stashes it for the backward. The p - s
    microbatches in flight, j - w .. j, thus use the versions floor(i / m) for w + 1 consecutive i:
    at most ceil(w / m) + 1 distinct values, reached once the stream has run through every
    alignment with the step boundaries. The live version is the newest of them (right after an
    update the new live version replaces the oldest stash, whose microbatch has just left), so the
    count stays ceil(w / m) + 1: p - s versions for m = 1, 2 for m >= p - 1, 1 at the last stage."""
    mem, sim = run_both(p, m, ASYNC, weights="stash")
    assert activations(mem) == sim.peak_activations == [p - s for s in range(p)]
    expected = [stash_versions(p, m, s) for s in range(p)]
    assert versions(mem) == sim.weight_versions == expected


# (4, 8) is slow (make test-all): m > p - 1 is test_ledger's 2bw (4, 6), two versions at every stage
@pytest.mark.parametrize("p,m", [(4, 3), pytest.param(4, 8, marks=pytest.mark.slow), (2, 1), (3, 2)])
def test_2bw_holds_at_most_two_versions(p, m):
    mem, sim = run_both(p, m, ASYNC, weights="2bw")
    assert activations(mem) == sim.peak_activations == [p - s for s in range(p)]
    assert versions(mem) == sim.weight_versions
    assert max(versions(mem)) <= 2
    assert versions(mem)[0] == 2  # it does double-buffer


@pytest.mark.parametrize("weights", ["latest", "vertical"])
def test_other_async_rules_agree_with_the_simulator(weights):
    mem, sim = run_both(4, 2, ASYNC, weights=weights)
    assert activations(mem) == sim.peak_activations
    assert versions(mem) == sim.weight_versions


def test_a_switch_keeps_the_bounds():
    """async -> sync -> async: the bounds of each phase still hold across the switches."""
    p, m = 4, 2
    phases = [ASYNC] * 4 + [SYNC] * 2 + [ASYNC] * 4
    spec = ScheduleSpec(p, m)
    sim = simulate(spec, Plan(len(phases), phases), CostProfile.uniform(p), record=False)
    assert sim.peak_activations == [p - s for s in range(p)]
    assert sim.weight_versions == [stash_versions(p, m, s) for s in range(p)]
