"""Data parallel x pipeline (``pipeline.replicas=R``) on the local runtime.

References written apart from the engine: a single-process model trained on the whole batch
(sync), the same runtime with one replica and the same total batch, and the delayed-gradient loop
of test_references with each step's gradient the mean over R replicas' shares (async).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from adapipe_cli.cli.main import main
from adapipe_cli.model import build_stages, lm_loss, partition
from adapipe_cli.optim import StageOptimizer
from adapipe_cli.runtime.local import LocalRuntime, Replica
from adapipe_cli.runtime.replicas import replica_batch
from adapipe_cli.schedules import Plan, ScheduleSpec
from adapipe_cli.schedules.mitigations import UpdatePolicy
from adapipe_cli.simulator.clock import CostProfile, LinkModel
from conftest import TINY
from helpers import GCFG, B, batch_fn, make_data, optim_cfg, rel_close, run_losses, sched_cfg, one_block_per_stage
from test_references import BETAS, EPS, LR, DelayedLoop
from version_table import PHASE

ADAM = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.0, decay="constant", warmup_steps=0)


def replicated(R, p, m, phases, data, *, weights="stash", clip=0.0, ocfg=None, scfg=None, order="forward",
               sync="1f1b", allreduce=None, gcfg=None, chunks=1):
    """A local runtime of R replicas of a p-stage pipeline, each on its R-th of every batch
    (``gcfg`` None: one block per virtual stage)."""
    gcfg = gcfg if gcfg is not None else one_block_per_stage(p * chunks)
    plan = Plan(len(phases), list(phases))
    ocfg = ocfg if ocfg is not None else optim_cfg(**ADAM)
    ocfg.grad_clip = clip
    scfg = scfg if scfg is not None else sched_cfg()
    full = batch_fn(data, R * m)

    def parts():
        stages = build_stages(gcfg, partition(gcfg, p * chunks), 0)
        return stages, [StageOptimizer(list(s.named_parameters()), ocfg) for s in stages]

    policy = UpdatePolicy(ocfg, scfg, plan, len(phases))
    stages, opts = parts()
    more = [Replica(*parts(), policy.replica(), replica_batch(full, r, m)) for r in range(1, R)]
    return LocalRuntime(stages, opts, ScheduleSpec(p, m, sync, weights, True, chunks), plan, policy, replica_batch(full, 0, m),
                        CostProfile.uniform(p * chunks), LinkModel(), clip, 0, gcfg.tie_embeddings, order, replicas=more, allreduce=allreduce)


def single_process(data, steps, clip, gcfg=GCFG):
    """The unpartitioned model on the whole batch: torch's AdamW, torch's global-norm clipping."""
    (model,) = build_stages(gcfg, partition(gcfg, 1), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for t in range(steps):
        x, y = data[t]
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=None)
def single_process_of(steps: int, clip: float, gcfg) -> tuple[float, ...]:
    """``single_process`` on ``make_data(steps)``, computed once for the cases that share it (read only)."""
    return tuple(single_process(make_data(steps), steps, clip, gcfg))


@pytest.mark.parametrize("sync,chunks", [("1f1b", 1), ("gpipe", 1), ("zbh1", 1), ("interleaved", 2)])
def test_sync_replicas_are_single_process_training_on_the_whole_batch(sync, chunks):
    data = make_data(6)
    ref = single_process_of(6, 0.5, one_block_per_stage(2 * chunks))
    rt = replicated(2, 2, 2, ["sync"] * 6, data, clip=0.5, sync=sync, chunks=chunks)
    results = [rt.run_step(t) for t in range(6)]
    assert rel_close([r.loss for r in results], ref, 1e-5), ([r.loss for r in results], ref)
    assert results[0].grad_norm > 0.5  # the clip is active: it acts on the mean gradient's norm


def test_sync_replicas_with_tied_embeddings_are_single_process_training():
    gcfg = dataclasses.replace(one_block_per_stage(2), tie_embeddings=True)
    data = make_data(4)
    ref = single_process(data, 4, clip=0.5, gcfg=gcfg)
    got = run_losses(replicated(2, 2, 2, ["sync"] * 4, data, clip=0.5, gcfg=gcfg), 4)
    assert rel_close(got, ref, 1e-5), (got, ref)


def test_two_sync_replicas_are_one_replica_with_the_same_batch():
    data = make_data(5)
    one = replicated(1, 2, 2, ["sync"] * 5, data, clip=1.0)
    two = replicated(2, 2, 2, ["sync"] * 5, data, clip=1.0)
    a, b = [one.run_step(t) for t in range(5)], [two.run_step(t) for t in range(5)]
    assert rel_close([r.loss for r in b], [r.loss for r in a], 1e-5)
    assert rel_close([r.grad_norm for r in b], [r.grad_norm for r in a], 1e-5)
    assert [r.time_s for r in b] == [r.time_s for r in a]  # per replica the same pipeline (no all-reduce cost)
    assert two.memory() == one.memory()  # per replica the same ledger


class ReplicatedLoop(DelayedLoop):
    """The delayed-gradient loop with R replicas: every replica's microbatch i of step t uses the
    version the table gives microbatch i; the stage applies the mean of the R replicas' gradients."""

    def __init__(self, R, *args, **kw):
        super().__init__(*args, **kw)
        self.R = R

    def step(self, t, x, y) -> float:
        R, m = self.R, self.m
        mb = B // (R * m)
        grads = [[[torch.zeros_like(q) for q in w] for w in self.live] for _ in range(R)]
        losses = [self.microbatch(t * m + i, x[(r * m + i) * mb:(r * m + i + 1) * mb],
                                  y[(r * m + i) * mb:(r * m + i + 1) * mb], grads[r])
                  for r in range(R) for i in range(m)]
        for s in range(self.p):
            self.update(s, t, [sum(g[s][k] for g in grads) / R for k in range(len(self.live[s]))])
        return sum(losses) / len(losses)


