"""The local runtime against small, obvious reference loops: the exactness the engine promises."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.func import functional_call

from adapipe_cli.model import GPTConfig, build_full_model, build_stages, lm_loss, partition
from adapipe_cli.schedules import ASYNC, SYNC
from adapipe_cli.optim import StageOptimizer, lr_factor
from helpers import GCFG, B, local_runtime, make_data, optim_cfg, rel_close, run_losses, one_block_per_stage

STEPS = 6


# one_block_per_stage (helpers) where what a test checks does not depend on a stage's blocks; the
# sync equality keeps GCFG at every depth: stages of several blocks
def reference_sync(data, m, clip, gcfg=GCFG, steps=STEPS):
    """Single-process training with gradient accumulation: W(t+1) = opt(W(t), mean_i grad_i)."""
    model = build_full_model(gcfg, seed=0)
    named = list(model.named_parameters())
    opt = StageOptimizer(named, optim_cfg(grad_clip=clip))
    losses = []
    for t in range(steps):
        x, y = data[t]
        mb = B // m
        total = 0.0
        for i in range(m):
            loss = lm_loss(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb])
            (loss / m).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        opt.step(lr_factor(t, 2, steps, 0.1))
        losses.append(total / m)
    return losses


@functools.lru_cache(maxsize=None)
def reference_sync_of(m, clip, gcfg=GCFG, steps=STEPS) -> tuple[float, ...]:
    """``reference_sync`` on ``make_data(steps)``, computed once per case (cases with the same m
    share it: the single-process run does not depend on the pipeline's depth or order)."""
    return tuple(reference_sync(make_data(steps), m, clip, gcfg, steps))


# The fast cases keep every shape of the stage orders; the others are slow (make test-all). 1F1B:
# one stage with accumulation (1, 4); two stages, where each stage's warm-up is min(p - s - 1, m)
# = 1 whatever m, with no accumulation (2, 1) and with F-B pairs (2, 4), which (2, 2) repeats;
# four stages with the warm-up cut to m (4, 1), (4, 2) or not (4, 4); (1, 1) and (1, 2) repeat one
# stage's path. GPipe (every forward, then every backward): one stage (1, 2), no accumulation
# (2, 1), a deep pipeline (4, 4); with m = 1 it is 1F1B's order ((4, 1) above).
SYNC_FAST = {"1f1b": {(1, 4), (2, 1), (2, 4), (4, 1), (4, 2), (4, 4)}, "gpipe": {(1, 2), (2, 1), (4, 4)}}


@pytest.mark.parametrize("sync,m,p", [
    pytest.param(sync, m, p, id=f"{sync}-{m}-{p}", marks=() if (p, m) in SYNC_FAST[sync] else pytest.mark.slow)
    for sync in ("1f1b", "gpipe") for m in (1, 2, 4) for p in (1, 2, 4)])
def test_sync_equals_single_process_gradient_accumulation(p, m, sync):
    data = make_data(STEPS)
    ref = reference_sync_of(m, clip=1.0)
    got = run_losses(local_runtime(p, m, [SYNC] * STEPS, data, sync=sync, clip=1.0), STEPS)
    assert rel_close(got, ref, 1e-5), (got, ref)


@pytest.mark.parametrize("p", [2, 4])
def test_tied_embeddings_sum_the_two_copies_gradients(p):
    gcfg = GPTConfig(**{**GCFG.__dict__, "tie_embeddings": True})
    data = make_data(STEPS)
    ref = reference_sync_of(2, clip=1.0, gcfg=gcfg)
    rt = local_runtime(p, 2, [SYNC] * STEPS, data, gcfg=gcfg, clip=1.0)
    got = run_losses(rt, STEPS)
    assert rel_close(got, ref, 1e-5), (got, ref)
    first, last = rt.executors[0].module, rt.executors[-1].module
    assert torch.allclose(first.embed.wte.weight, last.head.lm_head.weight, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3])
