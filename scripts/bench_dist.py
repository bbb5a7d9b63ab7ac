"""Distributed runtime benchmarks: 2 and 4 stages over gloo, one thread per worker.

1. adapipe's dist step time / torch.distributed.pipelining's for the same schedule, same model,
   batch, microbatches, optimizer (AdamW) and clipping by the global gradient norm (goal <= 1.0
   at the median of the repeats, printed with its 95% bootstrap interval over the paired
   repeats: with 5 pairs about their range, what so few can say): 1F1B against ``Schedule1F1B``; ZB-H1 against
   ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB1P: 1F1B's memory, each
   backward split into I and W, the W deferred into the bubbles); interleaved 1F1B
   (``--chunks`` per worker) against ``ScheduleInterleaved1F1B`` with as many stages per rank.
2. adapipe's dist step time (1F1B, PipeDream and an AdaPipe run) / the simulator's prediction
   from the run's own profile.json: its measured costs and the link its workers measured at
   start-up, timing the phases the run actually had (goal within 5%); again from the same
   profile with the workers sharing the machine's cores (``simulator.shared``: each action at its
   start-up CPU seconds, the cores the workers had, gloo's CPU per message end); again from the in-run
   profile (``profile_in_run.json``: each action at what it cost in a run) of another run, this
   repeat's 1F1B run (for 1F1B, the repeat before's; for interleaved, whose profile has a row per
   chunk, the repeat before's interleaved run): costs measured as a pipeline computes, on the same
   machine minutes apart, for a schedule that was not run to measure them where it can be one
   (1F1B's rows are whole stages); and each run's peak memory
   (RSS) of the driver and of each worker, from its summary.json (each run is an ``adapipe
   train`` process of its own, so the driver's peak is that run's); and at the run's own in-run
   costs with each action varying as the run's did (``simulator.jitter``: how much of what is
   left is the stages waiting on each other's slow actions), and from its own start-up profile
   with each action varying as the profile's calls did, and sharing the cores with each action's
   CPU seconds varying as the profile's calls' CPU seconds did.
3. The transport's cost per message: a 1 MB activation forward and its gradient back through
   DistTransport (as a worker uses it: receives posted ahead, buffers given back) against a bare
   dist.send / dist.recv pair (ping-pong, one way; paired short rounds run back to back; goal at
   most 10% over).
4. With --replicas R: R replicas of the pipeline (R x p workers, pipeline.replicas=R), each on the
   R=1 run's batch (train.batch_size R x --batch: the same work per worker): the step time against
   the simulator's prediction from the run's own profile, with the all-reduce dist runs (an
   all_gather of each stage's gradient, (R-1) n bytes per rank: ``AllReduceModel``) over the link
   the workers measured (goal within 15%), and against R=1 (the same schedule, the same repeat).

Step times are the mean over the steady steps (the first and last few and evaluations left out).
Each measurement is repeated, interleaved with the others (the speed of shared cores varies from
minute to minute); the best and the median of the repeats are printed. Run:
python scripts/bench_dist.py [--stages 2 4] [--model gpt-nano] [--batch 16] [--microbatches 4]
[--steps 100] [--repeats 5] [--rounds 60] [--schedules 1f1b zbh1 interleaved pipedream adapipe]
[--chunks 2] [--replicas 2] [--replica-schedules 1f1b pipedream]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from adapipe_cli.cli import signals  # noqa: E402
from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.model.build import make_stages, model_config  # noqa: E402
from adapipe_cli.runtime.action_times import in_run_profile  # noqa: E402
from adapipe_cli.runtime.device import usable_cores  # noqa: E402
from adapipe_cli.runtime.dist import worker_context  # noqa: E402
from adapipe_cli.runtime.lifeline import stop_processes  # noqa: E402
from adapipe_cli.schedules import Plan  # noqa: E402
from adapipe_cli.schedules.choice import (follows_held_out, microbatch_size, schedule_choice, signal_rows,  # noqa: E402
                                         virtual_stages)
from adapipe_cli.simulator.clock import AllReduceModel, CostProfile, LinkModel  # noqa: E402
from adapipe_cli.simulator.jitter import cv_from_profile, cv_from_table, simulate_jitter  # noqa: E402
from adapipe_cli.simulator.shared import cpu_profile, simulate_shared, simulate_shared_jitter  # noqa: E402
from adapipe_cli.simulator.simulate import simulate  # noqa: E402
from adapipe_cli.sweep.bootstrap import fmt_ci, median_ci  # noqa: E402
from adapipe_cli.train.build import pick_sync  # noqa: E402

SKIP = 5  # steps left out at either end of a run (fewer in a short run: a quarter of it)
ADAPIPE = "heuristic.plan=[[sync,10],[async,20],[sync,10],[async,null]]"  # an AdaPipe run with switches
# adapipe's sync schedules and torch's of the same kind (see the module docstring)
REFERENCES = ("1f1b", "interleaved")  # predicted from the repeat before's run of their own (the others from 1F1B's)
TORCH = {"1f1b": "Schedule1F1B", "zbh1": "ScheduleInterleavedZeroBubble", "interleaved": "ScheduleInterleaved1F1B"}


def overrides(args, schedule: str, replicas: int = 1) -> list[str]:
    extra = [ADAPIPE, "heuristic=fixed"] if schedule == "adapipe" else []
    extra += [f"pipeline.replicas={replicas}"] if replicas > 1 else []
    extra += [f"schedule.chunks={args.chunks}"] if schedule == "interleaved" else []
    return [f"model={args.model}", f"schedule={schedule}", f"pipeline.stages={args.stages}",
            f"pipeline.microbatches={args.microbatches}", f"train.batch_size={args.batch * replicas}",
            f"train.max_steps={args.steps}", f"train.eval_every={args.steps}", "train.progress=off",
            "pipeline.threads=1", "pipeline.runtime=dist", "optim.warmup_steps=2", *extra,
            *args.set]


def window(n: int) -> tuple[int, int]:
    """(lo, hi): the steady steps' ends, ``min(SKIP, n // 4)`` steps left out at either end."""
    skip = min(SKIP, n // 4)
    return skip, max(skip + 1, n - 1 - skip)


def finished_run(out: Path) -> tuple[int, int, float, CostProfile, Plan, LinkModel]:
    """A finished run's steady window (:func:`window`), its mean step over it (wall seconds), its
    profile, the phases it ran and the link its workers measured."""
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    lo, hi = window(len(steps))
    prof = CostProfile.load(out / "profile.json")
    return (lo, hi, (steps[hi]["time_s"] - steps[lo]["time_s"]) / (hi - lo), prof,
            Plan(len(steps), [r["phase"] for r in steps]), LinkModel.choose(0.0, 0.0, prof))


class RunResult(NamedTuple):
    """One dist run's measured steady step and its predictions (seconds; None: not available). A
    bench.json stores it as a list in this order; one written before a field existed ends early."""
    measured: float  # the mean steady step of the run
    own: float  # the simulator's, from the run's own profile, link and phases (with replicas, the
    # all-reduce, an all_gather of each stage's parameter bytes, over that link)
    went: dict | None = None  # :func:`where_time_went` of its summary.json
    in_run: float | None = None  # each action at its in-run cost, :func:`in_run_profile`
    other: float | None = None  # from another run's profile_in_run.json (``reference``), where it
    # has as many stages: costs measured as a pipeline computes, but not this one's
    shared: float | None = None  # the own profile with the workers sharing the cores, :func:`shared_prediction`
    in_run_varying: float | None = None  # at the in-run costs, each action varying as the run's did
    # (:func:`.jitter.simulate_jitter` with :func:`.jitter.cv_from_table`; None without the spread)
    own_varying: float | None = None  # the own profile, each action varying as its start-up calls
    # did (:func:`.jitter.cv_from_profile`)
    shared_varying: float | None = None  # sharing the cores, each action's CPU seconds varying as
    # its start-up calls' did (``meta["cpu_cv"]``; none before 2026-12-05, later)


def run_child(cmd: list[str], grace_s: float = 30.0) -> None:
    """Run ``cmd`` (stdout discarded); raise CalledProcessError if it fails. Interrupted (Ctrl-C, or
    SIGTERM, which the script's entry point turns into one), the child gets SIGTERM, which an
    ``adapipe train`` takes as Ctrl-C (it stops its workers), and SIGKILL if it is still there
    after ``grace_s``: a stopped benchmark leaves no run behind."""
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        code = child.wait()
    except BaseException:
        child.terminate()
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def adapipe_run(args, schedule: str, out: Path, replicas: int = 1,
                reference: Path | None = None) -> RunResult:
    """A dist run of ``schedule`` in ``out`` and what the simulator predicts for it (:class:`RunResult`)."""
    cfg = compose_config(overrides(args, schedule, replicas))
    # (a process of its own: the driver's peak RSS in summary.json is then this run's alone)
    run_child([sys.executable, "-m", "adapipe_cli.cli.main", "train", *overrides(args, schedule, replicas),
               f"hydra.run.dir={out}"])
    lo, hi, measured, prof, plan, link = finished_run(out)
    allreduce = AllReduceModel(replicas, link.bandwidth, link.latency) if replicas > 1 else None
    table = json.loads((out / "summary.json").read_text())["action_times"]
    spec = pick_sync(schedule_choice(cfg), prof, link, cfg.schedule.mitigation, allreduce).spec  # (as the run picked)
    # AdaPipe's held-out signal after each update (its run evaluates it, heuristic=fixed too): on the clock
    held_out = follows_held_out(cfg)

    def predict(costs: CostProfile, cv: dict | None = None) -> float:
        """The steady step from ``costs``; with ``cv``, each action drawn around its cost (simulator.jitter)."""
        signal = costs.signal_costs(signal_rows(cfg), microbatch_size(cfg)) if held_out else None
        kw = dict(mitigations=list(cfg.schedule.mitigation), allreduce=allreduce, signal=signal)
        if cv is not None:
            return simulate_jitter(spec, plan, costs, cv, window=(lo, hi), link=link, **kw)[0]
        sim = simulate(spec, plan, costs, link, record=False, **kw)
        return (sim.update_end[hi] - sim.update_end[lo]) / (hi - lo)

    # (the second prediction takes the steady steps' own action costs: what is left between it and
    # the measured step is the schedule's timing, the link and the loop, not the profile's costs;
    # the action table's window is steps warm_steps.. to the end, a little wider than ``measured``'s)
    in_run = in_run_profile(table, prof) if table else None
    other = CostProfile.load(reference) if reference is not None else None
    if other is not None and other.stages != prof.stages:  # (whole stages for virtual ones, or the reverse: left out)
        other = None
    # and at the in-run costs with each action varying as the run's did (their run_sd_s), and at
    # the start-up profile's with its calls' spread
    spread = in_run is not None and any("run_sd_s" in r for r in table["actions"])
    own_cv = cv_from_profile(prof)
    return RunResult(measured, predict(prof), where_time_went(table), predict(in_run) if in_run else None,
                     predict(other) if other else None,
                     shared_prediction(cfg, spec, plan, prof, link, (lo, hi), replicas, allreduce, held_out),
                     predict(in_run, cv_from_table(table, prof.stages)) if spread else None,
                     predict(prof, own_cv) if own_cv else None,
                     shared_prediction(cfg, spec, plan, prof, link, (lo, hi), replicas, allreduce, held_out, varying=True))


def shared_prediction(cfg, spec, plan, prof: CostProfile, link: LinkModel, window: tuple[int, int], replicas: int,
                      allreduce: AllReduceModel | None, held_out: bool, varying: bool = False) -> float | None:
    """The steady step predicted from the run's own start-up profile with its workers sharing the
    cores they ran on (:func:`adapipe_cli.simulator.shared.simulate_shared`): each action at its
    start-up CPU seconds, gloo's threads at the link's CPU per message end; None for a profile
    without them (a run of a version before 2026-12-05, or not on gloo). ``held_out``: the run
    evaluates AdaPipe's held-out signal after every update (:func:`adapipe_run`'s). ``varying``:
    each action's CPU seconds drawn around their mean with the spread of the start-up calls' CPU
    seconds (``meta["cpu_cv"]``; None for a profile without it), :func:`.shared.simulate_shared_jitter`."""
    cpu, host = cpu_profile(prof), prof.meta.get("host")
    cv = cv_from_profile(prof, "cpu_cv") if varying else None
    if cpu is None or not host or (varying and not cv):
        return None
    signal = cpu.signal_costs(signal_rows(cfg), microbatch_size(cfg)) if held_out else None
    kw = dict(replicas=replicas, message_cpu_s=float(prof.link.get("thread_cpu_s", 0.0)), link=link,
              mitigations=list(cfg.schedule.mitigation), allreduce=allreduce, signal=signal, window=window)
    if cv:
        return simulate_shared_jitter(spec, plan, cpu, host["cores"], cv, **kw)[0]
    return simulate_shared(spec, plan, cpu, host["cores"], **kw).step_time


def where_time_went(table: dict | None) -> dict:
    """From a run's ``action_times``: per action kind, the run's seconds over the profile's charge
    for the same actions (all stages: sum n run_s / sum n profiled_s); ``cpu``: their main-thread CPU
    over their wall time (below 1: the worker was preempted while computing); ``sd``: an action's
    standard deviation over its mean (all kinds, weighted by their time); ``loop``: the share
    of a step that the workers spend outside actions, transport waits included (gates, phases,
    reports, the loop itself; mean over the ranks)."""
    if not table:
        return {}
    out, rows = {}, table["actions"]
    for kind in ("F", "B", "I", "W", "U"):
        mine = [r for r in rows if r["kind"] == kind and r.get("profiled_s")]
        if mine:
            out[kind] = sum(r["count"] * r["run_s"] for r in mine) / sum(r["count"] * r["profiled_s"] for r in mine)
    out["cpu"] = sum(r["count"] * r["cpu_s"] for r in rows) / max(1e-12, sum(r["count"] * r["run_s"] for r in rows))
    timed = [r for r in rows if "run_sd_s" in r]  # (a run of a version before 2026-12-05, later, has none)
    if timed:  # how much an action varies: its standard deviation over its mean, weighted by the actions
        out["sd"] = sum(r["count"] * r["run_sd_s"] for r in timed) / max(1e-12, sum(r["count"] * r["run_s"] for r in timed))
    ranks = table["ranks"]
    out["loop"] = sum((r["between_s"] + r["report_s"] + r["wait_driver_s"]) / r["step_s"] for r in ranks) / len(ranks)
    return out


def peak_rss(out: Path) -> dict:
    """{driver: MB, workers: [MB per worker, by rank]}: peak RSS of a run in ``out``, from its summary.json
    (one row per stage, several per worker with interleaving)."""
    summary = json.loads((out / "summary.json").read_text())
    workers = {m["rank"]: m["peak_rss_mb"] for m in summary["memory"]}
    return {"driver": summary["driver_peak_rss_mb"], "workers": [workers[r] for r in sorted(workers)]}


# -- torch.distributed.pipelining ----------------------------------------------------------------
def _torch_rank(rank: int, port: int, args_d: dict, schedule: str, out: str) -> None:
    from torch.distributed import pipelining

    from adapipe_cli.data import build_data
    from adapipe_cli.model import lm_loss

    args = argparse.Namespace(**args_d)
    p = args.stages
    torch.set_num_threads(1)
    cfg = compose_config(overrides(args, schedule))
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=p)
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    n = virtual_stages(cfg)
    mine = list(range(rank, n, p))  # chunk c on rank c % p, as adapipe places them
    modules, opts = make_stages(cfg, model_config(cfg, data.vocab_size), which=mine)
    stages = [pipelining.PipelineStage(mod, c, n, torch.device("cpu")) for mod, c in zip(modules, mine)]
    cls = getattr(pipelining, TORCH[schedule])
    sched = cls(stages[0] if cls is pipelining.Schedule1F1B else stages, n_microbatches=args.microbatches,
                loss_fn=lm_loss)
    params = [q for mod in modules for q in mod.parameters()]

    def step(t: int) -> None:
        x, y = data.train_batch(t, args.batch)
        if 0 in mine:
            sched.step(x, **({"target": y} if n - 1 in mine else {}))
        elif n - 1 in mine:
            sched.step(target=y)
        else:
            sched.step()
        sq = torch.stack([torch.linalg.vector_norm(q.grad) for q in params]).pow(2).sum().reshape(1)
        dist.all_reduce(sq)  # clip by the global norm, as adapipe's synchronous update does
        coef = min(1.0, cfg.optim.grad_clip / (float(sq.sqrt()) + 1e-6))
        for q in params:
            q.grad.mul_(coef)
        for opt in opts:
            opt.step(1.0)

    ends = []
    dist.barrier()
    t0 = time.perf_counter()
    for t in range(args.steps):
        step(t)
        ends.append(time.perf_counter() - t0)
    lo, hi = window(len(ends))
    Path(out, f"torch{rank}.json").write_text(json.dumps((ends[hi] - ends[lo]) / (hi - lo)))
    dist.destroy_process_group()


