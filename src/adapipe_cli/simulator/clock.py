"""Pipeline time: a discrete-event model of p devices executing the stages' action lists.

An action starts when its stage is free and its input has arrived, and lasts its cost:

- ``F(j)`` at stage s > 0 waits for ``F(j)`` at s-1 plus the link time of one activation;
- ``B(j)`` at stage s < p-1 waits for ``B(j)`` at s+1 plus the link time of one gradient;
- a synchronous ``U(t)`` is a collective (global gradient norm): it starts when every stage has
  arrived at it, plus the collective's ``p - 1`` link latencies (gloo's ring all-gather of p
  numbers); without the barrier (ZB-H2's) when its stage is free;
- with R replicas of the pipeline, every ``U(t)`` at stage s is preceded by the all-reduce of the
  stage's gradient with its R-1 copies (:class:`AllReduceModel`), which keeps the stage busy
  communicating (drawn as ``A``; not counted as compute in ``busy``);
- with a held-out signal (``signal``: per stage, its forward's seconds, :meth:`CostProfile.signal_costs`),
  every ``U(t)`` at stage s is followed by the stage's share of the signal's forward: AdaPipe's
  heuristics follow the held-out loss after every step, work the fixed schedules do not do, so
  the stage is busy for it (drawn as ``S``) before its next action. It does not wait for the
  stage before: the held-out batch is charged as if it went through the pipeline as a
  forward-only microbatch (the dist runtime's workers chain it, each waiting for the one before,
  and its wall clock counts that wait too).

The link (:class:`LinkModel`) is a configured one (``pipeline.link_latency_s``,
``pipeline.link_bandwidth``) or, when none is, the one a distributed run measured at start-up and
stored in its cost profile (``link``); with neither, communication is free, as in one process.

The local runtime feeds this clock with measured (or profiled) costs, so its ``time_s`` is the
time a pipeline of p devices, each as fast as this machine's core, would have taken. The simulator
feeds it with a cost profile and no computation. Both give the same times for the same lists and
costs, whatever order the actions are processed in (an action's times depend only on its
predecessors).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..schedules import BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Action


ALLREDUCE = "A"  # a stage's gradient all-reduce across replicas, before its update (not a schedule action)
SIGNAL = "S"  # a stage's share of the held-out signal's forward, after its update (not a schedule action)
EXTRA_WORK = ("copy", "predict", "accumulate", "data")  # work an action may do besides its own kind (see schedules/ledger.py)


@dataclass
class CostProfile:
    """Per-stage seconds of one microbatch's forward and backward, of one update, of one copy of
    the stage's parameters (``copy``: stashing, shadowing) and of one element-wise pass over them
    (``predict``: a weight prediction, the velocity's EMA, nesterov's step); the bytes of one
    microbatch's activation sent to the next stage (its gradient has the same size); of one
    element-wise add of a microbatch's weight gradient into its step's accumulator
    (``accumulate``: every backward of a step but its first does one); of making one step's batch
    (``data``: the first and the last stage each make it, at their first forward of the step); and per
    stage the bytes of one parameter set, of the optimizer state and of one microbatch's saved
    activations (``memory``, for the memory ledger). A recomputed forward (``weights=latest``)
    costs ``forward``. A backward split in two (zero-bubble schedules) costs ``input`` and
    ``weight`` (measured; a profile without them splits ``backward`` in halves). ``link``: the
    link between stages that a distributed run measured at start-up (empty: none measured).

    ``held``: what holding other microbatches in flight costs (empty: nothing, a profile from
    before it). An action's own cost grows with the microbatches whose activations its stage
    holds while it runs, its own included (the ledger's ``held``): their saved tensors push each
    other out of the caches. ``held["depths"]`` are the counts measured (1 first),
    ``held["forward"][s]`` and ``held["backward"][s]`` the forward's and the backward's cost at
    each depth over its cost at 1 (the backward's for I and W too); between depths the factor is
    interpolated linearly, beyond the last it stays. Measured (gpt-micro, microbatch 4 x 64, one
    CPU thread, ``scripts/bench_accounting.py``, docs/results/accounting_held.md): the first
    stage's backward takes 1.05 to 1.14x its time with 4 microbatches in flight, its forward 1.00x,
    so PipeDream's first stage at depth 4 (4 in flight) pays that where 1F1B with one microbatch (1
    in flight) does not.

    ``signal``: per stage, the seconds of the forward (no gradient) of AdaPipe's held-out signal
    batch, ``meta["signal_rows"]`` rows (empty: not measured, a profile from before it; see
    :meth:`signal_costs`). A heuristic that follows the held-out loss evaluates it after every
    step, and the clock charges that (``PipelineClock``'s ``signal``)."""

    forward: list[float]
    backward: list[float]
    update: list[float]
    act_bytes: float = 0.0
    meta: dict = field(default_factory=dict)
    copy: list[float] = field(default_factory=list)
    predict: list[float] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # params / optimizer / activation: lists of bytes per stage
    input: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    link: dict = field(default_factory=dict)  # measured by a dist run: latency_s, bandwidth (bytes/s)
    accumulate: list[float] = field(default_factory=list)
    data: list[float] = field(default_factory=list)
    held: dict = field(default_factory=dict)  # depths, forward and backward factors per stage (see above)
    signal: list[float] = field(default_factory=list)  # the held-out signal's forward per stage (see above)

    def __post_init__(self) -> None:
        p = len(self.forward)
        for name in EXTRA_WORK:  # a profile without them charges nothing for that work
            if not getattr(self, name):
                setattr(self, name, [0.0] * p)
        for name in ("input", "weight"):
            if not getattr(self, name):
                setattr(self, name, [b / 2 for b in self.backward])

    @property
    def stages(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward: float = 2.0, update: float = 0.0, act_bytes: float = 0.0,
                copy: float = 0.0, predict: float = 0.0) -> "CostProfile":
        return cls([forward] * stages, [backward] * stages, [update] * stages, act_bytes,
                   copy=[copy] * stages, predict=[predict] * stages)

    def cost(self, stage: int, kind: str, work: dict | None = None) -> float:
        """Seconds of an action of ``kind`` at ``stage`` that also did ``work`` (the ledger's
        counts of copies, predictions and recomputed forwards, and for a forward or backward the
        microbatches ``held`` in flight while it ran: :meth:`held_factor`)."""
        return self.costs(stage, kind, work)[2]

    def costs(self, stage: int, kind: str, work: dict | None = None) -> tuple[float, float, float]:
        """(base, own, cost) of an action of ``kind`` at ``stage`` that did ``work``: its cost
        without ``work``, with only its ``held`` (its in-flight count's toll), and with all of it
        (:meth:`cost`), in one pass (the simulator's inner loop needs all three). Work of only
        ``held`` adds nothing; until 2026-12-06 it added zero times each extra cost, which differs
        only where one of those is infinite or NaN, which no measured profile holds."""
        if kind == FORWARD:
            c = self.forward[stage]
        elif kind == BACKWARD:
            c = self.backward[stage]
        elif kind == UPDATE:
            c = self.update[stage]
        elif kind == INPUT:
            c = self.input[stage]
        elif kind == WEIGHT:
            c = self.weight[stage]
        else:
            return 0.0, 0.0, 0.0
        base = c
        if work:
            held = work.get("held")
            if held is not None:
                c *= self.held_factor(stage, kind, held)
            own = c
            if len(work) > (held is not None):  # (work beyond the in-flight count)
                c += (work.get("copy", 0) * self.copy[stage] + work.get("predict", 0) * self.predict[stage]
                      + work.get("recompute", 0) * self.forward[stage] + work.get("accumulate", 0) * self.accumulate[stage]
                      + work.get("data", 0) * self.data[stage])
            return base, own, c
        return base, base, base

    def signal_costs(self, rows: int, microbatch_rows: int | None = None) -> list[float]:
        """Per stage, the seconds of the held-out signal's forward of ``rows`` rows: the measured
        ``signal`` at its rows, scaled linearly from them at other rows; without a measurement (a
        profile from before it, or written by hand) the training forward scaled by rows over the
        microbatch's (the profile's, else ``microbatch_rows``, the run's), an estimate: on one CPU
        thread (gpt-micro, microbatch 4 x 64) a forward without gradient of 8 rows took 1.7x a
        training forward of 4, where the estimate charges 2x, and one of 1 row 0.4x, where it
        charges 0.25x."""
        measured = self.meta.get("signal_rows")
        if self.signal and measured:
            return [c * rows / measured for c in self.signal]
        per = self.meta.get("microbatch_size") or microbatch_rows
        if not per:
            raise ValueError("the cost profile says neither its signal's nor its microbatch's rows: measure it again")
        return [f * rows / per for f in self.forward]

    def held_factor(self, stage: int, kind: str, held: float) -> float:
        """An action's cost with ``held`` microbatches in flight at its stage over its cost with
        one (its own): ``held``'s table interpolated linearly, flat beyond its last depth; 1
        without a table, for an update, and at one microbatch or none."""
        if not self.held or kind == UPDATE or held <= 1:
            return 1.0
        depths = self.held["depths"]
        table = self.held["forward" if kind == FORWARD else "backward"][stage]
        if held >= depths[-1]:
            return table[-1]
        for (d0, f0), (d1, f1) in zip(zip(depths, table), zip(depths[1:], table[1:])):
            if held <= d1:
                return f0 + (f1 - f0) * (max(held, d0) - d0) / (d1 - d0)
        return 1.0

    def stage_bytes(self, stage: int):
        """The memory ledger's sizes of ``stage`` (zeros where the profile has none)."""
        from ..schedules.ledger import StageBytes

        m = self.memory
        get = lambda k: float(m[k][stage]) if m.get(k) else 0.0  # noqa: E731
        return StageBytes(get("params"), get("optimizer"), get("activation"))

    def save(self, path: str | Path) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        Path(tmp).write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        d = json.loads(Path(path).read_text())
        if "copy" not in d or "predict" not in d:
            raise ValueError(f"cost profile {path} has no cost for weight copies and predictions (it predates them): "
                             f"measure it again")
        held = d.get("held", {})
        if held and not (isinstance(held, dict) and isinstance(held.get("depths"), list) and held["depths"][:1] == [1]
                         and len(held.get("forward", [])) == len(held.get("backward", [])) == len(d["forward"])
                         and all(len(r) == len(held["depths"]) for r in held["forward"] + held["backward"])):
            raise ValueError(f"cost profile {path}: its in-flight table (held) is not depths from 1 and a row of "
                             f"factors per depth for every stage: measure it again")
        signal = d.get("signal", [])
        if signal and (len(signal) != len(d["forward"]) or not d.get("meta", {}).get("signal_rows")):
            raise ValueError(f"cost profile {path}: its held-out signal's costs (signal) are not one per stage with "
                             f"their rows (meta.signal_rows): measure it again")
        return cls(d["forward"], d["backward"], d["update"], d.get("act_bytes", 0.0), d.get("meta", {}),
                   d.get("copy", []), d.get("predict", []), d.get("memory", {}), d.get("input", []), d.get("weight", []),
                   d.get("link", {}), d.get("accumulate", []), d.get("data", []), held, signal)


@dataclass
class LinkModel:
    """Time to move ``n`` bytes between neighbouring stages: ``latency + n / bandwidth``
    (bandwidth 0 means infinite)."""

    latency: float = 0.0
    bandwidth: float = 0.0

    def time(self, nbytes: float) -> float:
        return self.latency + (nbytes / self.bandwidth if self.bandwidth > 0 else 0.0)

    @staticmethod
    def configured(latency: float, bandwidth: float) -> bool:
        """Whether a link is configured (latency or bandwidth not 0): then a profile's is not used."""
        return bool(latency or bandwidth)

    @classmethod
    def choose(cls, latency: float, bandwidth: float, profile: CostProfile | None) -> "LinkModel":
        """The configured link when one is (:meth:`configured`), else the profile's measured one,
        else a free link."""
        if cls.configured(latency, bandwidth) or profile is None or not profile.link:
            return cls(latency, bandwidth)
        return cls(float(profile.link["latency_s"]), float(profile.link["bandwidth"]))


@dataclass
class AllReduceModel:
    """The all-reduce adapipe runs among the same stage of ``replicas`` pipelines: an all_gather of
    the stage's ``n`` flattened gradient bytes, then the sum in replica order (bitwise the same on
    every copy and in the local emulation). A ring all_gather sends R-1 messages of n bytes per rank:
    ``(R-1) * n / bandwidth + (R-1) * latency`` (bandwidth 0 means infinite; a ring all-reduce's
    ``2 (R-1)/R * n`` equals it at R=2 only). One replica costs 0."""

    replicas: int = 1
    bandwidth: float = 0.0  # bytes per second (pipeline.dp_bandwidth)
    latency: float = 0.0  # seconds per message (pipeline.dp_latency_s)

    def time(self, nbytes: float) -> float:
        r = self.replicas
        if r <= 1:
            return 0.0
        volume = (r - 1) * nbytes
        return (volume / self.bandwidth if self.bandwidth > 0 else 0.0) + (r - 1) * self.latency


def allreduce_times(model: AllReduceModel | None, grad_bytes: list[float]) -> list[float] | None:
    """Per stage, seconds of its all-reduce (None: no replicas)."""
    if model is None or model.replicas <= 1:
        return None
    return [model.time(b) for b in grad_bytes]


class PipelineClock:
    """Start and end time of every action, from its cost and its dependencies; ``allreduce``: per
    stage, the seconds of the all-reduce before each of its updates (None: one replica);
    ``signal``: per stage, the seconds of the held-out signal's forward after each of its updates
    (None: no signal)."""

    def __init__(self, stages: int, link: LinkModel | None = None, act_bytes: float = 0.0, barrier: bool = True,
                 stage_device: list[int] | None = None, allreduce: list[float] | None = None,
                 signal: list[float] | None = None):
        # stage_device: the device of each (virtual) stage, when a device holds several (interleaved);
        # ``free`` and ``busy`` are per device, and the stage indices of actions are virtual
        self.device = stage_device or list(range(stages))
        self.p = len(self.device)
        self.barrier = barrier  # a sync update starts when every stage has reached it (ScheduleSpec.barrier)
        self.allreduce = list(allreduce) if allreduce else [0.0] * self.p  # per (virtual) stage
        self.last_allreduce: tuple[float, float] | None = None  # (start, end) of the last update's all-reduce
        self.signal = list(signal) if signal else None  # per (virtual) stage
        self.last_signal: tuple[float, float] | None = None  # (start, end) of the last update's signal forward
        link = link or LinkModel()
        self.link_time = link.time(act_bytes)
        self.collective_time = (stages - 1) * link.latency  # (stages: the devices, ranks of the all-gather)
        self.free = [0.0] * stages
        self.busy = [0.0] * stages
        self._f_end: dict[tuple[int, int], float] = {}
        self._b_end: dict[tuple[int, int], float] = {}
        self._arrivals: dict[int, list[float]] = {}
        self._u_left: dict[int, int] = {}
        self.update_end: dict[int, float] = {}  # step -> end of its last stage's update

    def arrive(self, stage: int, step: int) -> None:
        """Stage ``stage`` has reached the synchronous update of ``step`` (now idle until all have,
        after its all-reduce across replicas)."""
        self._arrivals.setdefault(step, []).append(self.free[self.device[stage]] + self.allreduce[stage])

    def run(self, stage: int, a: Action, cost: float) -> tuple[float, float]:
        """Place action ``a`` of ``stage`` lasting ``cost`` seconds; returns (start, end)."""
        dev, kind = self.device[stage], a.kind
        start = self.free[dev]
        if kind == UPDATE:
            ar = self.allreduce[stage]
            self.last_allreduce = (start, start + ar) if ar > 0 else None
            start += ar
        if kind == FORWARD:
            if stage > 0:
                arrival = self._f_end.pop((stage - 1, a.mb)) + self.link_time
                if arrival > start:
                    start = arrival
        elif kind == BACKWARD or kind == INPUT:
            if stage < self.p - 1:
                arrival = self._b_end.pop((stage + 1, a.mb)) + self.link_time
                if arrival > start:
                    start = arrival
        elif kind == UPDATE and a.phase == SYNC and self.p > 1 and self.barrier:
            start = max(start, max(self._arrivals[a.step]) + self.collective_time)
        elif kind == EVAL:
            return start, start  # evaluation is not on the training clock
        end = start + cost
        if kind == FORWARD:
            if stage < self.p - 1:
                self._f_end[(stage, a.mb)] = end
        elif kind == BACKWARD or kind == INPUT:
            if stage > 0:
                self._b_end[(stage, a.mb)] = end
        elif kind == UPDATE:
            self.update_end[a.step] = max(self.update_end.get(a.step, 0.0), end)
            left = self._u_left.get(a.step, self.p) - 1
            if left:
                self._u_left[a.step] = left
            else:
                self._u_left.pop(a.step, None)
                self._arrivals.pop(a.step, None)
        self.free[dev] = end
        self.busy[dev] += cost
        if kind == UPDATE:
            self.last_signal = None
            if self.signal and self.signal[stage] > 0:
                self.last_signal = (end, end + self.signal[stage])
                self.occupy(stage, self.signal[stage])
        return start, end

    def occupy(self, stage: int, seconds: float) -> None:
        """Keep ``stage``'s device computing ``seconds`` more from where it is free (the held-out
        signal's forward after an update: charged here from the profile, or by the local runtime
        as measured)."""
        dev = self.device[stage]
        self.free[dev] += seconds
        self.busy[dev] += seconds

    def now(self) -> float:
        return max(self.free)

    _STATE = ("free", "busy", "_f_end", "_b_end", "_arrivals", "_u_left", "update_end")

    def state_dict(self) -> dict:
        import copy

        return {k: copy.deepcopy(getattr(self, k)) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        import copy

        for k in self._STATE:
            setattr(self, k, copy.deepcopy(state[k]))
