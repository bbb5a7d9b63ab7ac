"""Measuring the cost profile that the pipeline clock uses (``pipeline.clock=profiled``).

Each stage's forward, backward (one microbatch; and split into its input and weight gradients, for
zero-bubble schedules), update, parameter copy and element-wise pass over its parameters (the
``copy`` and ``predict`` costs) are timed on copies of the stage and its
optimizer, so measuring changes neither the weights nor the random state of the run.

Other work on the machine can only slow a measurement down, and it comes and goes, so the kinds of
work are interleaved (every round times each stage's F, B and U once, in turn: a busy spell slows
all kinds alike instead of one) and the time kept is the minimum over rounds, the quiet value
(a dist worker's start-up profile keeps the median instead, the typical call its run is made of).
The rounds run in two passes over the stages; where a stage's minima of the two passes disagree
by more than :data:`SPREAD_LIMIT` (spread = max/min - 1), the load lasted through a whole pass and
the profile cannot be trusted: one warning line says so (measured with at least
:data:`MIN_ROUNDS` rounds per pass). The spreads are stored in the profile's
``meta["spread"]``.

A stage's forward and backward are also timed with 1 and 4 microbatches' graphs alive (their
own included: :data:`HELD_DEPTHS`, in the same rounds), for the clock's in-flight factor
(``CostProfile.held``): a stage that holds more microbatches' saved tensors computes more slowly.
Those timings run on a copy of the stage of their own, and their graphs stay alive between
rounds (3 per stage), so every timing of the rounds, the plain forward and backward included,
runs beside that memory and after memory-heavy work, as a run's actions do: since they joined the
rounds (2026-12-04) a dist run's 1F1B forward and backward took 1.07 to 1.09x and 0.96 to 1.04x
their start-up costs in three reruns, against 1.16 and 1.12x before (README, the dist benchmark).

Everything is measured as the run computes: on its device (on CUDA each piece of work is timed
with CUDA events, synchronised, so the clock is in GPU seconds) and in its precision (the forwards
under the same autocast, so bf16's times and its saved activations' bytes are bf16's).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from ..model import GPTStage, lm_loss
from ..simulator.clock import CostProfile
from ..optim import StageOptimizer
from .device import EventTimer, autocast

PASSES = 2
SPREAD_LIMIT = 0.25  # the two passes' minima may disagree by this much before a warning
SPREAD_FLOOR_S = 1e-3  # ... and by at least this many seconds (one preemption of sub-millisecond work)
MIN_ROUNDS = 3  # fewer rounds per pass (tests) keep no quiet minimum to compare: no warning
STATISTICS = {"min": min, "median": statistics.median}  # of a kind of work's times over the rounds
KINDS = ("forward", "backward", "update", "copy", "predict", "input", "weight", "accumulate", "data")
# microbatches in flight at which a forward and a backward are timed for the profile's ``held``
# table (1 again beside the others: each depth's factor is over a time of the same rounds). Not 8:
# on this CPU 8 cost at most 2 points (backward) and 5 (forward, one profile of six) more than 4
# (the first stage's backward 1.07-1.09x against 1.06-1.09x, forward 1.00-1.05x against 1.00x:
# docs/results/accounting_held_depth8.md), the clock keeps the last depth's factor beyond it (so
# more than 4 in flight is charged up to that little less), and the pools' graphs are memory a
# profile holds for every stage at once
HELD_DEPTHS = (1, 4)


@dataclass
class Work:
    """One kind of work to time. ``run`` is timed; ``setup``, when given, runs untimed before each
    call and its result is ``run``'s argument (a backward needs a graph built just before it)."""

    run: Callable
    setup: Callable | None = None

    def __call__(self, timer: Callable[[], float], cpu: list[float] | None = None) -> float:
        """The seconds of one call of ``run`` by ``timer``; with ``cpu``, its CPU seconds on this
        thread (``time.thread_time``: its work on one core, without the time it waited for one)
        are appended there (not with a device's own timer: its work is not the thread's), read
        inside the timer's window and at most the call's seconds by ``timer``: one thread cannot
        compute for longer than the call lasts, and a thread clock that reads more is the two
        clocks disagreeing (the thread clock is the kernel scheduler's, not the wall clock). Until
        2026-12-06 the thread clock's window held the timer's, so a computing call's CPU seconds
        came out a few microseconds over its wall seconds, and once, in CI, over 100 us more."""
        arg = self.setup() if self.setup is not None else None
        span = getattr(timer, "span", None)  # a device's own timer (CUDA events)
        if span is not None:
            return span(lambda: self.run(arg) if self.setup is not None else self.run())
        t0 = timer()
        c0 = time.thread_time() if cpu is not None else 0.0  # (read inside the timer's window)
        self.run(arg) if self.setup is not None else self.run()
        c = time.thread_time() - c0 if cpu is not None else 0.0
        t = timer() - t0
        if cpu is not None:
            cpu.append(min(c, t))
        return t