@pytest.mark.parametrize("p,m,plan,rule", [(3, 2, "aaaaa", "stash"), (2, 2, "ssaaas", "stash"),
                                           (3, 2, "aaaa", "latest")])
def test_async_replicas_are_the_delayed_gradient_loop_on_the_mean_gradient(p, m, plan, rule):
    data = make_data(len(plan))
    loop = ReplicatedLoop(2, p, m, plan, rule, gcfg=one_block_per_stage(p))
    ref = [loop.step(t, *data[t]) for t in range(len(plan))]
    rt = replicated(2, p, m, [PHASE[c] for c in plan], data, weights=rule)
    got = run_losses(rt, len(plan))
    assert rel_close(got, ref, 1e-5), (got, ref)
    for s, ex in enumerate(rt.executors):
        for a, b in zip(ex.params, loop.versions[s][-1]):
            assert torch.allclose(a.detach(), b, rtol=1e-4, atol=1e-5), f"stage {s} weights"


def test_async_replicas_with_clipping_stay_bitwise_identical():
    """Clipping by the async stream's estimate of the global norm (gossiped tables) sees the mean
    gradient in every replica, whichever order the walk visits them in."""
    data = make_data(6)
    phases = ["async"] * 3 + ["sync"] + ["async"] * 2
    runs = [replicated(2, 3, 2, phases, data, clip=0.05, order=o) for o in ("forward", "reverse")]
    losses = [run_losses(rt, 6) for rt in runs]
    assert losses[0] == losses[1]
    for rt in runs:
        for s in range(3):
            for a, b in zip(rt.replica_executors[0][s].params, rt.replica_executors[1][s].params):
                assert torch.equal(a, b)
    one = replicated(1, 3, 2, phases, data, clip=0.05)
    assert not rel_close(run_losses(one, 6), losses[0], 1e-3)  # (not one replica's half batch)


def test_state_of_replicas_holds_one_copy_of_the_weights_and_resumes_exactly():
    data = make_data(7)
    phases = ["async"] * 7
    whole = replicated(2, 3, 2, phases, data, clip=0.05)
    expect = run_losses(whole, 7)
    cut = replicated(2, 3, 2, phases, data, clip=0.05)
    run_losses(cut, 3)
    state = cut.state_dict()
    assert all("params" not in st and "optimizer" not in st for st in state["replicas"][0]["stages"])
    assert any(st["inflight"] for st in state["replicas"][0]["stages"])  # microbatches in flight at the cut
    back = replicated(2, 3, 2, phases, data, clip=0.05)
    back.load_state_dict(state)
    assert [back.run_step(t).loss for t in range(3, 7)] == expect[3:]
    with pytest.raises(ValueError, match="replicas"):
        replicated(1, 3, 2, phases, data).load_state_dict(state)


