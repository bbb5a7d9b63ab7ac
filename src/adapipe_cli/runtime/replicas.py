"""Data parallel x pipeline: R replicas of the p-stage pipeline, each on its share of the batch.

Stage s of every replica holds the same weights. When a replica's stage s has the whole gradient
of step t (its m-th backward), it all-reduces it with the other replicas' stage s and takes the
mean ``g = (1/R) sum_r g_r``, summed in replica order so that every copy gets the same bits.
Everything after (clipping, the update, the async stream's table of norms) sees the mean, so the
replicas stay identical and a sync step is single-process training on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .transport import Transport


@dataclass
class ReplicaGroup:
    """Stage ``stage``'s copy in replica ``index`` of ``count``, and the transport of its
    all-reduce (one group per stage: the stage's R copies)."""

    stage: int
    index: int
    count: int
    transport: Transport

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(range(self.count))

    def key(self, step: int) -> tuple:
        return ("dp", self.stage, step)


def replica_seed(seed: int, replica: int) -> int:
    """The seed of replica ``replica``'s stage executors: each replica draws its own dropout masks."""
    return seed + replica * 1_000_033


def where(rank: int, stages: int) -> tuple[int, int]:
    """(replica, stage) of a dist worker: rank ``replica * p + stage``, so that a pipeline's p
    stages are consecutive ranks (on one node under torchrun when p divides nproc-per-node)."""
    return divmod(rank, stages)


def split_pipelines(stages: int, replicas: int, per_node: int) -> list[int]:
    """The replicas whose stages :func:`where` puts on more than one node, when torchrun gives
    each node ``per_node`` consecutive ranks: none when ``per_node`` is a multiple of p; when p is
    a multiple of ``per_node`` every pipeline spans p / per_node nodes, the fewest it can."""
    return [r for r in range(replicas) if (r * stages) // per_node != (r * stages + stages - 1) // per_node]


def who(rank: int, stages: int, replicas: int) -> str:
    """How a message names a worker: ``stage S (rank N)``, ``stage S of replica R (rank N)``."""
    r, s = where(rank, stages)
    return f"stage {s} (rank {rank})" if replicas <= 1 else f"stage {s} of replica {r} (rank {rank})"


def replica_batch(batch, replica: int, microbatches: int):
    """Replica ``replica``'s microbatch ``i`` of a step: share ``replica * m + i`` of ``batch``,
    a batch function cut into ``R x m`` microbatches (replica r holds the r-th contiguous R-th)."""
    return lambda step, i: batch(step, replica * microbatches + i)


__all__ = ["ReplicaGroup", "replica_batch", "replica_seed", "split_pipelines", "where", "who"]