def time_interleaved(work: dict[Hashable, Callable | Work], rounds: int, passes: int = PASSES,
                     timer: Callable[[], float] = time.perf_counter,
                     until: Callable[[], bool] | None = None,
                     statistic: str = "min", cpu: dict | None = None,
                     cv: dict | None = None, cpu_cv: dict | None = None) -> dict[Hashable, tuple[float, float]]:
    """Per name: (seconds, spread). After one untimed warm-up call of each, ``passes`` x
    ``rounds`` rounds each call every piece of ``work`` once, in the dict's order (F, B, U, F, B,
    U, ...). With t[p][r] the time of round r of pass p and S the ``statistic`` (min or median):

        time = S_{p,r} t[p][r],    spread = max_p m_p / min_p m_p - 1,  m_p = S_r t[p][r]

    ``min`` is the quiet value (a busy machine only inflates calls); ``median`` the typical call
    (a dist worker's start-up profile: its run's steps are made of typical calls).

    ``work`` values are zero-argument callables or :class:`Work` (with an untimed setup).
    ``until``: after the timed rounds, the work goes on, untimed, a round at a time, until
    ``until()`` is true (a dist worker whose peers still measure: their rounds must see it
    computing, as they will in the run). ``cpu``: a dict that gets, per name, the same
    statistic of the timed calls' thread CPU seconds (:class:`Work`; empty on a device with its
    own timer). ``cv``: a dict that gets, per name, the timed calls' standard deviation over their
    mean (every pass and round: how much one call varies, its drift between passes included);
    ``cpu_cv``: the same of their thread CPU seconds (with ``cpu``)."""
    stat = STATISTICS[statistic]
    items = {name: w if isinstance(w, Work) else Work(w) for name, w in work.items()}
    for w in items.values():
        w(timer)  # warm-up: allocator, caches, lazy initialisation
    runs = {name: [[] for _ in range(passes)] for name in items}  # per name, per pass: the rounds' times
    cpus = {name: [] for name in items} if cpu is not None else {}
    for p in range(passes):
        for _ in range(max(1, rounds)):
            for name, w in items.items():
                runs[name][p].append(w(timer, cpus.get(name)))
    while until is not None and not until():
        for w in items.values():
            w(timer)
    out = {}
    for name, per_pass in runs.items():
        m = [stat(ts) for ts in per_pass]
        out[name] = (stat([t for ts in per_pass for t in ts]), max(m) / min(m) - 1.0 if min(m) > 0 else 0.0)
        if cpus.get(name):
            cpu[name] = stat(cpus[name])
        if cv is not None:
            cv[name] = _cv([t for pass_ in per_pass for t in pass_])
        if cpu_cv is not None and cpus.get(name):
            cpu_cv[name] = _cv(cpus[name])
    return out