@pytest.mark.slow
def test_a_run_with_replicas_resumes_from_its_checkpoint(tmp_path):
    """Through the CLI: metrics of a run resumed from its step-3 checkpoint are the whole run's."""
    from procs import cut_at
    from test_checkpoint import records

    whole = tmp_path / "whole"
    over = ["pipeline.stages=2", "pipeline.microbatches=2", "pipeline.replicas=2", "schedule=pipedream",
            "train.max_steps=6", "train.checkpoint_every=3", "train.eval_every=3"]
    assert main(["train", *TINY, *over, f"hydra.run.dir={whole}"]) == 0
    cut = cut_at(whole, tmp_path / "cut", 3)
    assert main(["train", f"train.resume={cut}"]) == 0
    assert records(cut) == records(whole)
    assert json.loads((whole / "summary.json").read_text())["replicas"] == 2
    assert "replicas=2" in (whole / "run.log").read_text().splitlines()[0]


def test_a_checkpoint_from_before_replicas_resumes_with_one():
    from adapipe_cli import checkpoint

    old = {"pipeline": {"stages": 2}}
    assert checkpoint.config_differences(old, {"pipeline": {"stages": 2, "replicas": 1, "dp_latency_s": 0.0}}) == []
    assert checkpoint.config_differences(old, {"pipeline": {"stages": 2, "replicas": 2}}) == [
        "pipeline.replicas=None in the checkpoint, 2 now"]