def test_async_with_one_stage_equals_sync(m):
    data, gcfg = make_data(STEPS), one_block_per_stage(1)
    sync = run_losses(local_runtime(1, m, [SYNC] * STEPS, data, gcfg=gcfg), STEPS)
    for weights in ("stash", "latest", "vertical"):
        assert run_losses(local_runtime(1, m, [ASYNC] * STEPS, data, weights=weights, gcfg=gcfg), STEPS) == sync


def reference_2bw(data, m, steps=STEPS, gcfg=GCFG):
    """The unpartitioned model with W(t+1) = opt(W(t), grad at W(t-1)), W(-1) = W(0)."""
    model = build_full_model(gcfg, seed=0)
    named = list(model.named_parameters())
    opt = StageOptimizer(named, optim_cfg(grad_clip=0.0))
    names = [n for n, _ in named]
    previous = [p.detach().clone() for _, p in named]  # W(t-1)
    losses = []
    for t in range(steps):
        x, y = data[t]
        mb = B // m
        w = [v.clone().requires_grad_(True) for v in previous]
        grads = [torch.zeros_like(v) for v in w]
        total = 0.0
        for i in range(m):
            loss = lm_loss(functional_call(model, dict(zip(names, w)), (x[i * mb:(i + 1) * mb],)), y[i * mb:(i + 1) * mb])
            for g, gi in zip(grads, torch.autograd.grad(loss / m, w)):
                g.add_(gi)
            total += loss.item()
        current = [p.detach().clone() for _, p in named]  # W(t), the delayed gradient lands here
        for (_, p), g in zip(named, grads):
            p.grad = g
        opt.step(lr_factor(t, 2, steps, 0.1))
        previous = current
        losses.append(total / m)
    return losses


