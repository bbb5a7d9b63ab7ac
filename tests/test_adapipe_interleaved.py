"""AdaPipe with ``schedule.sync=interleaved``: the model cut into p v chunks placed as interleaved
1F1B places them for the whole run, the async phase PipeDream (weight stashing) over the p v
virtual stages, each device running its chunks in the interleaved order with no flush.

The reference is the hand-written delayed-gradient loop of test_references.py, fed with a table of
per-chunk versions written here from the order alone: each device's forwards go through its chunks
in groups of p microbatches, backwards through them in reverse, 2(p - d - 1) + (v - 1) p warm-up
forwards, then pairs, then the rest; a chunk updates after its backward of a step's last
microbatch; a forward uses the chunk's update count, its backward the same. Sync steps use W(t).
"""

from __future__ import annotations

import pytest
import torch

from adapipe_cli.schedules import ASYNC, SYNC, UPDATE, Plan, PlanError, ScheduleError, ScheduleSpec, lookahead
from adapipe_cli.simulator.clock import CostProfile
from adapipe_cli.simulator.replay import Replay
from adapipe_cli.simulator.simulate import simulate, steady_step_times
from helpers import GCFG, local_runtime, make_data, optim_cfg, rel_close, run_losses, sched_cfg
from test_references import BETAS, EPS, LR, DelayedLoop, assert_differs, one_thread  # noqa: F401 (a fixture)
from test_zero_bubble import DEEP
from version_table import PHASE, microbatch_versions, segments


