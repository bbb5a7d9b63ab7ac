"""How the processes of a distributed run talk: the *board* (control messages through a TCPStore)
and the *transport* (tensors through torch.distributed point-to-point ops and collectives).

The board carries what is small and rare: the run's spec, phase decisions, the driver's
per-step permission to update, per-step reports, evaluation results and errors. Keys:

    spec                 the run (config, eval steps, backend, devices), written once by the driver
    ready/{r}            rank r has built its stage
    grad_bytes/{s}       (virtual) stage s's parameter bytes, all-reduced across replicas on the pipeline clock
    link/{r}             the link from rank r to rank r + 1, measured at start-up (DistTransport.measure_link)
    phase/{u}            phase of step u ("sync" | "async"), or "end" / "abort"
    go/{t}               ("go" | "snap", t + 1, the phases decided from step t + 1 on): every stage may
                         apply U(t) (snap: after keeping a snapshot); "back": roll back;
                         "end" | "eval" | "abort": stop before it
    rep/{t}/{r}          rank r's report of step t (after its U(t))
    eval/{v}             validation losses of weight version v (last stage)
    error/{r}, errors    rank r's exception message; a counter of errors reported
    done/{r}             rank r finished cleanly: its steps and its peak memory at its end
    save/{t}             the temporary folder of the checkpoint after t steps (None: the run was aborted)
    part/{t}/{r}         rank r's part of that checkpoint is written: its manifest entry (None: not finite)
    resume/phases        a resumed run's phases, decided before its checkpoint
    resume/expect/{r}    a resumed rank r's first activation still to receive (the previous rank sends it again)

The transport carries activations, gradients, validation activations and the async stream's
tables of gradient norms between neighbouring stages, and the two collectives of a synchronous update (global gradient norm, tied embeddings).
"""

from __future__ import annotations

import datetime
import pickle
import statistics
import time
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

ENDINGS = ("end", "eval", "abort")
# tensors between neighbours: activations, input gradients, validation activations, and the
# tables of gradient norms that travel with the async stream's activations and gradients
CHANNELS = ("act", "grad", "eval", "actn", "gradn")


class Board:
    """The control channel: pickled values under string keys of one TCPStore, under a prefix so
    that several runs (or restarts of one torchrun job) sharing a store never read each other."""

    def __init__(self, host: str, port: int, prefix: str, server: bool = False, timeout_s: float = 600.0):
        td = datetime.timedelta(seconds=timeout_s)
        if server:
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=td)
        else:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=td)
        self.host, self.port, self.prefix = host, self.store.port, prefix
        self.kv = dist.PrefixStore(prefix, self.store)

    def client(self, timeout_s: float = 600.0) -> "Board":
        """Another connection to the same board (a TCPStore connection serves one thread)."""
        return Board(self.host, self.port, self.prefix, timeout_s=timeout_s)

    def put(self, key: str, value) -> None:
        self.kv.set(key, pickle.dumps(value))

    def get(self, key: str):
        """The value of ``key``, waiting for it to be written (up to the store's timeout)."""
        return pickle.loads(self.kv.get(key))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        if timeout_s is None:
            self.kv.wait(keys)
        else:
            self.kv.wait(keys, datetime.timedelta(seconds=timeout_s))

    def has(self, key: str) -> bool:
        return self.kv.check([key])

    def add(self, key: str, n: int) -> int:
        return self.kv.add(key, n)

    def delete(self, key: str) -> None:
        self.kv.delete_key(key)

    def process_group_store(self) -> dist.Store:
        """The store under which torch.distributed's rendezvous keeps its own keys."""
        return dist.PrefixStore(f"{self.prefix}/pg", self.store)