@pytest.mark.parametrize("overrides,message", [
    (["pipeline.replicas=2", "pipeline.microbatches=8"], "not divisible by pipeline.replicas x pipeline.microbatches"),
    (["pipeline.replicas=0"], "pipeline.replicas must be at least 1"),
])
def test_bad_replica_settings_are_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    assert main(["train", *TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("schedule,stages,replicas,gpus,kind", [
    ("interleaved", 2, 2, 4, "dist"),  # a GPU per worker: chunks with replicas run on dist
    ("interleaved", 2, 2, 3, "local"),  # one GPU short
    ("1f1b", 2, 2, 4, "dist"),
    ("interleaved", 1, 2, 8, "local"),  # one stage: a worker would send to itself
])
def test_auto_runtime_picks_dist_when_there_is_a_gpu_per_worker(schedule, stages, replicas, gpus, kind,
                                                                make_cfg, monkeypatch):
    from adapipe_cli.train.setup import runtime_kind
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = make_cfg(f"schedule={schedule}", f"pipeline.stages={stages}", f"pipeline.replicas={replicas}",
                   "pipeline.runtime=auto", "pipeline.microbatches=2")
    assert runtime_kind(cfg) == kind


# -- the all-reduce on the clock and in the simulator ---------------------------------------------
from adapipe_cli.simulator.clock import ALLREDUCE, AllReduceModel  # noqa: E402
from adapipe_cli.simulator.simulate import simulate  # noqa: E402


def all_gather(R, nbytes, bandwidth, latency):
    """What dist runs (DistAllReduce): a ring all_gather of the whole gradient, R-1 messages of n
    bytes per rank, each paying the latency."""
    return (R - 1) * (nbytes / bandwidth + latency)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_allreduce_cost_is_the_all_gather_closed_form(R):
    assert AllReduceModel(R, 1e9, 1e-5).time(3e6) == pytest.approx(all_gather(R, 3e6, 1e9, 1e-5), rel=1e-12)
    assert AllReduceModel(R, 0.0, 0.25).time(3e6) == (R - 1) * 0.25  # infinite bandwidth: latency only
    # a ring all-reduce (2 (R-1)/R n bytes) would cost the same at R=2 only
    ring = 2 * (R - 1) / R * 3e6 / 1e9
    assert (AllReduceModel(R, 1e9, 0.0).time(3e6) == pytest.approx(ring)) == (R in (1, 2))


@pytest.mark.parametrize("phase,steady", [("sync", lambda p, m, F, B: (m + p - 1) * (F + B)),
                                          ("async", lambda p, m, F, B: m * (F + B))])
def test_simulated_step_time_adds_the_allreduce_before_each_update(phase, steady):
    """1F1B's flushed step (m + p - 1)(F + B) and PipeDream's steady m (F + B) each grow by the
    all-reduce: every stage's update waits for its own (sync: all at once, before the barrier)."""
    p, m, F, Bk, steps = 3, 4, 1.0, 2.0, 24
    spec = ScheduleSpec(p, m)
    prof = CostProfile.uniform(p, F, Bk)
    ar = all_gather(2, 8e6, 1e8, 0.05)
    base = simulate(spec, Plan(steps, [phase] * steps), prof)
    res = simulate(spec, Plan(steps, [phase] * steps), prof, allreduce=AllReduceModel(2, 1e8, 0.05),
                   grad_bytes=[8e6] * p)
    assert base.step_time == pytest.approx(steady(p, m, F, Bk))
    assert res.step_time == pytest.approx(steady(p, m, F, Bk) + ar)
    boxes = [b for b in res.timeline if b[1] == ALLREDUCE]
    updates = [b for b in res.timeline if b[1] == "U"]
    assert len(boxes) == len(updates) == p * steps
    assert all(b[5] - b[4] == pytest.approx(ar) for b in boxes)
    one = simulate(spec, Plan(steps, [phase] * steps), prof, allreduce=AllReduceModel(1, 1e8, 0.05), grad_bytes=[8e6] * p)
    assert one.timeline == base.timeline and one.step_time == base.step_time  # R=1 costs nothing


@pytest.mark.parametrize("phases", [["sync"] * 4, ["async"] * 6, ["sync", "sync", "async", "async", "sync"]])
def test_local_runtime_clock_with_replicas_is_the_simulator(phases):
    data = make_data(len(phases))
    model = AllReduceModel(2, 1e6, 0.3)
    rt = replicated(2, 2, 2, phases, data, allreduce=model)
    times = [rt.run_step(t).time_s for t in range(len(phases))]
    grad_bytes = [float(sum(q.numel() * q.element_size() for q in ex.params)) for ex in rt.executors]
    sim = simulate(ScheduleSpec(2, 2), Plan(len(phases), phases), CostProfile.uniform(2), allreduce=model,
                   grad_bytes=grad_bytes)
    assert times == pytest.approx(sim.update_end, rel=1e-12)
    no_cost = simulate(ScheduleSpec(2, 2), Plan(len(phases), phases), CostProfile.uniform(2))
    assert times[-1] > no_cost.update_end[-1] + 0.6  # (the all-reduce is on the clock)


def test_simulate_setup_of_replicas():
    from adapipe_cli.cli.compose import compose_or_fail
    from adapipe_cli.cli.simulate import prepare, summary_text
    from adapipe_cli.config.schema import register_simulate_config

    register_simulate_config()
    cfg = compose_or_fail(["pipeline.stages=2", "pipeline.replicas=4", "pipeline.dp_bandwidth=1e6", "grad_bytes=3e6"],
                          config_name="simulate", check=False)
    setup = prepare(cfg)
    res = simulate(setup.spec, setup.plan, setup.profile, allreduce=setup.allreduce, grad_bytes=setup.grad_bytes)
    assert res.allreduce_s == [pytest.approx(all_gather(4, 3e6, 1e6, 0.0))] * 2
    assert "all-reduce       9 s per update" in summary_text("1f1b", setup, res)


@pytest.mark.slow
def test_simulate_command_with_replicas(tmp_path, capsys):
    args = ["simulate", "pipeline.stages=2", "pipeline.microbatches=2", "pipeline.replicas=4", "pipeline.dp_latency_s=0.5",
            "steps=4", f"hydra.run.dir={tmp_path}"]
    assert main(args) == 0
    out = json.loads((tmp_path / "simulation.json").read_text())
    assert out["allreduce_s"] == [1.5, 1.5]  # R-1 latencies
    assert out["step_time"] == pytest.approx(3 * 3.0 + 1.5)  # (m + p - 1)(F + B) + the all-reduce
    assert "all-reduce       1.5 s per update" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 0