def device_order(d: int, p: int, v: int, n: int) -> list[tuple[str, int, int]]:
    """Device d's (kind, local chunk, microbatch) over a segment of n microbatches (Megatron's order)."""
    fwd = [(j, g * p + r) for g in range(n // p) for j in range(v) for r in range(p)]
    bwd = [(v - 1 - j, g * p + r) for g in range(n // p) for j in range(v) for r in range(p)]
    w = min(len(fwd), 2 * (p - d - 1) + (v - 1) * p)
    seq = [("F", *x) for x in fwd[:w]]
    for i in range(len(fwd) - w):
        seq += [("F", *fwd[w + i]), ("B", *bwd[i])]
    return seq + [("B", *x) for x in bwd[len(fwd) - w:]]


def chunk_versions(p: int, v: int, m: int, plan: str) -> list[dict[int, tuple[int, int, int]]]:
    """Per virtual stage c (device c % p, local chunk c // p), microbatch -> (forward version,
    backward version, updates made at its forward), in DelayedLoop's table format."""
    table = [dict() for _ in range(p * v)]
    for t0, t1, ph in segments(plan):
        a = t0 * m
        if ph == "sync":
            for c in range(p * v):
                table[c].update({a + i: (t0, t0, t0) for i in range(m)})
            continue
        for d in range(p):
            made = [t0] * v  # the chunks' updates so far
            for kind, j, i in device_order(d, p, v, (t1 - t0) * m):
                if kind == "F":
                    table[d + p * j][a + i] = (made[j], made[j], made[j])
                elif (i + 1) % m == 0:
                    made[j] += 1
    return table


def closed_form_version(t0: int, i: int, c: int, p: int, v: int, m: int) -> int:
    """The docstring's (schedules/interleaved.py): t0 + max(0, floor((k - W_d + j p) / (m v)))."""
    d, j = c % p, c // p
    k = (i // p) * p * v + j * p + i % p
    return t0 + max(0, (k - (2 * (p - d - 1) + (v - 1) * p) + j * p) // (m * v))


def engine(p, v, m, plan, data, gcfg, mitigation=(), **sched):
    ocfg = optim_cfg(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.0, decay="constant", warmup_steps=0)
    rt = local_runtime(p, m, [PHASE[c] for c in plan], data, sync="interleaved", chunks=v, gcfg=gcfg, ocfg=ocfg, clip=0.0,
                       scfg=sched_cfg(mitigation=list(mitigation), **sched))
    return run_losses(rt, len(plan)), [ex.params for ex in rt.executors]


def reference(p, v, m, plan, data, gcfg, table, mitigation=(), **kw):
    loop = DelayedLoop(p * v, m, plan, "stash", mitigation, gcfg=gcfg, table=table, **kw)
    return [loop.step(t, *data[t]) for t in range(len(plan))], [w[-1] for w in loop.versions]


CASES = [(2, 2, 2, "saassaaa", GCFG), pytest.param(2, 2, 4, "aasasaa", GCFG, marks=pytest.mark.slow),
         pytest.param(4, 2, 4, "asaasaa", DEEP, marks=pytest.mark.slow),
         pytest.param(2, 3, 2, "aaasaas", DEEP, marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,v,m,plan,gcfg", CASES)
def test_async_phase_over_chunks_is_the_reference_loop_at_every_switch(p, v, m, plan, gcfg):
    """Every async -> sync drain and sync -> async fill: the losses and final weights of every chunk
    are the delayed-gradient loop's with the per-chunk versions of the interleaved order; the versions
    differ from those of PipeDream's 1F1B over the same p v stages, and from sync training."""
    data = make_data(len(plan))
    table = chunk_versions(p, v, m, plan)
    ref_losses, ref_w = reference(p, v, m, plan, data, gcfg, table)
    got_losses, got_w = engine(p, v, m, plan, data, gcfg)
    assert rel_close(got_losses, ref_losses, 1e-6), (got_losses, ref_losses)
    for c, (a, b) in enumerate(zip(got_w, ref_w)):
        for x, y in zip(a, b):
            assert torch.allclose(x.detach(), y, rtol=1e-4, atol=1e-5), f"chunk {c} weights"
    one_f_one_b = microbatch_versions(p * v, m, plan, "stash")
    assert table != one_f_one_b
    assert_differs(ref_losses, reference(p, v, m, plan, data, gcfg, one_f_one_b)[0])
    assert_differs(ref_losses, reference(p, v, m, "s" * len(plan), data, gcfg, chunk_versions(p, v, m, "s" * len(plan)))[0])


def test_predict_over_chunks_is_its_closed_form():
    """AdaPipe's default mitigation (weight prediction) per chunk, from its delay in the interleaved order."""
    p, v, m, plan = 2, 2, 2, "saaasaa"
    data = make_data(len(plan))
    table = chunk_versions(p, v, m, plan)
    ref_losses, _ = reference(p, v, m, plan, data, GCFG, table, ["predict"], beta=0.5)
    got_losses, _ = engine(p, v, m, plan, data, GCFG, ["predict"], predict_beta=0.5)
    assert rel_close(got_losses, ref_losses, 1e-6), (got_losses, ref_losses)
    assert_differs(ref_losses, reference(p, v, m, plan, data, GCFG, table)[0])


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 3, 8), (3, 2, 6), (8, 2, 8)])
def test_versions_are_the_closed_form_and_the_programs(p, v, m):
    """The table's versions (from the order) are the docstring's closed form, and the programs'
    actions carry them (a backward its forward's); the first chunk's gradients are the stalest."""
    plan = "aaaaa"
    table = chunk_versions(p, v, m, plan)
    for c in range(p * v):
        for i, (vf, _, _) in table[c].items():
            assert vf == closed_form_version(0, i, c, p, v, m), (c, i)
    from adapipe_cli.schedules import StageProgram
    spec = ScheduleSpec(p, m, "interleaved", chunks=v)
    for c in range(p * v):
        prog = StageProgram(c, spec, Plan(len(plan), [ASYNC] * len(plan)))
        got = {}
        while (a := prog.pop()) is not None:
            if a.kind in ("F", "B"):
                got.setdefault(a.mb, []).append(a.version)
        assert got == {i: [vf, vf] for i, (vf, _, _) in table[c].items()}, c
    delay = [max(i // m - vf for i, (vf, _, _) in table[c].items()) for c in range(p * v)]
    assert delay[0] == max(delay)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (4, 2, 4), (4, 2, 8), (3, 3, 3)])
def test_the_stream_has_no_bubble_and_the_simulator_runs_every_switch(p, v, m):
    """Uniform chunk costs F / v, B / v: the async steady state takes m (F + B) per step (no flush, no
    bubble), the sync one interleaved 1F1B's m (F + B) + (p - 1)(F + B) / v; a plan switching every
    way completes (no deadlock) with every chunk's actions run."""
    prof = CostProfile.uniform(p * v, 1.0 / v, 2.0 / v, 0.0)
    spec = ScheduleSpec(p, m, "interleaved", chunks=v)
    sync_t, async_t, switch = steady_step_times(spec, prof)
    assert async_t == pytest.approx(3 * m) and sync_t == pytest.approx(3 * m + 3 * (p - 1) / v)
    assert switch >= 0
    steps = 24
    asyn = simulate(spec, Plan(steps, [ASYNC] * steps), prof, record=False)
    assert asyn.bubble_fraction == pytest.approx(0.0, abs=1e-9)
    mixed = simulate(spec, Plan(9, [PHASE[c] for c in "aasaassaa"]), prof, record=True)
    assert len(mixed.update_end) == 9
    assert sum(1 for e in mixed.timeline if e[1] == UPDATE) == 9 * p * v


def test_the_local_clock_and_ledger_are_the_simulators():
    """Distinct costs per chunk and kind, copies costed: the local runtime's pipeline time of every
    step and its memory ledger's peaks equal the simulator's on the same plan."""
    p, v, m, plan = 2, 2, 4, [PHASE[c] for c in "saasaaas"]
    prof = CostProfile([0.3, 0.5, 0.7, 0.4], [0.9, 1.1, 1.4, 1.0], [0.05, 0.02, 0.03, 0.04], copy=[0.01] * 4,
                       predict=[0.0] * 4, memory={"params": [10.0, 20.0, 30.0, 40.0], "optimizer": [1.0] * 4,
                                                  "activation": [5.0, 6.0, 7.0, 8.0]})
    sim = simulate(ScheduleSpec(p, m, "interleaved", chunks=v), Plan(len(plan), list(plan)), prof, record=False)
    rt = local_runtime(p, m, plan, make_data(len(plan)), sync="interleaved", chunks=v, profile=prof)
    got = [rt.run_step(t) for t in range(len(plan))]
    assert [r.time_s for r in got] == pytest.approx(sim.update_end)
    assert rt.memory() == sim.memory
    assert max(sim.weight_versions) > 1  # (the async steps stash)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (4, 2, 4), (4, 2, 8), (3, 2, 3)])
def test_devices_need_phases_only_lookahead_steps_ahead(p, v, m):
    """Running every device up to its last U(t) (chunks past their U(t) running on) reads phases up
    to t + lookahead(p, m, v) only."""
    la = lookahead(p, m, v)
    spec, prof = ScheduleSpec(p, m, "interleaved", chunks=v), CostProfile.uniform(p * v)
    for t in range(4):
        Replay(spec, Plan(20, [ASYNC] * (t + la + 1)), prof).run_step(t)
    with pytest.raises(PlanError):  # (tight for these depths)
        Replay(spec, Plan(20, [ASYNC] * (3 + la)), prof).run_step(3)


def test_resumes_exactly_after_an_async_step():
    """A state taken after an async step (chunks holding stashed versions and in-flight microbatches,
    devices mid-order) and loaded into a fresh runtime continues with the uninterrupted run's numbers."""
    plan = [PHASE[c] for c in "saaasaa"]
    data = make_data(len(plan))
    whole = run_losses(local_runtime(2, 2, plan, data, sync="interleaved", chunks=2), len(plan))
    first = local_runtime(2, 2, plan, data, sync="interleaved", chunks=2)
    head = [first.run_step(t).loss for t in range(3)]
    second = local_runtime(2, 2, plan, data, sync="interleaved", chunks=2)
    second.load_state_dict(first.state_dict())
    assert head + [second.run_step(t).loss for t in range(3, len(plan))] == whole


def test_spec_refuses_other_weight_rules_over_chunks():
    with pytest.raises(ScheduleError, match="weight stashing"):
        ScheduleSpec(2, 2, "interleaved", "2bw", chunks=2).check()
    ScheduleSpec(2, 2, "interleaved", "stash", chunks=2).check()


INTERLEAVED = ["schedule=adapipe", "schedule.sync=interleaved", "schedule.chunks=2", "heuristic=fixed",
               "heuristic.plan=[[async,3],[sync,2],[async,null]]", "pipeline.stages=2", "pipeline.microbatches=2",
               "model.n_layer=4"]


def test_the_label_names_both_phases_over_the_chunks(make_cfg):
    from adapipe_cli.train.summary import async_label, method_label, sync_label

    cfg = make_cfg(*INTERLEAVED)
    assert method_label(cfg) == "adapipe-fixed(interleaved-v2/pipedream-v2+predict)"
    assert (sync_label(cfg.schedule), async_label(cfg.schedule)) == ("interleaved-v2", "pipedream-v2+predict")
    assert method_label(make_cfg("schedule=adapipe", "schedule.sync=zbh1")) == "adapipe-goodput(zbh1/pipedream+predict)"


@pytest.mark.slow  # a training run in process (about 10 s on a busy machine): the label's fast twin is above
def test_a_run_names_the_variant_and_switches(make_cfg, tmp_path):
    """End to end on the local runtime: the summary names both phases' schedules over the chunks."""
    from adapipe_cli.train.loop import train

    profile = tmp_path / "uniform.json"  # (not measured: a fast test)
    CostProfile.uniform(4, 0.01, 0.02, 0.001).save(profile)
    s = train(make_cfg(*INTERLEAVED, f"pipeline.profile={profile}"), tmp_path / "run")
    assert s["method"] == "adapipe-fixed(interleaved-v2/pipedream-v2+predict)"
    assert s["phase_schedules"] == {"sync": "interleaved-v2", "async": "pipedream-v2+predict"}
    assert s["phases"]["sync"]["steps"] == 2 and s["switches"] == 2
    assert len(s["memory"]) == 4  # (one row per virtual stage)


@pytest.mark.slow  # worker processes on gloo (about 10 s each)
@pytest.mark.parametrize("extra", [["pipeline.microbatches=4", "train.eval_every=3"],
                                   ["pipeline.stages=3", "pipeline.microbatches=3", "model.n_layer=6",
                                    "train.batch_size=12"]])
def test_dist_equals_local_bitwise(make_cfg, tmp_path, extra):
    """Every step's record and every evaluation of the dist runtime (gloo, one thread per worker)
    are the local runtime's, bit for bit, across both switches and the async stream's cuts (at
    three stages a device's cut lies past its last update), the held-out signal at every cut."""
    from test_dist import local_and_dist

    (ls, lsteps, levals), (ds, dsteps, devals) = local_and_dist(make_cfg, tmp_path, *INTERLEAVED, "heuristic.guard=false",
                                                                *extra)
    assert dsteps == lsteps and devals == levals
    assert ds["final_val_loss"] == ls["final_val_loss"] and ds["method"] == ls["method"]
    assert ds["runtime"] == "dist" and [m["stage"] for m in ds["memory"]] == list(range(len(ds["memory"])))


def worker_protocol(p: int, v: int, m: int, phases: list[str], every: int) -> list[list[int]]:
    """The dist workers' protocol over chunks (runtime/worker.py), emulated without processes: each
    device runs its order; at its cut of step t it reports t, then runs the held-out signal S(t + 1)
    and the due evaluation E(t + 1) in chunk order (each needs the previous virtual stage's); before
    its first U(t) it waits at the gate for every device's report of t - 1 and the last chunk's
    S(t) and due E(t); a sync U(t) waits for every chunk. Returns each chunk's evaluated versions;
    raises on a deadlock."""
    from adapipe_cli.schedules import StageProgram
    from adapipe_cli.schedules.interleaved import CUT, DevicePicks

    n, P = len(phases), p * v
    plan, spec = Plan(n, phases), ScheduleSpec(p, m, "interleaved", chunks=v)
    programs = [StageProgram(c, spec, plan) for c in range(P)]
    picks = DevicePicks(spec, plan)
    picks.until = -1  # (every cut shows)
    due = lambda t: t == -1 or (t + 1) % every == 0 or t + 1 == n  # noqa: E731
    updates, evals, done, arrived = [0] * P, [[] for _ in range(P)], set(), {}

    def tokens(d):
        opened = -1
        if due(-1):
            yield from (("E", d + p * j, 0) for j in range(v))
        while (e := picks.entry(d)) is not None:
            if e[0] == CUT:
                yield ("R", d, e[1])
                for kind in ("S", "E") if due(e[1]) else ("S",):
                    yield from ((kind, d + p * j, e[1] + 1) for j in range(v))
                picks.pass_cut(d)
                continue
            a = programs[e[1]].pop()
            if a.kind == UPDATE and a.step != opened:
                opened = a.step
                yield ("G", d, a.step)
            yield (a.kind, e[1], a.step if a.kind == UPDATE else a.mb, a.phase)
            picks.advance(e[1])

    def ready(tok):
        kind, c, x = tok[:3]
        if kind in ("F", "S", "E"):
            return c == 0 or (kind, c - 1, x) in done
        if kind == "B":
            return c == P - 1 or ("B", c + 1, x) in done
        if kind == "G":
            return x == 0 or (all(("R", d, x - 1) in done for d in range(p)) and ("S", P - 1, x) in done
                              and (not due(x - 1) or ("E", P - 1, x) in done))
        if kind == UPDATE and tok[3] == SYNC:
            arrived.setdefault(x, set()).update(c + p * j for j in range(v - c // p))
            return len(arrived[x]) == P
        return True

    gens = [tokens(d) for d in range(p)]
    nxt = [next(g, None) for g in gens]
    while any(t is not None for t in nxt):
        progress = False
        for d in range(p):
            while nxt[d] is not None and ready(nxt[d]):
                kind, c, x = nxt[d][:3]
                done.add(nxt[d][:3])
                if kind == UPDATE:
                    updates[c] += 1
                if kind in ("E", "S"):
                    assert updates[c] == x, f"chunk {c} evaluates version {x} holding {updates[c]}"
                if kind == "E":
                    evals[c].append(x)
                nxt[d] = next(gens[d], None)
                progress = True
        assert progress, f"deadlock: {nxt}"
    return evals


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 3, 4), (3, 2, 3), (4, 2, 4), (4, 3, 8), (5, 2, 5)])
def test_the_workers_protocol_over_chunks_cannot_deadlock(p, v, m):
    """The fast twin of the dist tests: whatever the plan, every device reaches every cut and
    gate, and evaluates each due version holding it."""
    for plan in ("aaaaaaaa", "ssssssss", "saassaaa", "asasasas"):
        for every in (1, 3):
            evals = worker_protocol(p, v, m, [PHASE[c] for c in plan], every)
            want = sorted({0, *(t + 1 for t in range(8) if (t + 1) % every == 0 or t == 7)})
            assert evals == [want] * (p * v)