def _cv(xs: list[float]) -> float:
    """Standard deviation over mean (0 for fewer than two values or a mean of 0)."""
    mean = statistics.fmean(xs)
    return statistics.pstdev(xs) / mean if mean > 0 and len(xs) > 1 else 0.0


def stage_work(stage: GPTStage, make_optimizer: Callable[[list], StageOptimizer], tokens: torch.Tensor,
               targets: torch.Tensor, precision: str = "fp32", grad_clip: float = 0.0,
               signal_rows: int = 0) -> tuple[dict[str, Work], float]:
    """The forward, backward and update of a copy of ``stage`` on one microbatch, one copy of its
    parameters (a stash or a shadow), one element-wise pass ``w + d * u`` over them (a
    prediction; the velocity's EMA and nesterov's step are passes of the same size) and one
    ``acc += g`` of a gradient into an accumulator, as :class:`Work` for :func:`time_interleaved`
    (and under ``("held_forward", d)`` and ``("held_backward", d)`` a forward and a backward with
    ``d`` microbatches' graphs alive, its own included, for each d of :data:`HELD_DEPTHS`; and
    with ``signal_rows``, under ``"signal"`` the forward without gradient of the held-out signal's
    ``signal_rows`` rows, the loss included at the last stage), and the bytes of one microbatch's activation (sent in fp32 whatever the precision). The update
    is the executor's: the squared norm of the gradient (every update computes it: the global
    norm's share), with ``grad_clip > 0`` the clipping multiply, then the optimizer's step."""
    # imported here: the package's import costs about 2 s on 2 cores (the executor's input_grad)
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    st = copy.deepcopy(stage)
    params = list(st.parameters())
    rows, seq = tokens.shape
    x = tokens if st.first else _stage_input(tokens, st.cfg.d_model)

    def forward_of(module: GPTStage, inp: torch.Tensor = x, tgt: torch.Tensor = targets) -> Callable[[], torch.Tensor]:
        def run():
            with autocast(tokens.device, precision):
                out = module(inp)
            return lm_loss(out.float(), tgt) if st.last else out
        return run

    fwd = forward_of(st)
    grad = None if st.last else torch.randn_like(fwd())
    inputs = params if st.first else [x, *params]
    velocity = [torch.zeros_like(p) for p in params]
    acc = [torch.zeros_like(p) for p in params]

    # The update is timed on the stage's own gradients, with the optimizer's moments nonzero
    # wherever a run's gradients have been: one untimed step on a dense gradient first, then each
    # call on a gradient of the stage's own backward (a fresh copy: the clipping multiply scales it
    # in place). Before 5cb814c it was timed on zero gradients, which keep Adam's second moment at
    # 0, and torch's sqrt of zeros took about 20 times as long as of other values on an AVX-512
    # CPU: an AdamW update was charged 1.5 to 1.8 times its cost on a real gradient
    # (docs/results/profile_update.md). One microbatch's gradient alone (5cb814c) leaves the
    # embedding rows of the tokens it lacks at 0, most of a 2048-token vocabulary, where a run has
    # seen most tokens within a few hundred steps (on tinyshakespeare all but 342 of 2048 by step
    # 250). The updates step a copy of their own, so that the forwards and backwards keep timing
    # the stage's weights (a few dozen steps along one gradient carry weights far off).
    real = torch.autograd.grad(fwd(), params, grad, allow_unused=True)
    real = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, real)]
    upd = copy.deepcopy(st)
    upd_params = list(upd.parameters())
    opt = make_optimizer(list(upd.named_parameters()))
    for p in upd_params:  # (drawn by the CPU's generator, which measure_profile restores)
        p.grad = torch.randn(p.shape, dtype=p.dtype).to(p.device)
    opt.step(1.0)

    def fresh_grads():
        for p, g in zip(upd_params, real):
            p.grad = g.clone()

    def split(y):  # a backward's I, untimed, before its W is timed
        return stage_backward_input([y], None if st.last else [grad], [x], iter(params))[1]

    def weight_of(groups):
        for p in params:
            p.grad = None
        stage_backward_weight(iter(params), groups)

    def update():
        grads = [p.grad for p in upd_params]
        float(torch.stack([torch.linalg.vector_norm(g) for g in grads]).pow(2).sum())
        if grad_clip > 0:  # the clipping multiply, charged always (it runs whenever the norm exceeds grad_clip)
            for g in grads:
                g.mul_(0.5)
        opt.step(1.0)

    if st.first:  # no input gradient: the W is the whole backward
        input_work = Work(lambda: None)
        weight_work = Work(lambda y: torch.autograd.grad(y, params, grad, allow_unused=True), setup=fwd)
    else:
        input_work = Work(lambda y: stage_backward_input([y], None if st.last else [grad], [x], iter(params)), setup=fwd)
        weight_work = Work(weight_of, setup=lambda: split(fwd()))
    # the in-flight timings run on a copy of their own: their graphs outlive the rounds' other work
    # (a copy's weights, which nothing changes in place, are safe to keep graphs of)
    held_st = copy.deepcopy(st)
    held_params = list(held_st.parameters())
    held_inputs = held_params if st.first else [x, *held_params]
    held_fwd = forward_of(held_st)

    pools = {d: deque() for d in HELD_DEPTHS}  # per depth: the other microbatches' graphs kept alive

    def keep(pool: deque, n: int) -> deque:  # (untimed) exactly n graphs in the pool
        while len(pool) > n:
            pool.popleft()
        while len(pool) < n:
            pool.append(held_fwd())
        return pool

    work = {
        "forward": Work(fwd),
        # the backward alone: each call differentiates a graph built (untimed) just before
        "backward": Work(lambda y: torch.autograd.grad(y, inputs, grad, allow_unused=True), setup=fwd),
        "update": Work(lambda _: update(), setup=fresh_grads),
        "copy": Work(lambda: [p.detach().clone() for p in params]),
        "predict": Work(lambda: [p.detach() + 2 * g for p, g in zip(params, velocity)]),
        "accumulate": Work(lambda: [a.add_(g) for a, g in zip(acc, velocity)]),
        "input": input_work,
        "weight": weight_work,
    }
    if signal_rows:  # the held-out signal's forward: the microbatch's rows repeated to its size
        reps = -(-signal_rows // rows)
        sx = x.detach().repeat(reps, *[1] * (x.dim() - 1))[:signal_rows]
        work["signal"] = Work(torch.no_grad()(forward_of(st, sx, targets.repeat(reps, 1)[:signal_rows])))
    for d, pool in pools.items():  # d microbatches in flight, the timed one's included (``held``)
        work[("held_forward", d)] = Work(lambda q: q.append(held_fwd()), setup=lambda q=pool, d=d: keep(q, d - 1))
        work[("held_backward", d)] = Work(lambda y: torch.autograd.grad(y, held_inputs, grad, allow_unused=True),
                                          setup=lambda q=pool, d=d: keep(q, d).popleft())
    return work, float(rows * seq * st.cfg.d_model * 4)


def _stage_input(tokens: torch.Tensor, d_model: int) -> torch.Tensor:
    """A random activation entering a stage, drawn on the CPU (:func:`measure_profile` restores the
    CPU's random state) and moved to the tokens' device."""
    rows, seq = tokens.shape
    return torch.randn(rows, seq, d_model).to(tokens.device).requires_grad_(True)


def device_timer(tokens: torch.Tensor, timer: Callable[[], float]) -> Callable[[], float]:
    """CUDA events on a CUDA device (unless a test gave its own clock), else ``timer``."""
    return EventTimer(tokens.device) if tokens.device.type == "cuda" and timer is time.perf_counter else timer


def unsteady(spread: dict[str, list[float]], times: dict[str, list[float]],
             shared: tuple[int, int] | None = None) -> str | None:
    """One warning line naming the stage and kind of work whose two passes disagree most among those
    whose spread exceeds :data:`SPREAD_LIMIT` and :data:`SPREAD_FLOOR_S` in seconds (microsecond
    work, a weight copy or an empty input gradient, jitters by large factors and must not hide a
    slow forward's spread); else None. ``shared``: (threads, cores) where the dist workers measuring
    side by side need more threads than the machine has cores, the likely cause then."""
    over = [(s, kind) for kind in spread for s in range(len(spread[kind]))
            if spread[kind][s] > SPREAD_LIMIT and spread[kind][s] * times[kind][s] > SPREAD_FLOOR_S]
    if not over:
        return None
    s, kind = max(over, key=lambda sk: spread[sk[1]][sk[0]])
    value = spread[kind][s]
    head = f"adapipe: warning: unsteady cost profile: stage {s}'s {kind} took {1 + value:.1f}x as long in one measuring pass as in the other"
    if shared:
        return (f"{head} (the workers' {shared[0]} threads share {shared[1]} cores), so the pipeline clock may be "
                f"wrong; measure once with `adapipe profile` (one stage at a time) and reuse it with "
                f"pipeline.profile=FILE, or run at most {shared[1]} single-threaded stages on this machine")
    return (f"{head} (other work on this machine?), so the pipeline clock may be wrong; for a quiet measurement "
            f"use pipeline.threads=1 on an idle machine, or measure once with `adapipe profile` and reuse it with "
            f"pipeline.profile=FILE")


def measure_profile(stages: list[GPTStage], make_optimizer: Callable[[list], StageOptimizer], tokens: torch.Tensor,
                    targets: torch.Tensor, reps: int = 5, meta: dict | None = None,
                    timer: Callable[[], float] = time.perf_counter,
                    warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                    precision: str = "fp32", grad_clip: float = 0.0,
                    make_batch: Callable[[int], object] | None = None,
                    until: Callable[[], bool] | None = None, statistic: str = "min",
                    signal_rows: int = 0, cpu_time: bool = False, spread_cv: bool = False) -> CostProfile:
    """The cost profile of a pipeline: every stage's work timed by :func:`time_interleaved` in one
    sequence of rounds (stage 0's F, B, U, stage 1's, ...), so each pass goes over all the stages;
    an unsteady measurement is reported with ``warn`` (:func:`unsteady`). ``make_batch(t)``: the
    data source's batch of step ``t`` (each call a step not made before), timed as every stage's
    ``data`` cost (the clock charges it where a stage reads the batch); None: data costs nothing.
    ``until``, ``statistic``: :func:`time_interleaved`'s (keep computing, untimed, until the peers
    are done; ``min``, the quiet value, or ``median``, the typical call). ``signal_rows``: the
    held-out signal's forward of that many rows is timed too (``CostProfile.signal``; 0: not).
    ``cpu_time``: the same statistic of each kind's thread CPU seconds goes into ``meta["cpu"]``
    (per kind, per stage; on a CPU device only): its work on one core, which the stages of a
    pipeline that share fewer cores than they are take turns at (:mod:`..simulator.shared`).
    ``spread_cv``: each kind's calls' standard deviation over their mean goes into ``meta["cv"]``
    (per kind, per stage): how much an action varies, for :mod:`..simulator.jitter`; with
    ``cpu_time``, that of their thread CPU seconds into ``meta["cpu_cv"]``."""
    state = torch.random.get_rng_state()
    timer = device_timer(tokens, timer)
    try:
        work, act_bytes = {}, 0.0
        for s, stage in enumerate(stages):
            w, b = stage_work(stage, make_optimizer, tokens, targets, precision, grad_clip, signal_rows)
            w["data"] = Work(lambda: None) if make_batch is None else Work(_fresh_batches(make_batch))
            work.update({(s, kind): w[kind] for kind in (*KINDS, "signal") if kind in w})
            work.update({(s, key): w[key] for key in w if isinstance(key, tuple)})
            act_bytes = act_bytes or b
        cpu = {} if cpu_time and tokens.device.type == "cpu" else None
        cv = {} if spread_cv else None
        cpu_cv = {} if spread_cv and cpu is not None else None
        t = time_interleaved(work, reps, timer=timer, until=until, statistic=statistic, cpu=cpu, cv=cv, cpu_cv=cpu_cv)
        work.clear()  # (the in-flight pools' graphs: freed before the memory is measured)
        w = None
        mem = [stage_memory(stage, make_optimizer, tokens, targets, precision) for stage in stages]
    finally:
        torch.random.set_rng_state(state)
    times = {kind: [t[(s, kind)][0] for s in range(len(stages))] for kind in KINDS}
    if make_batch is None:
        times["data"] = [0.0] * len(stages)
    spread = {kind: [round(t[(s, kind)][1], 4) for s in range(len(stages))] for kind in KINDS}
    line = unsteady(spread, times) if reps >= MIN_ROUNDS else None
    if line:
        warn(line)
    signal = [t[(s, "signal")][0] for s in range(len(stages))] if signal_rows else []
    meta = {**(meta or {}), "method": f"{statistic} over {PASSES} passes x {max(1, reps)} interleaved rounds",
            "statistic": statistic, "spread": spread, **({"signal_rows": signal_rows} if signal_rows else {})}
    if cpu:
        meta["cpu"] = {kind: [cpu[(s, kind)] for s in range(len(stages))] for kind in (*KINDS, "signal")
                       if all((s, kind) in cpu for s in range(len(stages)))}
        if make_batch is None:
            meta["cpu"]["data"] = [0.0] * len(stages)
    if cv is not None:
        meta["cv"] = {kind: [round(cv[(s, kind)], 4) for s in range(len(stages))] for kind in KINDS}
    if cpu_cv:
        meta["cpu_cv"] = {kind: [round(cpu_cv[(s, kind)], 4) for s in range(len(stages))] for kind in KINDS
                          if all((s, kind) in cpu_cv for s in range(len(stages)))}
    memory = {k: [m[k] for m in mem] for k in ("params", "optimizer", "activation")}
    return CostProfile(times["forward"], times["backward"], times["update"], act_bytes, meta,
                       copy=times["copy"], predict=times["predict"], memory=memory,
                       input=times["input"], weight=times["weight"], accumulate=times["accumulate"],
                       data=times["data"], held=held_table(t, len(stages)), signal=signal)


def held_table(t: dict, stages: int) -> dict:
    """The profile's ``held`` table from :func:`time_interleaved`'s times of the ``held_forward``
    and ``held_backward`` work (:func:`stage_work`): per stage, the time at each depth over the
    time at 1, held non-decreasing and at least 1 (more microbatches in flight never make an
    action cheaper; a factor below is the rounds' noise)."""
    out = {"depths": list(HELD_DEPTHS)}
    for name, key in (("forward", "held_forward"), ("backward", "held_backward")):
        rows = []
        for s in range(stages):
            base, row = t[(s, (key, 1))][0], []
            for d in HELD_DEPTHS:
                f = t[(s, (key, d))][0] / base if base > 0 else 1.0
                row.append(round(max(f, row[-1] if row else 1.0, 1.0), 4))
            rows.append(row)
        out[name] = rows
    return out


def _fresh_batches(make_batch: Callable[[int], object]) -> Callable[[], object]:
    """``make_batch`` of steps 10^6, 10^6 + 1, ...: each timed call makes a batch not made before."""
    steps = iter(range(10**6, 10**7))
    return lambda: make_batch(next(steps))


def stage_memory(stage: GPTStage, make_optimizer: Callable[[list], StageOptimizer], tokens: torch.Tensor,
                 targets: torch.Tensor, precision: str = "fp32") -> dict:
    """Bytes of one parameter set, of the optimizer state (after one update) and of what autograd
    saves for the backward of one microbatch (counted with saved-tensor hooks; a tensor saved
    twice counts once), in the dtypes held: under bf16 autocast the saved activations are mostly
    bf16, and the bf16 casts of the weights a forward makes are saved with its graph (per
    microbatch: each forward enters autocast anew), so they count as activation bytes."""
    st = copy.deepcopy(stage)
    params = list(st.parameters())
    nbytes = lambda ts: float(sum(t.numel() * t.element_size() for t in ts))  # noqa: E731
    opt = make_optimizer(list(st.named_parameters()))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step(0.0)
    state = [v for o in opt.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    x = tokens if st.first else _stage_input(tokens, st.cfg.d_model)
    ids = {id(p) for p in params} | {id(x)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if id(t) not in ids:  # parameters and the input are held anyway
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(tokens.device, precision):
            out = st(x)
        if st.last:
            lm_loss(out.float(), targets)
    return {"params": nbytes(params), "optimizer": nbytes(state), "activation": float(sum(saved.values()))}


def join_profiles(parts: list[CostProfile], warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                  rounds: int = MIN_ROUNDS, chunks: int = 1, shared: tuple[int, int] | None = None) -> CostProfile:
    """The profile of a pipeline whose stage ``s`` was measured alone, where it runs, as the
    one-stage ``parts[s]`` (the dist runtime's workers, each on its own device); an unsteady
    measurement is reported with ``warn`` as :func:`measure_profile` does (``rounds`` per pass;
    ``shared``: (threads, cores) where the workers outnumber the cores, :func:`unsteady`). With ``chunks`` per worker, ``parts[d]`` holds device ``d``'s chunks, and virtual stage ``c``
    is its entry ``c // p`` of ``parts[c % p]``."""
    p = len(parts)
    at = [(c % p, c // p) for c in range(p * chunks)]  # virtual stage -> (part, entry)
    col = lambda name: [getattr(parts[d], name)[j] for d, j in at]  # noqa: E731
    times = {kind: col(kind) for kind in KINDS}
    spread = {kind: [parts[d].meta.get("spread", {}).get(kind, [0.0] * chunks)[j] for d, j in at] for kind in KINDS}
    line = unsteady(spread, times, shared) if rounds >= MIN_ROUNDS else None
    if line:
        warn(line)
    meta = {**parts[0].meta, "method": f"{parts[0].meta.get('method', '')}, each stage where it runs",
            "spread": spread, "devices": [parts[d].meta.get("device") for d, _ in at]}
    memory = {k: [parts[d].memory[k][j] for d, j in at] for k in ("params", "optimizer", "activation") if parts[0].memory.get(k)}
    held = ({"depths": parts[0].held["depths"], **{k: [parts[d].held[k][j] for d, j in at] for k in ("forward", "backward")}}
            if all(pt.held for pt in parts) else {})
    signal = col("signal") if all(pt.signal for pt in parts) else []
    if not signal:
        meta.pop("signal_rows", None)
    for key in ("cpu", "cv", "cpu_cv"):  # (measure_profile's cpu_time and spread_cv: per kind, per stage)
        per = [pt.meta.get(key) or {} for pt in parts]
        meta.pop(key, None)
        kinds = [k for k in per[0] if all(k in c for c in per)]
        if kinds:
            meta[key] = {k: [per[d][k][j] for d, j in at] for k in kinds}
    return CostProfile(times["forward"], times["backward"], times["update"], parts[0].act_bytes, meta,
                       copy=times["copy"], predict=times["predict"], memory=memory,
                       input=times["input"], weight=times["weight"], accumulate=times["accumulate"],
                       data=times["data"], held=held, signal=signal)
