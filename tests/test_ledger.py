"""The buffer ledger: closed forms of what each schedule holds, from the simulator and from the
local runtime training for real, and the executor's tensors equal to the ledger's count after
every action.

Per stage ``s`` of ``p``, ``m`` microbatches per step, ``w = p - s - 1`` warm-up forwards, sizes
P (one parameter set), A (one microbatch's saved activations) and O (optimizer state), counted
at action boundaries (and, with predict or nesterov, during an async update, which keeps a copy of the
weights before it):

- GPipe: one parameter set and one gradient accumulator, m activations; the gradient exists only
  from the first backward, when one activation is gone: peak bytes P + O + max(mA, P + (m-1)A).
- 1F1B: k = min(p - s, m) activations. When a steady one-forward-one-backward pair follows the
  first backward (w + 1 < m), a forward brings the activations back to w + 1 while the gradient
  exists: 2P + O + (w+1)A; otherwise as GPipe with k.
- PipeDream with stashing: each async forward computes with a copy of its version, so the stage
  holds the live parameters plus one copy per version in flight: ceil(w/m) + 1 versions, among
  them a shadow of the live one, so ceil(w/m) + 2 parameter sets.
- 2BW: every stage uses two versions (t - 1 for step t, and t - 2 for the step before it while it
  drains). Before the last stage, step t's forwards start before U(t-1), while version t - 1 is
  still live: live + its shadow + the previous version = 3 sets. The last stage forwards step t
  after U(t-1) from a stashed copy: live + one copy = 2 sets.
- 2BW with prediction, last stage: every forward is predicted (d = 1) from the stashed copy of
  t - 1; at U(t) the stage holds live t, the copy of t made for the next step, the prediction of
  step t's forwards (keyed by live version t, freed only after the update) and the pre-update
  copy: 4 sets.
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


P, A, O = 10.0, 3.0, 7.0  # distinct sizes, so a wrong term shows


def sized(p: int) -> CostProfile:
    prof = CostProfile.uniform(p)
    prof.memory = {"params": [P] * p, "activation": [A] * p, "optimizer": [O] * p}
    return prof


def both(p, m, phase, sync="1f1b", weights="stash", mitigation=(), steps=None, check_tensors=True):
    """(simulator's per-stage report, local runtime's) of ``steps`` steps of one phase; the local
    runtime trains a tiny GPT, and after every action its executors' tensors are counted against
    their ledgers."""
    phases = list(phase) if isinstance(phase, list) else None
    steps = len(phases) if phases else steps or (3 if phase == SYNC else min_steady_steps(p, m) + 3)
    phases = phases or [phase] * steps
    spec = ScheduleSpec(p, m, sync, weights)
    spec.check()
    ocfg = OmegaConf.structured(OptimConfig)
    scfg = OmegaConf.structured(ScheduleConfig)
    scfg.mitigation = list(mitigation)
    gpt = one_block_per_stage(p, GPT)
    stages = build_stages(gpt, partition(gpt, p), 0)
    opts = [StageOptimizer(list(st.named_parameters()), ocfg) for st in stages]
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, V, (m, T + 1), generator=g) for _ in range(steps)]
    plan = Plan(steps, list(phases))
    rt = LocalRuntime(stages, opts, spec, plan, UpdatePolicy(ocfg, scfg, plan, steps),
                      lambda t, i: (data[t][i:i + 1, :-1], data[t][i:i + 1, 1:]), sized(p), LinkModel(), 1.0, 0, False)
    if check_tensors:
        run = rt._execute

        def counted(s, a):
            woken = run(s, a)
            ex = rt.executors[s]
            led = ex.ledger
            assert 1 + len(ex.copies) + len(ex.predicted) == led.param_sets(), (s, str(a))
            assert len(ex.grads) == len(led.grads) and len(ex.inflight) == len(led.inflight), (s, str(a))
            # every copy and prediction is a buffer of its own, none the live parameters
            ptrs = {w[0].data_ptr() for w in [*ex.copies.values(), *ex.predicted.values()]} | {ex.params[0].data_ptr()}
            assert len(ptrs) == led.param_sets(), (s, str(a))
            return woken

        rt._execute = counted
    for t in range(steps):
        rt.run_step(t)
    sim = simulate(spec, Plan(steps, list(phases)), sized(p), record=False, mitigations=list(mitigation))
    assert rt.memory() == sim.memory  # one ledger: the two cannot drift
    return sim.memory


def col(mem, key):
    return [d[key] for d in mem]


@pytest.mark.parametrize("p,m", [(4, 1), (4, 3), (3, 6)])
def test_gpipe(p, m):
    mem = both(p, m, SYNC, "gpipe")
    assert col(mem, "peak_param_sets") == [1] * p and col(mem, "peak_grad_sets") == [1] * p
    assert col(mem, "peak_activations") == [m] * p
    assert col(mem, "peak_bytes") == [P + O + max(m * A, P + (m - 1) * A)] * p


@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), (4, 6), (5, 3)])
def test_1f1b(p, m):
    mem = both(p, m, SYNC, "1f1b")
    assert col(mem, "peak_param_sets") == [1] * p and col(mem, "peak_grad_sets") == [1] * p
    expected = []
    for s in range(p):
        w, k = p - s - 1, min(p - s, m)
        expected.append(2 * P + O + (w + 1) * A if w + 1 < m else P + O + max(k * A, P + (k - 1) * A))
    assert col(mem, "peak_activations") == [min(p - s, m) for s in range(p)]
    assert col(mem, "peak_bytes") == expected


# (5, 4) is slow (make test-all): m = p - 1 as (4, 3) and (3, 2)
@pytest.mark.parametrize("p,m", [(4, 1), (4, 3), (2, 1), pytest.param(5, 4, marks=pytest.mark.slow), (3, 2)])
def test_pipedream_stash(p, m):
    mem = both(p, m, ASYNC, weights="stash")
    versions = [math.ceil((p - s - 1) / m) + 1 for s in range(p)]
    assert col(mem, "peak_weight_versions") == versions
    assert col(mem, "peak_param_sets") == [v + 1 for v in versions]
    assert col(mem, "peak_grad_sets") == [1] * p
    assert col(mem, "peak_activations") == [p - s for s in range(p)]


# (5, 4) is slow (make test-all): m = p - 1 as (4, 3), (3, 2) and (2, 1)
@pytest.mark.parametrize("p,m", [(4, 3), (3, 2), (2, 1), pytest.param(5, 4, marks=pytest.mark.slow), (4, 6)])
def test_2bw(p, m):
    mem = both(p, m, ASYNC, weights="2bw")
    assert col(mem, "peak_weight_versions") == [2] * p
    assert col(mem, "peak_param_sets") == [3] * (p - 1) + [2]
    assert col(mem, "peak_grad_sets") == [1] * p


@pytest.mark.parametrize("p,m", [(4, 3), (3, 2), (2, 1)])
def test_2bw_with_prediction_last_stage(p, m):
    mem = both(p, m, ASYNC, weights="2bw", mitigation=["predict"])
    assert mem[-1]["peak_param_sets"] == 4
    assert col(mem, "peak_weight_versions") == [2] * p
    # plain 2BW's report from the simulator alone: test_2bw checks, for these very cases, that
    # the executor's equals it (and its closed form)
    steps = min_steady_steps(p, m) + 3
    plain = simulate(ScheduleSpec(p, m, "1f1b", "2bw"), Plan(steps, [ASYNC] * steps), sized(p), record=False).memory
    # prediction costs memory at every stage
    assert all(a > b for a, b in zip(col(mem, "peak_param_sets"), col(plain, "peak_param_sets")))


def test_mixed_plan_and_mitigations_agree_with_the_executor():
    """Switches, predict and nesterov together: the executor's tensors follow the ledger, and the
    simulator's report equals the runtime's (checked inside ``both``)."""
    mixed = [SYNC, ASYNC, ASYNC, ASYNC, SYNC, SYNC, ASYNC, ASYNC, ASYNC, ASYNC]
    for weights in ("stash", "latest", "vertical", "2bw"):
        # three stages, two microbatches: as at (4, 3), the first stage runs w = m warm-up
        # forwards (a step ahead), and a middle stage too (at 40% less cost)
        both(3, 2, mixed, weights=weights, mitigation=["predict", "nesterov"])


@pytest.mark.parametrize("weights", ["2bw", "vertical"])
def test_flushed_steps_copy_nothing_whatever_the_async_rule(weights):
    """A sync step computes with the live version only: with any async weight rule configured (an
    AdaPipe run's sync phase) it holds one parameter set and pays for no copy."""
    mem = both(4, 3, SYNC, weights=weights, steps=4)
    assert col(mem, "peak_param_sets") == [1] * 4
    prof = CostProfile.uniform(4, copy=5.0)
    plan = Plan(4, [SYNC] * 4)
    charged = simulate(ScheduleSpec(4, 3, "1f1b", weights), plan, prof, record=False)
    free = simulate(ScheduleSpec(4, 3, "1f1b", weights), plan, CostProfile.uniform(4), record=False)
    assert charged.makespan == free.makespan


@pytest.mark.parametrize("mitigation", [["predict"], ["nesterov"], ["predict", "nesterov"]])
def test_only_an_async_update_pays_for_the_mitigations(mitigation):
    """Hand count of an update's extra work: an async one copies the weights before it (one
    ``copy``) and makes one element-wise pass per mitigation (the velocity's EMA, nesterov's step);
    a sync one does neither and forgets the velocity, so an async forward after it is not
    predicted (it computes with a copy of its version)."""
    from adapipe_cli.schedules import UPDATE, Action
    from adapipe_cli.schedules.ledger import Ledger

    led = Ledger(0, predict="predict" in mitigation, keep_before=True)
    work = led.run(Action(UPDATE, -1, 0, 0, ASYNC), 1, False, set(mitigation))
    assert work == {"copy": 1, "predict": len(mitigation)}
    assert led.velocity == ("predict" in mitigation)
    assert led.run(Action(UPDATE, -1, 1, 1, SYNC), 2, False, set(mitigation)) == {}
    assert not led.velocity and led.peak.param_sets == 2  # (the async update's transient copy only)
    assert led.run(Action("F", 8, 4, 2, ASYNC), 2, False, set(mitigation)) == {"copy": 1, "held": 1}  # (a shadow, d = 2)
    assert led.inflight[8] == (2, ("copy", 2))