def ranks(n: int, target, *args) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = worker_context()
    procs = [ctx.Process(target=target, args=(r, store.port, *args)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except BaseException:  # interrupted: no rank outlives the benchmark
        stop_processes(procs, 10.0)
        raise
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a benchmark rank failed: {[p.exitcode for p in procs]}")


def torch_step_time(args, schedule: str, out: Path) -> float:
    """Torch's step time for adapipe's sync ``schedule`` (:data:`TORCH`): the slowest rank's."""
    ranks(args.stages, _torch_rank, vars(args), schedule, str(out))
    return max(json.loads(Path(out, f"torch{r}.json").read_text()) for r in range(args.stages))


# -- the transport ---------------------------------------------------------------------------------
def _transport_rank(rank: int, port: int, n: int, out: str) -> None:
    from adapipe_cli.runtime.dist_transport import DistTransport, build_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=2)
    shape = (4, 256, 256)  # 1 MiB of fp32
    bare_groups, our_groups = build_groups(2, False), build_groups(2, False)  # (ours posts receives ahead)
    tr = DistTransport(rank, 2, our_groups, lambda c, k: shape, torch.device("cpu"), ahead=True, window=8)
    x = torch.randn(shape)

    def ours(i: int) -> None:  # an activation forward, its gradient back, as the executor does
        if rank == 0:
            tr.send("act", 0, 1, i, x)
            tr.release("grad", tr.recv("grad", 1, 0, i))
        else:
            y = tr.recv("act", 0, 1, i)
            tr.send("grad", 1, 0, i, y)
            tr.release("act", y)

    def bare(i: int) -> None:
        if rank == 0:
            dist.send(x, 1, group=bare_groups[("act", 0)])
            dist.recv(x, 1, group=bare_groups[("grad", 0)])
        else:
            dist.recv(x, 0, group=bare_groups[("act", 0)])
            dist.send(x, 0, group=bare_groups[("grad", 0)])

    # short rounds of each, back to back, so that both see the same speed of the machine
    rounds: list[tuple[float, float]] = []
    for _ in range(n):
        pair = []
        for fn in (bare, ours):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(20):
                fn(i)
            pair.append((time.perf_counter() - t0) / 40)  # one way
        rounds.append(tuple(pair))
    if rank == 0:
        Path(out, "transport.json").write_text(json.dumps(rounds))
    tr.ahead = False  # one last message each way fills the receives posted ahead
    ours(20)
    tr.wait_sends()
    dist.destroy_process_group()


def transport_overhead(n: int, out: Path) -> tuple[float, float, float]:
    """(median one-way time of a bare message, of a DistTransport message, median of their
    difference over paired rounds)."""
    ranks(2, _transport_rank, n, str(out))
    rounds = json.loads(Path(out, "transport.json").read_text())
    return (statistics.median(b for b, _ in rounds), statistics.median(o for _, o in rounds),
            statistics.median(o - b for b, o in rounds))


def show(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>17}  {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=60, help="paired rounds of 20 messages each way (0: skip)")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zbh1", "interleaved", "pipedream", "adapipe"])
    ap.add_argument("--chunks", type=int, default=2, help="model chunks per worker of schedule=interleaved")
    ap.add_argument("--replicas", type=int, nargs="*", default=[], help="replica counts R > 1 to run (section 4)")
    ap.add_argument("--replica-schedules", nargs="+", default=["1f1b", "pipedream"])
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run, adapipe's and torch's (e.g. pipeline.profile_reps=30)")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--report", default=None, help="print the table of a bench.json that a run wrote, run nothing")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be at least 4 (a quarter of a run at either end is left out of its step time)")
    if args.report:  # (a run stopped early keeps the repeats it finished)
        saved = json.loads(Path(args.report).read_text())
        runs = {(int(k.split("/")[0]), k.split("/")[1]): v for k, v in saved["runs"].items()}
        return report(runs, saved["stages"], saved["schedules"], saved["header"], saved.get("transport"),
                      {(int(k.split("/")[0]), k.split("/")[1]): v for k, v in saved.get("memory", {}).items()},
                      saved.get("replicas", []), saved.get("replica_schedules", []))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_dist_"))
    out.mkdir(parents=True, exist_ok=True)
    depths = list(args.stages)
    header = (f"{args.model}, stages {depths}, gloo, 1 thread per worker, batch {args.batch}, {args.microbatches} "
              f"microbatches, {args.steps} steps, {args.repeats} repeats (runs in {out})")
    if args.set:
        header += "; " + " ".join(args.set)
    replicas, rsched = [r for r in args.replicas if r > 1], args.replica_schedules if args.replicas else []
    cores = usable_cores()  # (as the runtime counts them for its warning)
    if cores < max(depths):  # (torch's ranks share them alike: the ratio stays fair, measured/simulated not)
        header += (f"; only {cores} cores for up to {max(depths)} workers: they share them, in adapipe's runs "
                   f"and torch's alike, the simulator gives each its own device")
    if replicas:
        header += f"; replicas {replicas} of {rsched}, batch {args.batch} per replica"
        most = max(replicas) * max(depths)
        if cores < most:  # the simulator gives every worker its own device
            header += f" (only {cores} cores for up to {most} workers: they share them, the simulator assumes they do not)"
    twins = [s for s in args.schedules if s in TORCH]  # the schedules torch has too
    blocks = compose_config([f"model={args.model}"]).model.n_layer
    # interleaving cuts p x chunks chunks of at least one block each: deeper pipelines are left out
    fits = lambda p, s: s != "interleaved" or p * args.chunks <= blocks  # noqa: E731
    if any(not fits(p, s) for p in depths for s in [*args.schedules, *rsched]):
        header += f"; interleaved left out where stages x {args.chunks} chunks > the model's {blocks} blocks"
    runs = {(p, s): [] for p in depths for s in [*(f"torch-{s}" for s in twins), *args.schedules]}
    # (p, schedule, repeat) -> the profile_in_run.json of that repeat's 1F1B or interleaved run
    in_run: dict[tuple[int, str, int], Path] = {}
    runs.update({(p, replica_key(s, r)): [] for p in depths for s in rsched for r in [1, *replicas]})
    memory = {(p, s): [] for p in depths for s in [*args.schedules, *(replica_key(s, r) for s in rsched for r in [1, *replicas])]}  # peak_rss() of each repeat
    transport = None

    def save() -> None:
        (out / "bench.json").write_text(json.dumps({
            "runs": {f"{p}/{s}": v for (p, s), v in runs.items()}, "stages": depths, "schedules": args.schedules,
            "header": header, "transport": transport, "memory": {f"{p}/{s}": v for (p, s), v in memory.items()},
            "replicas": replicas, "replica_schedules": rsched}))

    for i in range(args.repeats):
        for p in depths:
            args.stages = p
            for schedule in [s for s in twins if fits(p, s)]:
                runs[(p, f"torch-{schedule}")].append(torch_step_time(args, schedule, out))
            for schedule in [s for s in args.schedules if fits(p, s)]:
                # another run's in-run costs: this repeat's 1F1B run, or for 1F1B and interleaved (a
                # row per chunk) the repeat before's run of the same schedule (a file this
                # invocation wrote, not one left in a reused --out)
                ref = in_run.get((p, schedule, i - 1) if schedule in REFERENCES else (p, "1f1b", i))
                runs[(p, schedule)].append(adapipe_run(args, schedule, out / f"p{p}-{schedule}{i}", reference=ref))
                if schedule in REFERENCES and (out / f"p{p}-{schedule}{i}" / "profile_in_run.json").exists():
                    in_run[(p, schedule, i)] = out / f"p{p}-{schedule}{i}" / "profile_in_run.json"
                memory[(p, schedule)].append(peak_rss(out / f"p{p}-{schedule}{i}"))
                save()
            for schedule in [s for s in rsched if fits(p, s)]:
                for r in [1, *replicas]:  # (R=1 again, next to R > 1: the same minute's speed)
                    key = replica_key(schedule, r)
                    runs[(p, key)].append(adapipe_run(args, schedule, out / f"p{p}-{key}-{i}", replicas=r))
                    memory[(p, key)].append(peak_rss(out / f"p{p}-{key}-{i}"))
                    save()
    if args.rounds:
        transport = transport_overhead(args.rounds, out)
        save()
    report(runs, depths, args.schedules, header, transport, memory, replicas, rsched)


