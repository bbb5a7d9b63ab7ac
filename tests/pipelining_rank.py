"""One rank of ``test_dist.test_sync_gradients_equal_torch_pipelining``, in a module of its own: a
worker process imports the module of its target, and the test module's imports (the training
loop, matplotlib) cost each rank about 2 s."""

from __future__ import annotations

import torch


class NoUpdates:
    """The update policy of a run that stops before its first update."""

    def release(self, *args) -> None:
        pass


def pipelining_rank(rank: int, port: int, schedule: str, out: str) -> None:
    """One rank: torch's schedule and adapipe's stage executor each compute step 0's gradient
    of the same stage; both are saved for the test to compare."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from adapipe_cli.model import GPTConfig, build_stages, lm_loss, partition
    from adapipe_cli.runtime.dist_transport import DistTransport, build_groups
    from adapipe_cli.runtime.stage import StageExecutor
    from adapipe_cli.schedules import Plan, ScheduleSpec, StageProgram

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    p, m = 2, 4
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, d_model=32, n_head=2)
    seq = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = seq[:, :-1], seq[:, 1:]

    module = build_stages(cfg, partition(cfg, p), seed=0)[rank]
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(PipelineStage(module, rank, p, torch.device("cpu")), n_microbatches=m, loss_fn=lm_loss)
    sched.step(x) if rank == 0 else sched.step(target=y)
    theirs = [q.grad.clone() for q in module.parameters()]

    module = build_stages(cfg, partition(cfg, p), seed=0)[rank]
    plan = Plan(1, ["sync"])
    program = StageProgram(rank, ScheduleSpec(p, m, schedule), plan)
    transport = DistTransport(rank, p, build_groups(p, False), lambda c, k: (2, 16, 32), torch.device("cpu"))
    ex = StageExecutor(rank, p, m, module, None, transport, lambda t, i: (x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]),
                       NoUpdates(), program)
    while program.peek().kind != "U":
        ex.run(program.pop())
    torch.save({"theirs": theirs, "ours": ex.grads[0]}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