# (4, 4) is slow (make test-all): m > p - 1 as (2, 2), depth 4 as (4, 3)
@pytest.mark.parametrize("p,m", [(2, 1), (2, 2), (4, 3), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_2bw_matches_the_delayed_gradient_loop(p, m):
    data = make_data(STEPS)
    gcfg = one_block_per_stage(p)
    ref = reference_2bw(data, m, gcfg=gcfg)
    got = run_losses(local_runtime(p, m, [ASYNC] * STEPS, data, weights="2bw", clip=0.0, gcfg=gcfg), STEPS)
    assert rel_close(got, ref, 1e-5), (got, ref)


def reference_pipedream(data, p, m, clip, steps=STEPS, gcfg=GCFG):
    """Per stage, the version each microbatch's forward used, from a table of weight versions:
    stage s forwards microbatch j with its latest weights, which in a 1F1B stream of p stages are
    version max(0, floor((j - (p - s - 1)) / m)); gradients are taken at those versions and applied,
    per stage, at the end of each step.

    Clipping by the global norm as far as a stage can know it at its update of step t: its own
    squared norm and those of every stage downstream of the same step t (their backwards of the
    step's last microbatch came first), and of each upstream stage s' < s the newest step it had
    completed when it forwarded the last microbatch stage s forwarded before the update, j* =
    (t+1) m - 1 + (p - s - 1), which is step t + floor((s' - s - 1) / m); a stage with no
    completed step yet counts as much as stage s itself."""
    stages = build_stages(gcfg, partition(gcfg, p), seed=0)
    named = [list(st.named_parameters()) for st in stages]
    opts = [StageOptimizer(n, optim_cfg(grad_clip=clip)) for n in named]
    versions = [[[q.detach().clone() for _, q in n]] for n in named]  # versions[s][v]
    sq_history: list[list[float]] = []  # [t][s]: squared norm of stage s's gradient of step t
    losses = []
    for t in range(steps):
        x, y = data[t]
        mb = B // m
        grads = [[torch.zeros_like(q) for _, q in n] for n in named]
        total = 0.0
        for i in range(m):
            j = t * m + i
            ws = [[q.clone().requires_grad_(True) for q in versions[s][max(0, (j - (p - s - 1)) // m)]] for s in range(p)]
            h = x[i * mb:(i + 1) * mb]
            for s, st in enumerate(stages):
                h = functional_call(st, {nm: w for (nm, _), w in zip(named[s], ws[s])}, (h,))
            loss = lm_loss(h, y[i * mb:(i + 1) * mb])
            gs = torch.autograd.grad(loss / m, [w for s in range(p) for w in ws[s]])
            k = 0
            for s in range(p):
                for g in grads[s]:
                    g.add_(gs[k])
                    k += 1
            total += loss.item()
        sq_history.append([float(torch.stack([torch.linalg.vector_norm(g) for g in grads[s]]).pow(2).sum())
                           for s in range(p)])
        for s in range(p):
            own = sq_history[t][s]
            total_sq = 0.0
            for s2 in range(p):
                tau = t if s2 >= s else t + (s2 - s - 1) // m
                total_sq += sq_history[tau][s2] if tau >= 0 else own
            norm = math.sqrt(total_sq)
            coef = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
            for (_, q), g in zip(named[s], grads[s]):
                q.grad = g * coef
            opts[s].step(lr_factor(t, 2, steps, 0.1))
            versions[s].append([q.detach().clone() for _, q in named[s]])
        losses.append(total / m)
    return losses


@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 2), (3, 4)])
def test_pipedream_stash_matches_the_version_table(p, m):
    data = make_data(STEPS)
    gcfg = one_block_per_stage(p)
    ref = reference_pipedream(data, p, m, clip=1.0, gcfg=gcfg)
    got = run_losses(local_runtime(p, m, [ASYNC] * STEPS, data, clip=1.0, gcfg=gcfg), STEPS)
    assert rel_close(got, ref, 1e-5), (got, ref)


@pytest.mark.parametrize("weights", ["stash", "latest", "vertical", "2bw"])
def test_numbers_do_not_depend_on_the_interleaving(weights):
    # a fill, a drain into a sync step and a fill again (six steps: 104 pairs of actions of two
    # stages in another order between the two walks; eight steps of the same switches: 146)
    phases = [SYNC, ASYNC, ASYNC, SYNC, ASYNC, ASYNC]
    data = make_data(len(phases))
    a = local_runtime(4, 3, phases, data, weights=weights, order="forward")
    b = local_runtime(4, 3, phases, data, weights=weights, order="reverse")
    assert run_losses(a, len(phases)) == run_losses(b, len(phases))
    for ea, eb in zip(a.executors, b.executors):
        assert all(torch.equal(x, y) for x, y in zip(ea.params, eb.params))


@pytest.mark.parametrize("held,sync", [(False, "1f1b"), (True, "1f1b"), (True, "zbh1")])
def test_pipeline_clock_is_the_simulators_time(held, sync):
    """The local runtime's time_s is the simulated pipeline time of the same lists and costs; with
    an in-flight table too (the executor's ledger counts what the simulator's does, at F, B and, in
    ZB-H1's sync steps, I and W), and then it is later than without."""
    from adapipe_cli.schedules import Plan, ScheduleSpec
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.simulator.simulate import simulate

    phases = [SYNC, SYNC, ASYNC, ASYNC, ASYNC, SYNC]
    prof = CostProfile([1.0, 1.5, 1.2], [2.0, 3.1, 2.5], [0.1, 0.2, 0.1])
    if held:
        prof.held = {"depths": [1, 4], "forward": [[1.0, 1.3], [1.0, 1.2], [1.0, 1.1]],
                     "backward": [[1.0, 1.6], [1.0, 1.4], [1.0, 1.5]]}
    rt = local_runtime(3, 2, phases, make_data(len(phases)), profile=prof, sync=sync, gcfg=one_block_per_stage(3))
    times = [rt.run_step(t).time_s for t in range(len(phases))]
    sim = simulate(ScheduleSpec(3, 2, sync), Plan(len(phases), phases), prof)
    assert times == pytest.approx(sim.update_end, rel=1e-12)
    if held:  # (with ZB-H1 the sync steps' I and W held theirs too)
        prof.held = {}
        assert times[-1] > simulate(ScheduleSpec(3, 2, sync), Plan(len(phases), phases), prof).update_end[-1] + 0.1


@pytest.mark.parametrize("weights,mitigation", [("stash", []), ("latest", []), ("2bw", ["predict"]),
                                                ("stash", ["predict", "nesterov"]), ("latest", ["predict"])])
def test_pipeline_clock_charges_copies_predictions_and_recomputes(weights, mitigation):
    """With distinct non-zero costs for every kind of work, the local clock equals the simulator
    fed with the same profile, and the extra work is really on it: the same run with copies and
    predictions free is faster by exactly the work the ledger counted."""
    from adapipe_cli.schedules import Plan, ScheduleSpec
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.simulator.simulate import simulate
    from helpers import sched_cfg

    phases = [SYNC, ASYNC, ASYNC, ASYNC, ASYNC, SYNC, ASYNC, ASYNC]
    p, m = 3, 2
    prof = CostProfile([1.0, 1.5, 1.2], [2.0, 3.1, 2.5], [0.1, 0.2, 0.3], copy=[0.07, 0.11, 0.13], predict=[0.017, 0.019, 0.023])
    free = CostProfile(prof.forward, prof.backward, prof.update)
    data = make_data(len(phases))
    kw = dict(weights=weights, scfg=sched_cfg(mitigation=mitigation), gcfg=one_block_per_stage(p))
    rt = local_runtime(p, m, phases, data, profile=prof, **kw)
    times = [rt.run_step(t).time_s for t in range(len(phases))]
    sim = simulate(ScheduleSpec(p, m, "1f1b", weights), Plan(len(phases), phases), prof, mitigations=mitigation)
    assert times == pytest.approx(sim.update_end, rel=1e-12)
    base = simulate(ScheduleSpec(p, m, "1f1b", weights), Plan(len(phases), phases), free, mitigations=mitigation)
    assert sim.makespan > base.makespan  # copies (async), predictions or recomputes are charged
    if weights == "stash" and not mitigation:
        # hand count: an async forward computes with a copy of its version, made once per version
        # (every stage's forwards of a version run while it is live): so each stage pays one copy
        # per distinct version its async forwards use, and nothing else is extra
        from adapipe_cli.schedules import FORWARD, StageProgram

        busy = sum(sim.utilization) * sim.makespan - sum(base.utilization) * base.makespan
        spec, plan = ScheduleSpec(p, m, "1f1b", weights), Plan(len(phases), phases)
        expected = 0.0
        for st in range(p):
            prog, versions = StageProgram(st, spec, plan), set()
            while (a := prog.pop()) is not None:
                if a.kind == FORWARD and a.phase == ASYNC:
                    versions.add(a.version)
            expected += len(versions) * prof.copy[st]
        assert busy == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("sync", ["1f1b", "zbh1"])
@pytest.mark.parametrize("mitigation", [["predict"], ["predict", "nesterov"]])
def test_sync_steps_with_mitigations_are_the_plain_sync_schedule(sync, mitigation):
    """The mitigations act in async only: a plan of sync steps with them on (AdaPipe's sync
    warm-up) has exactly the plain sync schedule's losses, weights, clock and peak memory, on the
    local runtime and in the simulator, with copies and predictions far from free; and it leaves
    no velocity or previous step for an async phase to inherit."""
    from adapipe_cli.schedules import Plan, ScheduleSpec
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.simulator.simulate import simulate
    from helpers import sched_cfg

    p, m, phases = 3, 2, [SYNC] * 4
    prof = CostProfile([1.0, 1.5, 1.2], [2.0, 3.1, 2.5], [0.1, 0.2, 0.3], copy=[0.7, 1.1, 1.3], predict=[0.17, 0.19, 0.23])
    data = make_data(len(phases))
    plain = local_runtime(p, m, phases, data, sync=sync, profile=prof, gcfg=one_block_per_stage(p))
    mitigated = local_runtime(p, m, phases, data, sync=sync, profile=prof, gcfg=one_block_per_stage(p),
                              scfg=sched_cfg(mitigation=mitigation, predict_beta=0.5, nesterov_gamma=0.7))
    a = [plain.run_step(t) for t in range(len(phases))]
    b = [mitigated.run_step(t) for t in range(len(phases))]
    assert [r.loss for r in b] == [r.loss for r in a]
    assert [r.time_s for r in b] == [r.time_s for r in a]
    for x, y in zip(plain.executors, mitigated.executors):
        assert all(torch.equal(u, v) for u, v in zip(x.params, y.params))
        assert x.ledger.report() == y.ledger.report()  # (no pre-update copy counted either)
    policy = mitigated.executors[0].policy
    assert policy.velocity == {} and policy.previous_step == {}
    spec, plan = ScheduleSpec(p, m, sync), Plan(len(phases), phases)
    sim = simulate(spec, plan, prof, mitigations=mitigation)
    assert sim.update_end == simulate(spec, plan, prof).update_end
    assert [r.time_s for r in a] == pytest.approx(sim.update_end, rel=1e-12)


@pytest.mark.parametrize("sync,weights", [("1f1b", "stash"), ("zbh1", "stash"), ("1f1b", "latest")])
def test_pipeline_clock_charges_gradient_accumulation_and_the_batch(sync, weights):
    """Every backward (W of a split one) but the first of a step adds its gradient into the step's
    accumulator, and the first and the last stage make each step's batch: with non-zero
    ``accumulate`` and ``data`` costs the local clock still equals the simulator, and the busy time
    grows by exactly steps x ((m - 1) accumulate[s] + data[s] on the two end stages) (hand count)."""
    from adapipe_cli.schedules import Plan, ScheduleSpec
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.simulator.simulate import simulate

    phases = [SYNC, SYNC, SYNC] if sync == "zbh1" else [SYNC, ASYNC, ASYNC, ASYNC, SYNC, ASYNC]
    p, m = 3, 3
    acc, data = [0.031, 0.037, 0.041], [0.43, 0.47, 0.53]
    prof = CostProfile([1.0, 1.5, 1.2], [2.0, 3.1, 2.5], [0.1, 0.2, 0.3], copy=[0.07, 0.11, 0.13], accumulate=acc, data=data)
    free = CostProfile(prof.forward, prof.backward, prof.update, copy=prof.copy)
    rt = local_runtime(p, m, phases, make_data(len(phases)), sync=sync, weights=weights, profile=prof,
                       gcfg=one_block_per_stage(p))
    times = [rt.run_step(t).time_s for t in range(len(phases))]
    spec, plan = ScheduleSpec(p, m, sync, weights), Plan(len(phases), phases)
    sim = simulate(spec, plan, prof)
    assert times == pytest.approx(sim.update_end, rel=1e-12)
    base = simulate(spec, plan, free)
    busy = [u * sim.makespan - v * base.makespan for u, v in zip(sim.utilization, base.utilization)]
    ends = [1.0, 0.0, 1.0]  # the first stage reads the inputs, the last the targets
    assert busy == pytest.approx([len(phases) * ((m - 1) * a + e * d) for a, d, e in zip(acc, data, ends)], rel=1e-9)
    assert sim.makespan > base.makespan


@pytest.mark.parametrize("m", [1, 2])
def test_one_stage_sync_and_async_clip_identically(m):
    """With one stage an async step has no delay: its clipping is sync's (the global norm), with
    clipping active (a threshold far below the gradient norm)."""
    data, gcfg = make_data(STEPS), one_block_per_stage(1)
    sync_rt = local_runtime(1, m, [SYNC] * STEPS, data, clip=0.05, gcfg=gcfg)
    async_rt = local_runtime(1, m, [ASYNC] * STEPS, data, clip=0.05, gcfg=gcfg)
    s = [sync_rt.run_step(t) for t in range(STEPS)]
    a = [async_rt.run_step(t) for t in range(STEPS)]
    assert min(r.grad_norm for r in s) > 0.5  # far above 0.05: the clip is active at every step
    assert [r.loss for r in a] == [r.loss for r in s]
    assert [r.grad_norm for r in a] == [r.grad_norm for r in s]
    unclipped = run_losses(local_runtime(1, m, [SYNC] * STEPS, data, clip=0.0, gcfg=gcfg), STEPS)
    assert unclipped != [r.loss for r in s]


@pytest.mark.parametrize("p,m", [(2, 1), (4, 2)])
def test_grad_norm_is_the_global_norm_in_both_phases(p, m):
    """The logged grad_norm is the norm of the whole step's gradient before clipping, in sync and
    in async alike: with zero delay it is the single-process norm."""
    data = make_data(STEPS)
    model = build_full_model(GCFG, seed=0)
    x, y = data[0]
    mb = B // m
    for i in range(m):
        (lm_loss(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]) / m).backward()
    ref = math.sqrt(sum(float(q.grad.pow(2).sum()) for q in model.parameters()))
    for phase in (SYNC, ASYNC):
        r = local_runtime(p, m, [phase] * STEPS, data).run_step(0)  # step 0: every version is 0
        assert r.grad_norm == pytest.approx(ref, rel=1e-5)


# 10 steps at lr 5e-3: the losses end at 0.85-0.88 of the first (30 steps at the default 1e-3:
# 0.85-0.87), a third of the cost
MITIGATED_STEPS, MITIGATED_LR = 10, 5e-3


def one_batch_repeated():
    return make_data(1, seed=5) * MITIGATED_STEPS  # one batch, repeated: its loss must fall


@pytest.fixture(scope="module")
def unmitigated_losses() -> tuple[float, ...]:
    """The run without a mitigation that each mitigated run is compared with (computed once: read only)."""
    rt = local_runtime(4, 2, [ASYNC] * MITIGATED_STEPS, one_batch_repeated(), ocfg=optim_cfg(lr=MITIGATED_LR))
    return tuple(run_losses(rt, MITIGATED_STEPS))


@pytest.mark.parametrize("mitigation", [["lr_reschedule"], ["predict"], ["nesterov"], ["lr_reschedule", "predict"]])
def test_mitigations_train(mitigation, unmitigated_losses):
    from helpers import sched_cfg

    steps = MITIGATED_STEPS
    data = one_batch_repeated()
    rt = local_runtime(4, 2, [ASYNC] * steps, data, ocfg=optim_cfg(lr=MITIGATED_LR), scfg=sched_cfg(mitigation=mitigation))
    losses = run_losses(rt, steps)
    plain = list(unmitigated_losses)
    assert losses[-1] < 0.9 * losses[0]
    assert losses != plain  # the mitigation changed the updates


@pytest.mark.parametrize("weights,mitigation", [("stash", []), ("2bw", []), ("vertical", ["predict"]), ("stash", ["predict"]),
                                                ("latest", ["nesterov", "lr_reschedule"])])
def test_state_round_trip_continues_exactly(weights, mitigation):
    """Taking a runtime's state mid-stream (async microbatches in flight) and loading it into a
    fresh runtime continues with exactly the numbers of the uninterrupted run; and taking it does
    not change the numbers of the run it was taken from. Three stages (of one block), two
    microbatches (2BW needs m >= p - 1): the first stage holds two microbatches in flight at each
    cut, and a middle stage is restored too."""
    import copy

    from helpers import sched_cfg

    phases = [SYNC, ASYNC, ASYNC, ASYNC, ASYNC, SYNC, ASYNC, ASYNC, ASYNC]
    p, m, cuts = 3, 2, (2, 6)
    data = make_data(len(phases))
    kw = dict(weights=weights, scfg=sched_cfg(mitigation=mitigation), gcfg=one_block_per_stage(p))
    whole = run_losses(local_runtime(p, m, phases, data, **kw), len(phases))
    a = local_runtime(p, m, phases, data, **kw)
    head, states = [], {}
    for t in range(cuts[-1] + 1):  # (one run to the last cut, its state taken at each)
        head.append(a.run_step(t).loss)
        if t in cuts:
            states[t] = copy.deepcopy(a.state_dict())
    assert head == whole[:len(head)]
    for cut in cuts:
        b = local_runtime(p, m, phases, data, seed=7, **kw)  # other initial weights: all must be overwritten
        b.load_state_dict(states[cut])
        tail = [b.run_step(t).loss for t in range(cut + 1, len(phases))]
        assert whole[:cut + 1] + tail == whole


@pytest.mark.parametrize("tie", [False, True])
def test_call_with_is_functional_call_and_puts_the_parameters_back(tie):
    """The executor computes with a stashed or predicted version by swapping it into the module's
    parameter slots: the same output and gradients as ``torch.func.functional_call`` (which ties
    a parameter registered twice, as one stage holding both tied embeddings does), and the
    module's own parameters back in place afterwards, also when the forward raises."""
    from dataclasses import replace

    from adapipe_cli.runtime.stage import call_with, param_slots

    model = build_full_model(replace(GCFG, tie_embeddings=tie), seed=0)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    weights = [(p.detach() + 0.01 * torch.randn_like(p)).requires_grad_(True) for p in params]
    x = make_data(1)[0][0][:2]
    slots = param_slots(model, params)
    assert len(slots) == len(params) + (1 if tie else 0)
    out = call_with(model, slots, weights, x)
    ref = functional_call(model, {n: w for (n, _), w in zip(named, weights)}, (x,))
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.square().mean(), weights)
    ref_grads = torch.autograd.grad(ref.square().mean(), weights)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(a is b for a, b in zip((p for _, p in model.named_parameters()), params))
    assert all(p.grad is None for p in params)
    assert not torch.equal(model(x), out)  # (the live weights again)
    with pytest.raises(RuntimeError):
        call_with(model, slots, weights, x.float())  # (an embedding needs integer tokens)
    assert all(a is b for a, b in zip((p for _, p in model.named_parameters(remove_duplicate=False)),
                                      (params[i] for _, _, i in slots)))


@pytest.mark.parametrize("sync", ["1f1b", "zbh1"])
def test_the_held_out_signal_is_on_the_local_clock(sync):
    """AdaPipe's held-out signal is on the clock: with its per-stage cost after each update the
    local clock equals the simulator given the same cost, and the busy time grows by exactly
    steps x the stage's share (hand count). With measured costs (no profile), evaluating the
    signal charges each stage what its forward took, and evaluating the validation batches
    charges nothing."""
    from adapipe_cli.schedules import Plan, ScheduleSpec
    from adapipe_cli.simulator.clock import CostProfile
    from adapipe_cli.simulator.simulate import simulate

    phases = [SYNC, ASYNC, ASYNC, ASYNC, SYNC, ASYNC] if sync == "1f1b" else [SYNC] * 4
    p, m, sig = 3, 2, [0.31, 0.37, 0.41]
    prof = CostProfile([1.0, 1.5, 1.2], [2.0, 3.1, 2.5], [0.1, 0.2, 0.3], copy=[0.07, 0.11, 0.13])
    data = make_data(len(phases))
    rt = local_runtime(p, m, phases, data, sync=sync, profile=prof, signal=sig, gcfg=one_block_per_stage(p))
    times = [rt.run_step(t).time_s for t in range(len(phases))]
    spec, plan = ScheduleSpec(p, m, sync), Plan(len(phases), phases)
    sim = simulate(spec, plan, prof, signal=sig)
    assert times == pytest.approx(sim.update_end, rel=1e-12)
    base = simulate(spec, plan, prof)
    assert sim.makespan > base.makespan
    busy = [u * sim.makespan - v * base.makespan for u, v in zip(sim.utilization, base.utilization)]
    assert busy == pytest.approx([len(phases) * c for c in sig], rel=1e-9)

    measured = local_runtime(p, m, [SYNC], data, sync=sync, measured=True, gcfg=one_block_per_stage(p))
    measured.run_step(0)
    before = list(measured.clock.busy)
    batches = [data[0]]  # (a batch of the data as the held-out one)
    measured.evaluate(batches)
    assert measured.clock.busy == before  # an evaluation is not on the clock
    free = list(measured.clock.free)
    measured.evaluate(batches, signal=True)
    grown = [b - a for a, b in zip(before, measured.clock.busy)]
    assert all(g > 0 for g in grown) and [f + g for f, g in zip(free, grown)] == pytest.approx(measured.clock.free)