def replica_key(schedule: str, replicas: int) -> str:
    return f"{schedule}-R{replicas}"


def rss_row(repeats: list[dict]) -> str:
    """``driver 310 | workers 402 398``: median over the repeats of each process's peak RSS (MB)."""
    med = lambda xs: f"{statistics.median(xs):.0f}"  # noqa: E731
    workers = [med([r["workers"][w] for r in repeats]) for w in range(len(repeats[0]["workers"]))]
    return f"driver {med([r['driver'] for r in repeats])} | workers {' '.join(workers)}"


def report(runs: dict, depths: list[int], schedules: list[str], header: str, transport, memory=None,
           replicas: list[int] = (), replica_schedules: list[str] = ()) -> None:
    rows = []
    fmt = lambda xs: f"{min(xs):.3f} / {statistics.median(xs):.3f}" if xs else "-"  # noqa: E731
    for p in depths:
        for schedule in schedules:
            # (a bench.json from before the zero-bubble and interleaved twins names torch's 1F1B "torch")
            torch_t = runs.get((p, f"torch-{schedule}")) or (runs.get((p, "torch")) if schedule == "1f1b" else None)
            if torch_t:
                rows.append((f"p={p}: {schedule} step, torch {TORCH[schedule]} (ms)", fmt([1e3 * t for t in torch_t]),
                             "best / median"))
            rs = [RunResult(*r) for r in runs[(p, schedule)]]
            if not rs:  # (left out at this depth: interleaved with too few blocks)
                continue
            rows.append((f"p={p}: {schedule} step, adapipe dist (ms)", fmt([1e3 * r.measured for r in rs]), ""))
            rows.append((f"p={p}: {schedule} step, simulated (ms)", fmt([1e3 * r.own for r in rs]), "its own profile"))
            rows.append((f"p={p}: {schedule} measured / simulated", fmt([r.measured / r.own for r in rs]), "goal within 5%"))
            own_varying = [r.measured / r.own_varying for r in rs if r.own_varying]  # (none before 2026-12-05, later)
            if own_varying:
                rows.append((f"p={p}: {schedule} measured / simulated, varying", fmt(own_varying),
                             "its own profile, each action drawn around its cost with the start-up calls' spread; "
                             "goal within 5%"))
            shared = [r.measured / r.shared for r in rs if r.shared]  # (a bench.json from before it has none)
            if shared:
                rows.append((f"p={p}: {schedule} measured / simulated, sharing the cores", fmt(shared),
                             "its own profile's CPU seconds, the workers sharing the machine's cores; goal within 5%"))
            shared_varying = [r.measured / r.shared_varying for r in rs if r.shared_varying]
            if shared_varying:
                rows.append((f"p={p}: {schedule} measured / simulated, sharing the cores, varying", fmt(shared_varying),
                             "the same, each action's CPU seconds drawn around them with the start-up calls' CPU spread; "
                             "goal within 5%"))
            inrun = [r.measured / r.in_run for r in rs if r.in_run]  # (a bench.json from before it has none)
            if inrun:
                rows.append((f"p={p}: {schedule} measured / simulated at in-run costs", fmt(inrun),
                             "each action at the run's own cost: the schedule's timing alone"))
            varying = [r.measured / r.in_run_varying for r in rs if r.in_run_varying]  # (none before 2026-12-05, later)
            if varying:
                rows.append((f"p={p}: {schedule} measured / simulated at in-run costs, varying", fmt(varying),
                             "each action drawn around its in-run cost with the run's spread (simulator.jitter)"))
            other = [r.measured / r.other for r in rs if r.other]
            if other:
                whose = ("the repeat before's run of the same schedule" if schedule in REFERENCES
                         else "this repeat's 1F1B run")
                rows.append((f"p={p}: {schedule} measured / simulated from another run's in-run profile", fmt(other),
                             f"{len(other)} repeats; the profile_in_run.json of {whose}; goal within 5%"))
            went = [r.went for r in rs if r.went]  # (a bench.json from before action_times has none)
            if went:
                med = lambda k: statistics.median(w[k] for w in went)  # noqa: E731
                kinds = [k for k in ("F", "B", "I", "W", "U") if all(k in w for w in went)]
                rows.append((f"p={p}: {schedule} in-run / profiled", " ".join(f"{k} {med(k):.2f}" for k in kinds),
                             f"per action, median of repeats; CPU / wall {med('cpu'):.2f}; "
                             + (f"an action's sd / mean {statistics.median(w['sd'] for w in went):.2f}; "
                                if all("sd" in w for w in went) else "")
                             + f"outside actions {100 * med('loop'):.1f}% of a step"))
            if memory and memory.get((p, schedule)):
                rows.append((f"p={p}: {schedule} peak RSS (MB)", rss_row(memory[(p, schedule)]),
                             "median of repeats; workers by rank"))
            if torch_t:
                ratio = [a.measured / t for a, t in zip(rs, torch_t)]
                ci = median_ci(ratio)
                rows.append((f"p={p}: {schedule} adapipe / torch", fmt(ratio),
                             f"{len(ratio)} paired repeats; goal median <= 1.0"
                             + (f"; the median's 95% bootstrap interval {fmt_ci(ci)}" if ci else "")))
        for schedule in replica_schedules:
            one = [RunResult(*x) for x in runs[(p, replica_key(schedule, 1))]]
            for r in replicas:
                rs = [RunResult(*x) for x in runs[(p, replica_key(schedule, r))]]
                name = f"p={p} R={r}: {schedule}"
                rows.append((f"{name} step, adapipe dist (ms)", fmt([1e3 * x.measured for x in rs]), f"{r * p} workers"))
                rows.append((f"{name} step, simulated (ms)", fmt([1e3 * x.own for x in rs]), "its own profile, all_gather on its link"))
                rows.append((f"{name} measured / simulated", fmt([x.measured / x.own for x in rs]), "goal within 15%"))
                shared = [x.measured / x.shared for x in rs if x.shared]
                if shared:
                    rows.append((f"{name} measured / simulated, sharing the cores", fmt(shared),
                                 "its own profile's CPU seconds, the workers sharing the machine's cores"))
                inrun = [x.measured / x.in_run for x in rs if x.in_run]
                if inrun:
                    rows.append((f"{name} measured / simulated at in-run costs", fmt(inrun),
                                 "each action at the run's own cost"))
                pairs = list(zip(rs, one))
                rows.append((f"{name} step / R=1 step", fmt([a.measured / b.measured for a, b in pairs]),
                             f"{len(pairs)} paired repeats; {r}x the batch: ideal 1.0 plus the all-reduce"))
                if memory and memory.get((p, replica_key(schedule, r))):
                    rows.append((f"{name} peak RSS (MB)", rss_row(memory[(p, replica_key(schedule, r))]),
                                 "median of repeats; workers by rank"))
    if transport:
        bare, ours, extra = transport
        rows += [("1 MB message, DistTransport (us)", f"{1e6 * ours:.1f}", ""),
                 ("1 MB message, bare send/recv (us)", f"{1e6 * bare:.1f}", ""),
                 ("transport overhead (us, median of pairs)", f"{1e6 * extra:+.1f}", f"{100 * extra / bare:+.1f}%; goal <= 10%")]
    print(header)
    show(rows)


if __name__ == "__main__":
    signals.install()  # SIGTERM (kill) takes Ctrl-C's path: the run in progress is stopped, not left behind
    try:
        main()
    except KeyboardInterrupt as e:
        word, code = signals.interrupt_exit(e)
        print(f"bench_dist: {word}; the repeats it finished are in the run directory's bench.json "
              f"(python scripts/bench_dist.py --report FILE prints them)", file=sys.stderr)
        sys.exit(code)
