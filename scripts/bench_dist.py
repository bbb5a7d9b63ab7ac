"""Distributed runtime benchmarks: 2 stages over gloo, one thread per worker.

1. adapipe's dist 1F1B step time / torch.distributed.pipelining Schedule1F1B's, same model,
   batch, microbatches, optimizer (AdamW) and clipping by the global gradient norm (goal <= 1.0).
2. adapipe's dist async (PipeDream) step time / its dist sync (1F1B) step time, next to the
   simulator's prediction from the run's own measured cost profile (goal: within 15%).
3. The transport's cost per message: a 1 MB activation sent and received through DistTransport
   against a bare dist.send / dist.recv pair (ping-pong, one way; median over short rounds of
   each run back to back).

Step times are the mean over the steady steps (the first and last few and evaluations left out);
each measurement is repeated, interleaved with the others, and its best repeat is kept (the speed
of shared cores varies from minute to minute). Run:
python scripts/bench_dist.py [--model gpt-nano] [--batch 16] [--microbatches 4] [--steps 100] [--repeats 3]
[--rounds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.runtime.dist import worker_context  # noqa: E402
from adapipe_cli.simulator.clock import CostProfile, LinkModel  # noqa: E402
from adapipe_cli.simulator.simulate import steady_step_times  # noqa: E402
from adapipe_cli.train import build  # noqa: E402
from adapipe_cli.train.loop import train  # noqa: E402

SKIP = 5  # steps left out at either end of a run


def overrides(args, schedule: str) -> list[str]:
    return [f"model={args.model}", f"schedule={schedule}", "pipeline.stages=2", f"pipeline.microbatches={args.microbatches}",
            f"train.batch_size={args.batch}", f"train.max_steps={args.steps}", f"train.eval_every={args.steps}",
            "train.progress=off", "pipeline.threads=1", "pipeline.runtime=dist", "optim.warmup_steps=2"]


def adapipe_step_time(args, schedule: str, out: Path) -> tuple[float, float]:
    """(mean steady step time, mean busy fraction of the stages) of a dist run."""
    train(compose_config(overrides(args, schedule)), out)
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    window = steps[SKIP:len(steps) - SKIP]
    busy = statistics.mean(1 - r["bubble"] for r in window[1:])
    return (window[-1]["time_s"] - window[0]["time_s"]) / (len(window) - 1), busy


# -- torch.distributed.pipelining ----------------------------------------------------------------
def _torch_rank(rank: int, port: int, args_d: dict, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from adapipe_cli.data import build_data
    from adapipe_cli.model import lm_loss

    args = argparse.Namespace(**args_d)
    torch.set_num_threads(1)
    cfg = compose_config(overrides(args, "1f1b"))
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=2)
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    (module,), (opt,) = build.make_stages(cfg, build.model_config(cfg, data.vocab_size), which=[rank])
    sched = Schedule1F1B(PipelineStage(module, rank, 2, torch.device("cpu")), n_microbatches=args.microbatches,
                         loss_fn=lm_loss)
    params = list(module.parameters())

    def step(t: int) -> None:
        x, y = data.train_batch(t, args.batch)
        sched.step(x) if rank == 0 else sched.step(target=y)
        sq = torch.stack([torch.linalg.vector_norm(p.grad) for p in params]).pow(2).sum().reshape(1)
        dist.all_reduce(sq)  # clip by the global norm, as adapipe's synchronous update does
        coef = min(1.0, cfg.optim.grad_clip / (float(sq.sqrt()) + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step(1.0)

    ends = []
    dist.barrier()
    t0 = time.perf_counter()
    for t in range(args.steps):
        step(t)
        ends.append(time.perf_counter() - t0)
    window = ends[SKIP:len(ends) - SKIP]
    Path(out, f"torch{rank}.json").write_text(json.dumps((window[-1] - window[0]) / (len(window) - 1)))
    dist.destroy_process_group()


def two_ranks(target, *args) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = worker_context()
    procs = [ctx.Process(target=target, args=(r, store.port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a benchmark rank failed: {[p.exitcode for p in procs]}")


def torch_step_time(args, out: Path) -> float:
    two_ranks(_torch_rank, vars(args), str(out))
    return max(json.loads(Path(out, f"torch{r}.json").read_text()) for r in range(2))


# -- the transport ---------------------------------------------------------------------------------
def _transport_rank(rank: int, port: int, n: int, out: str) -> None:
    from adapipe_cli.runtime.dist_transport import DistTransport, build_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=2)
    shape = (4, 256, 256)  # 1 MiB of fp32
    groups = build_groups(2, False)
    tr = DistTransport(rank, 2, groups, lambda c, k: shape, torch.device("cpu"))
    x = torch.randn(shape)

    def ours(i: int) -> None:  # an activation forward, its gradient back
        if rank == 0:
            tr.send("act", 0, 1, i, x)
            tr.recv("grad", 1, 0, i)
        else:
            tr.send("grad", 1, 0, i, tr.recv("act", 0, 1, i))

    def bare(i: int) -> None:
        if rank == 0:
            dist.send(x, 1, group=groups[("act", 0)])
            dist.recv(x, 1, group=groups[("grad", 0)])
        else:
            dist.recv(x, 0, group=groups[("act", 0)])
            dist.send(x, 0, group=groups[("grad", 0)])

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
    dist.destroy_process_group()


def transport_overhead(n: int, out: Path) -> tuple[float, float, float]:
    """(median one-way time of a bare message, of a DistTransport message, median of their
    difference over paired rounds)."""
    two_ranks(_transport_rank, n, str(out))
    rounds = json.loads(Path(out, "transport.json").read_text())
    return (statistics.median(b for b, _ in rounds), statistics.median(o for _, o in rounds),
            statistics.median(o - b for b, o in rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=60, help="paired rounds of 20 messages each way")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_dist_"))
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list] = {"1f1b": [], "pipedream": [], "torch": []}
    for i in range(args.repeats):
        for schedule in ("1f1b", "pipedream"):
            runs[schedule].append((*adapipe_step_time(args, schedule, out / f"{schedule}{i}"), i))
        runs["torch"].append(torch_step_time(args, out))
    (sync, sync_busy, best), (asyn, async_busy, _) = min(runs["1f1b"]), min(runs["pipedream"])
    theirs = min(runs["torch"])
    prof = CostProfile.load(out / f"1f1b{best}" / "profile.json")
    spec = build.schedule_choice(compose_config(overrides(args, "adapipe"))).spec
    p_sync, p_async, _ = steady_step_times(spec, prof, LinkModel())
    bare, ours, extra = transport_overhead(args.rounds, out)
    # The profile is measured by one process alone. Workers that compute side by side on shared
    # cores are slower, and more so in the async phase, which has no bubble in which one of them
    # runs alone: each phase's slowdown is its workers' busy time over the profiled work.
    work = sum(args.microbatches * (f + b) + u for f, b, u in zip(prof.forward, prof.backward, prof.update))
    k_sync, k_async = sync_busy * 2 * sync / work, async_busy * 2 * asyn / work

    print(f"{args.model}, 2 stages, gloo, 1 thread per worker, batch {args.batch}, {args.microbatches} microbatches, "
          f"{args.steps} steps, best of {args.repeats} (runs in {out})")
    paired = [(a[0] / t, b[0] / a[0]) for a, b, t in zip(runs["1f1b"], runs["pipedream"], runs["torch"])]
    rows = [
        ("1f1b step, adapipe dist (ms)", 1e3 * sync, ""),
        ("1f1b step, torch Schedule1F1B (ms)", 1e3 * theirs, ""),
        ("adapipe / torch", sync / theirs, "goal <= 1.0"),
        ("adapipe / torch, median of repeats", statistics.median(r for r, _ in paired), ""),
        ("pipedream step, adapipe dist (ms)", 1e3 * asyn, ""),
        ("1f1b / pipedream step, simulated (ms)", 1e3 * p_sync, f"{1e3 * p_async:.2f}"),
        ("async / sync, measured", asyn / sync, ""),
        ("async / sync, simulated", p_async / p_sync, ""),
        ("measured / simulated", (asyn / sync) / (p_async / p_sync), "goal within 15%"),
        ("measured / simulated, median of repeats", statistics.median(r for _, r in paired) / (p_async / p_sync), ""),
        ("slowdown of shared cores, 1f1b", k_sync, "busy time / profiled work"),
        ("slowdown of shared cores, pipedream", k_async, ""),
        ("measured / simulated, slowdowns applied", (asyn / sync) / (k_async * p_async / (k_sync * p_sync)), ""),
        ("1 MB message, DistTransport (us)", 1e6 * ours, ""),
        ("1 MB message, bare send/recv (us)", 1e6 * bare, ""),
        ("transport overhead (us, median of pairs)", 1e6 * extra, f"{100 * extra / bare:+.1f}%"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>9.3f}  {note}")


if __name__ == "__main__":
    main()
