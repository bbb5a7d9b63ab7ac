"""Gradients against torch.distributed.pipelining's multi-stage schedules on gloo: its
``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (several model chunks per rank,
chunk c on rank c % p) and ``ScheduleZBVZeroBubble`` (two chunks per rank in a V: rank r holds
chunks r and 2p - 1 - r), for the same model cut and microbatches as adapipe's schedules.

Which of ours each one is compared with:

- ``ScheduleInterleaved1F1B`` (v chunks per rank)  ~ ``schedule=interleaved schedule.chunks=v``: the
  same placement and the same Megatron-LM order family;
- ``ScheduleInterleavedZeroBubble`` with one chunk per rank ~ ``schedule=zbh1``: a split backward
  (I, then W deferred) at 1F1B's peak memory (the paper's ZB-H1 / ZB1P);
- ``ScheduleInterleavedZeroBubble`` with v chunks per rank ~ ``schedule=interleaved`` (ours does not
  split an interleaved backward; the gradient of a flushed step does not depend on the order);
- ``ScheduleZBVZeroBubble`` ~ ``schedule=zbh1`` over 2p stages (ours has no V placement).

Each is exact synchronous training, so step 0's gradient of every chunk is the same up to float
rounding (1e-5 relative): torch's on gloo, one process per rank; ours from the stage executors
walked in one process (the local runtime's oracle, which the dist runtime equals bitwise).
"""

from __future__ import annotations

import pytest
import torch

from adapipe_cli.model import GPTConfig, build_stages, lm_loss, partition
from adapipe_cli.runtime.stage import StageExecutor
from adapipe_cli.runtime.transport import LocalTransport
from adapipe_cli.schedules.walk import walk
from adapipe_cli.schedules import SYNC, UPDATE, Plan, ScheduleSpec, StageProgram
from pipelining_rank import NoUpdates
from procs import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, d_model=32, n_head=2)
ROWS = 8


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, CFG.vocab_size, (ROWS, CFG.block_size + 1), generator=torch.Generator().manual_seed(0))
    return seq[:, :-1], seq[:, 1:]


def torch_chunks(schedule: str, rank: int, p: int, v: int) -> list[int]:
    """The chunks rank ``rank`` holds: looped (c % p == rank), or the V of ZB-V."""
    if schedule == "ScheduleZBVZeroBubble":
        return [rank, 2 * p - 1 - rank]
    return [c for c in range(p * v) if c % p == rank]


def _torch_rank(rank: int, port: int, schedule: str, p: int, v: int, m: int, out: str) -> None:
    """One rank of torch's schedule: step 0's gradient of each of its chunks, saved."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p)
    x, y = batch()
    n = p * v
    mine = torch_chunks(schedule, rank, p, v)
    modules = build_stages(CFG, partition(CFG, n), seed=0)
    stages = [pipelining.PipelineStage(modules[c], c, n, torch.device("cpu")) for c in mine]
    sched = getattr(pipelining, schedule)(stages, n_microbatches=m, loss_fn=lm_loss)
    kw = {}
    if 0 in mine:
        kw["args"] = (x,)
    if n - 1 in mine:
        kw["target"] = y
    sched.step(*kw.pop("args", ()), **kw)
    torch.save({c: [q.grad.clone() for q in modules[c].parameters()] for c in mine}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def torch_gradients(tmp_path, schedule: str, p: int, v: int, m: int) -> dict[int, list[torch.Tensor]]:
    """Per chunk, its step-0 gradient under torch's ``schedule`` on gloo (p processes)."""
    import torch.distributed as dist

    from adapipe_cli.runtime.dist import worker_context

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = worker_context()
    procs = [ctx.Process(target=_torch_rank, args=(r, store.port, schedule, p, v, m, str(tmp_path))) for r in range(p)]
    run_ranks(procs, 180)
    grads: dict[int, list[torch.Tensor]] = {}
    for r in range(p):
        grads.update(torch.load(tmp_path / f"rank{r}.pt"))
    return grads


def our_gradients(sync: str, p: int, v: int, m: int) -> dict[int, list[torch.Tensor]]:
    """Per virtual stage, step 0's accumulated gradient under our schedule: every stage executor
    run up to its update, over an in-process transport."""
    spec = ScheduleSpec(p, m, sync, chunks=v)
    n = spec.virtual_stages
    x, y = batch()
    rows = ROWS // m
    modules = build_stages(CFG, partition(CFG, n), seed=0)
    transport, plan = LocalTransport(), Plan(1, [SYNC])
    programs = [StageProgram(s, spec, plan) for s in range(n)]
    exs = [StageExecutor(s, n, m, modules[s], None, transport, lambda t, i: (x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]),
                         NoUpdates(), programs[s]) for s in range(n)]

    def execute(s, a):
        exs[s].run(a)
        return range(n)  # (any stage may be unblocked: walk re-checks)

    walk(programs, range(n), lambda s: programs[s].peek().kind == UPDATE, lambda s, a: exs[s].ready(a), execute)
    return {s: exs[s].grads[0] for s in range(n)}


def assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for c in ours:
        assert len(ours[c]) == len(theirs[c])
        for a, b in zip(ours[c], theirs[c]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule,p,v,m,ours", [
    pytest.param("ScheduleInterleaved1F1B", 2, 2, 4, ("interleaved", 2, 2), marks=pytest.mark.slow),  # ~9 s: gloo ranks
    pytest.param("ScheduleInterleavedZeroBubble", 2, 2, 4, ("interleaved", 2, 2), marks=pytest.mark.slow),
    pytest.param("ScheduleInterleavedZeroBubble", 2, 1, 4, ("zbh1", 2, 1), marks=pytest.mark.slow),
    pytest.param("ScheduleZBVZeroBubble", 2, 2, 4, ("zbh1", 4, 1), marks=pytest.mark.slow),
])
def test_gradients_equal_torch_pipelining(tmp_path, schedule, p, v, m, ours):
    assert_same(our_gradients(*ours, m), torch_gradients(tmp_path, schedule, p, v, m))