def build_groups(stages: int, tied: bool, replicas: int = 1, replica: int = 0, chunks: int = 1,
                 tables: bool = True) -> dict:
    """One process group per channel and direction between each pair of neighbouring stages, and
    the ends' group for tied embeddings. Every rank must call this, in the same order. With
    ``chunks`` model chunks per rank (interleaved 1F1B) the stages are the ``stages * chunks``
    virtual stages, virtual stage ``c`` on stage (device) ``c % stages``: a group per virtual link,
    so that the links between the same two ranks (chunk 0 -> 1 and chunk 2 -> 3 at 2 ranks) are
    separate FIFOs. ``tables``: the channels of the async stream's tables of gradient norms too
    (``actn``, ``gradn``; a run of sync steps only does without them).

    With ``replicas`` R > 1 (ranks ``r * p + s``, :func:`.replicas.where`), every replica has
    these groups and one of its p stages (``pipeline``, for a sync update's collectives), and
    every stage one of its R copies (``("dp", s)``, for the gradient all-reduce); the groups of
    ``replica`` are returned. (With one replica ``pipeline`` is None: the whole world.)

    Why this order is deadlock-free, on NCCL too: each group carries messages of one channel in
    one direction only (activations s -> s+1, gradients s+1 -> s, validation activations
    s -> s+1), so it is a FIFO whose two ends post their operations in the order their action
    lists produce them. Those orders agree: every stage forwards microbatches in increasing order,
    backwards them in increasing order and evaluates versions in increasing order. Since NCCL runs
    each communicator's operations in order on its own stream, a send can only ever wait for the
    matching receive, which its peer posts when its list reaches it; the lists are
    dependency-consistent (the local runtime executes them in one process, and a worker evaluates
    a version no later than the update that retires it), so every receive is eventually reached.
    Sends never block the sender (isend); a receive blocks right before the action that needs it.
    Sharing one communicator between the two directions would not be safe on NCCL: stage s's
    send of an activation and stage s+1's send of a gradient could each wait for the other's
    receive, queued behind them on the same stream.
    """
    mine: dict = {}
    n = stages * chunks
    channels = CHANNELS if tables else ("act", "grad", "eval")
    for r in range(replicas):
        base, groups = r * stages, {}
        for s in range(n - 1):
            for channel in channels:
                groups[(channel, s)] = dist.new_group(sorted({base + s % stages, base + (s + 1) % stages}))
        if tied and stages > 1:
            groups["ends"] = dist.new_group([base, base + stages - 1]) if stages > 2 else None
        groups["pipeline"] = dist.new_group(list(range(base, base + stages))) if replicas > 1 else None
        if r == replica:
            mine = groups
    for s in range(stages if replicas > 1 else 0):
        mine[("dp", s)] = dist.new_group([r * stages + s for r in range(replicas)])
    return mine


class DistTransport:
    """The :class:`~.transport.Transport` of one worker: stage ``s`` is rank ``base + s``
(``base = replica * p`` with replicas, 0 without). With ``chunks`` model chunks per worker
    (interleaved 1F1B), virtual stage ``c`` of ``stages * chunks`` runs on stage ``c % stages``:
    every channel's messages are addressed by virtual stage, and the worker's own chunks post
    their shares of a collective before any of them takes its result.

    Shapes are known from the schedule (``shape(channel, key)``), so a message is the tensor alone:
    no metadata travels. A receive takes a buffer of that shape from the channel's pool of
    buffers the executor has given back (:meth:`release`), or allocates one: a fresh buffer costs
    page faults on every use on the CPU. With ``ahead``, the next receive of each channel but
    ``eval`` is posted as soon as the previous one completes: gloo moves a message only once its
    receive is posted, so the transfer then overlaps the computation before it is needed (those
    channels carry one shape).

    Sends never block the sender (isend) and keep their tensor until they are known to be
    complete. gloo marks a send complete only once it is waited for, so each channel keeps its
    sends in order and waits for the oldest when more than ``window`` are pending, and for all
    after a collective over every stage (whose peers have consumed every message sent before
    it). Waiting for an old send cannot deadlock: its receiver consumes the channel in order
    and needs nothing from this stage that this stage sends after it. ``wait_s`` accumulates
    the time spent blocked in receives, sends and collectives, which is not busy time;
    ``on_block(True/False)`` brackets each such wait.
    """

    def __init__(self, stage: int, stages: int, groups: dict, shape: Callable[[str, object], tuple],
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 on_block: Callable[[bool], None] | None = None, ahead: bool = False, window: int = 64,
                 base: int = 0, chunks: int = 1):
        self.s, self.p, self.groups, self.shape = stage, stages, groups, shape
        self.base = base  # the global rank of this replica's stage 0
        self.chunks = chunks
        self.device, self.dtype = device, dtype
        self.on_block = on_block or (lambda blocked: None)
        # per link (channel, src, dst): its sends in order, its next receive
        self.sends: dict[tuple, deque[tuple[dist.Work, torch.Tensor]]] = {}
        self.window = max(1, window)
        self.ahead = ahead
        self.posted: dict[tuple, tuple[dist.Work, torch.Tensor]] = {}
        self.free: dict[tuple[str, tuple], list[torch.Tensor]] = {}  # (channel, shape) -> buffers given back
        self.parts: dict[tuple, dict[int, list[torch.Tensor]]] = {}  # a collective's shares of this worker's chunks
        self.results: dict[tuple, tuple[list[torch.Tensor], int]] = {}  # its result, and the chunks still to take it
        self.wait_s = 0.0

    def rank_of(self, stage: int) -> int:
        """The global rank that runs virtual stage ``stage``."""
        return self.base + stage % self.p

    def _group(self, channel: str, src: int, dst: int):
        return self.groups[(channel, min(src, dst))]

    def send(self, channel: str, src: int, dst: int, key, tensor: torch.Tensor) -> None:
        # (the tables of gradient norms are made on the host; NCCL sends only device tensors)
        if tensor.device != self.device or not tensor.is_contiguous():
            tensor = tensor.to(self.device).contiguous()
        pending = self.sends.setdefault((channel, src, dst), deque())
        while pending and (len(pending) >= self.window or pending[0][0].is_completed()):
            self._blocking(pending.popleft()[0].wait)  # (gloo: done long ago, returns at once)
        pending.append((dist.isend(tensor, self.rank_of(dst), group=self._group(channel, src, dst)), tensor))

    def ready(self, channel: str, src: int, dst: int, key) -> bool:
        return True  # a receive blocks until its message arrives

    def recv(self, channel: str, src: int, dst: int, key, like: torch.Tensor | None = None) -> torch.Tensor:
        link = (channel, src, dst)
        work, buf = self.posted.pop(link, None) or self._post(channel, src, dst, key)
        self._blocking(work.wait)
        if self.ahead and channel != "eval":
            self.posted[link] = self._post(channel, src, dst, key)
        return buf

    def release(self, channel: str, tensor: torch.Tensor) -> None:
        """The executor is done with ``tensor``, a buffer :meth:`recv` returned: a later receive of
        ``channel`` may reuse it (at most a few are kept per shape)."""
        free = self.free.setdefault((channel, tuple(tensor.shape)), [])
        if len(free) < 8:
            free.append(tensor.detach())

    def _post(self, channel: str, src: int, dst: int, key) -> tuple[dist.Work, torch.Tensor]:
        shape = tuple(self.shape(channel, key))
        free = self.free.get((channel, shape))
        buf = free.pop() if free else torch.empty(shape, dtype=self.dtype, device=self.device)
        return dist.irecv(buf, self.rank_of(src), group=self._group(channel, src, dst)), buf

    def measure_link(self, numel: int, rounds: int = 20) -> dict | None:
        """Latency and bandwidth of the link to the next stage, from a ping-pong before training:
        ``latency`` is half the median round trip of a 1-element message, and
        ``bandwidth = bytes / (t - latency)`` with ``t`` half the median round trip of a message
        of ``numel`` elements (an activation). ``thread_cpu_s``: the CPU seconds the process's
        other threads (gloo's, which move the bytes) spent per message of ``numel`` elements sent
        or received, at one end, during those round trips (0 on a GPU: not CPU work that a
        computing worker waits for). Every rank calls it, in rank order along the
        pipeline (rank s measures with s - 1, then with s + 1); the last rank returns None."""
        out = None
        for peer in (self.s - 1, self.s + 1):
            if not 0 <= peer < self.p:
                continue
            group, rank = self._group("act", self.s, peer), self.base + peer
            times = []
            for n in (1, max(1, numel)):
                x = torch.zeros(n, dtype=self.dtype, device=self.device)
                rt = []
                c0 = time.process_time() - time.thread_time()  # (the process's other threads: gloo's)
                for _ in range(rounds + 2):  # (the first two warm the connection up)
                    t0 = time.perf_counter()
                    if peer > self.s:
                        dist.send(x, rank, group=group)
                        dist.recv(x, rank, group=group)
                    else:
                        dist.recv(x, rank, group=group)
                        dist.send(x, rank, group=group)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    rt.append(time.perf_counter() - t0)
                times.append(statistics.median(rt[2:]) / 2)
                # (two clocks read one after the other: a microsecond either way, never below none)
                threads_cpu = max(0.0, time.process_time() - time.thread_time() - c0) / (2 * (rounds + 2))
            if peer > self.s:
                latency, big = times
                nbytes = max(1, numel) * torch.empty((), dtype=self.dtype).element_size()
                out = {"latency_s": latency, "bandwidth": nbytes / max(big - latency, 1e-9), "bytes": nbytes,
                       "one_way_s": big, "rounds": rounds,
                       "thread_cpu_s": threads_cpu if self.device.type == "cpu" else 0.0}
        return out

    def _mine(self, group: tuple[int, ...]) -> list[int]:
        return [c for c in group if c % self.p == self.s]

    def post_reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        self.parts.setdefault(key, {})[stage] = tensors  # the collective runs in reduce()

    def reduce_ready(self, key: tuple, group: tuple[int, ...]) -> bool:
        """Whether every chunk of this worker in ``group`` has posted its share (then the
        collective blocks until the other workers' arrive)."""
        return key in self.results or len(self.parts.get(key, ())) == len(self._mine(group))

    def reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Element-wise sum over the (virtual) stages of ``group``, added in stage order (an
        all_gather of each worker's shares, then a sum), so that the result is bitwise the local
        runtime's whatever the number of stages and chunks. The first of this worker's chunks to
        ask runs the collective; the others take copies of its result."""
        if key not in self.results:
            self.parts.setdefault(key, {}).setdefault(stage, tensors)  # (a caller that did not post first)
            self.results[key] = (self._reduce(key, group), len(self._mine(group)))
        out, left = self.results[key]
        if left == 1:
            del self.results[key]
        else:
            self.results[key] = (out, left - 1)
        return [t.clone() for t in out] if left > 1 else out

    def _reduce(self, key: tuple, group: tuple[int, ...]) -> list[torch.Tensor]:
        devs = sorted({c % self.p for c in group})  # the stages (workers) taking part, in rank order
        whole = len(devs) == self.p
        pg = self.groups.get("pipeline") if whole else self.groups["ends"]
        mine, shares = self._mine(group), self.parts.pop(key)
        at = {c: (devs.index(c % self.p), [x for x in group if x % self.p == c % self.p].index(c)) for c in group}
        out = []
        for i, t in enumerate(shares[mine[0]]):
            # (NCCL: device tensors only) this worker's shares, one row each, in stage order
            rows = torch.stack([shares[c][i].reshape(-1) for c in mine]).to(self.device).contiguous()
            gathered = [torch.empty_like(rows) for _ in devs]
            self._blocking(lambda: dist.all_gather(gathered, rows, group=pg))
            acc = gathered[at[group[0]][0]][at[group[0]][1]].clone()
            for c in group[1:]:
                acc.add_(gathered[at[c][0]][at[c][1]])
            out.append(acc.reshape(t.shape).to(t.device))
        if whole:  # every stage is here: every message sent before it has been received
            self.wait_sends()
        return out

    def wait_sends(self) -> None:
        """Wait for every send still in flight (their buffers may then be reused)."""
        for pending in self.sends.values():
            while pending:
                pending.popleft()[0].wait()

    def _blocking(self, fn: Callable[[], object]) -> None:
        self.on_block(True)
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self.wait_s += time.perf_counter() - t0
            self.on_block(False)

    def pending_sends(self) -> int:
        return sum(len(q) for q in self.sends.values())


class DistAllReduce:
    """The transport of a stage's gradient all-reduce across its R copies (``("dp", s)`` of
    :func:`build_groups`, :class:`.replicas.ReplicaGroup`): one all_gather of the whole gradient,
    flattened, then the sum in replica order, so that every copy gets the local emulation's bits
    (:class:`.transport.LocalTransport`). It moves ``(R-1) n`` bytes per rank, what the clock charges
    (:class:`.AllReduceModel`). Its wait is not busy time (``via``'s wait_s)."""

    def __init__(self, group, via: DistTransport):
        self.group, self.via = group, via

    def post_reduce(self, key: tuple, index: int, members: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        pass  # the collective runs in reduce()

    def reduce_ready(self, key: tuple, members: tuple[int, ...]) -> bool:
        return True

    def reduce(self, key: tuple, index: int, members: tuple[int, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        dev = self.via.device
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(dev)  # (NCCL: device tensors only)
        parts = [torch.empty_like(flat) for _ in members]
        self.via._blocking(lambda: dist.all_gather(parts, flat, group=self.group))
        acc = parts[0]
        for x in parts[1:]:
            acc.add_(x)
        out, i = [], 0
        for t in tensors:
            out.append(acc[i:i + t.numel()].view(t.shape).to(t.device))
            i += t.numel()
        return out
