"""Where a distributed run's time goes, per action kind, against what its cost profile charges.

Each dist worker keeps an :class:`ActionTimes`: per (virtual) stage and kind of action (F, B, I,
W, U) the actions run, their wall seconds computing (time blocked in the transport excluded, as
in ``busy``), their main-thread CPU seconds and the extra work the ledger counted for them
(copies, predictions, recomputed forwards, gradient accumulations, batches made); and per worker its clocks:
wall, process CPU (every thread: gloo's too), main-thread CPU, and the seconds blocked on a
neighbour, on the driver (gate and phases), in the held-out signal, in evaluations and
checkpoints and in its reports.

A worker takes a snapshot after its update of step ``warm - 1`` (:func:`warm_steps`: the first
steps warm allocators and caches up) and after each later update; the driver turns the first and
the last into ``summary.json``'s ``action_times`` (:func:`action_table`):

    run_s      = wall computing / count              cpu_s = main-thread CPU / count
    run_sd_s   = the standard deviation of one action's wall seconds computing (how much the
                 actions of a kind vary: a simulator of mean costs leaves their jitter out)
    profiled_s = (count x profile.cost(s, kind) at the actions' mean in-flight count
                  + the ledger's extra work at its profiled costs) / count

and per worker, per step of the window: ``step_s`` (wall), ``wait_peer_s``, ``wait_driver_s``,
``report_s``, ``signal_s`` (the held-out signal's forwards, with their waits for the stage
before), ``between_s`` (wall outside actions, gates, reports, signals, evaluations and checkpoints:
the loop's own overhead) and ``other_threads_cpu_s`` (process CPU not on the main thread: the
transport's threads). ``run_s / profiled_s`` is how far the run's actions are from the clock's.
"""

from __future__ import annotations

import copy
import time

from ..schedules import BACKWARD, FORWARD, INPUT, UPDATE, WEIGHT
from ..simulator.clock import EXTRA_WORK, CostProfile

TIMED = (FORWARD, BACKWARD, INPUT, WEIGHT, UPDATE)  # the kinds the clock charges
WORK = ("copy", "predict", "recompute", "accumulate", "data", "held")  # the ledger's extra work, in that order
# (and the microbatches each action held in flight, summed like the work: a row's per-action mean)
CLOCKS = ("wall", "cpu_process", "cpu_main", "wait_peer", "wait_driver", "eval", "save", "signal", "report", "execute")
WARM = 5  # steps left out at the start (at most a quarter of the run)


def warm_steps(max_steps: int) -> int:
    """Steps before the window: ``min(5, max_steps // 4)``."""
    return min(WARM, max_steps // 4)


class ActionTimes:
    """One worker's counters (see the module docstring). ``acts[(stage, kind)]`` is
    ``[count, wall, cpu, copy, predict, recompute, accumulate, data, held, wall^2]`` (held: the
    sum of the actions' in-flight counts; wall^2: of their wall seconds'); ``clocks`` the worker's
    cumulative seconds of :data:`CLOCKS` other than the three read from the OS at a snapshot."""

    def __init__(self):
        self.acts: dict[tuple[int, str], list[float]] = {}
        self.clocks = {k: 0.0 for k in ("report", "execute")}
        self.start: dict | None = None  # the window's first snapshot
        self.end: dict | None = None  # its latest

    def add(self, stage: int, kind: str, wall: float, cpu: float, work: dict) -> None:
        """One action of ``kind`` at ``stage``: ``wall`` seconds computing, ``cpu`` on the main thread."""
        if kind not in TIMED:
            return
        row = self.acts.setdefault((stage, kind), [0.0] * (4 + len(WORK)))
        row[0] += 1
        row[1] += wall
        row[2] += cpu
        for i, k in enumerate(WORK):
            row[3 + i] += work.get(k, 0)
        row[-1] += wall * wall

    def snapshot(self, step: int, waits: dict) -> dict:
        """The counters now, after ``U(step)``; ``waits``: the worker's cumulative ``wait_peer``,
        ``wait_driver``, ``eval``, ``save`` and ``signal`` seconds."""
        return {"step": step, "wall": time.perf_counter(), "cpu_process": time.process_time(),
                "cpu_main": time.thread_time(), **self.clocks, **waits,
                "acts": {f"{s}/{k}": list(v) for (s, k), v in self.acts.items()}}

    def mark(self, step: int, warm: int, waits: dict) -> None:
        """After the worker's update of ``step``: the window starts at ``warm - 1`` (or at the
        first step seen, a resumed run's) and ends at the latest."""
        snap = self.snapshot(step, waits)
        if self.start is None and step >= warm - 1:
            self.start = snap
        self.end = snap

    def window(self) -> dict | None:
        """{"steps", "clocks": per step, "acts": totals} between the first and the latest
        snapshot, or None when the window holds no step."""
        a, b = self.start, self.end
        if a is None or b is None or b["step"] <= a["step"]:
            return None
        steps = b["step"] - a["step"]
        acts = {}
        for key, row in b["acts"].items():
            before = a["acts"].get(key, [0.0] * len(row))
            d = [x - y for x, y in zip(row, before)]
            if d[0] > 0:
                acts[key] = d
        return {"steps": steps, "clocks": {k: (b[k] - a[k]) / steps for k in CLOCKS}, "acts": copy.deepcopy(acts)}


def action_table(windows: list[dict | None], profile: CostProfile | None) -> dict | None:
    """``summary.json``'s ``action_times`` from each rank's :meth:`ActionTimes.window` (rank
    order) and the run's cost profile (see the module docstring); None without any window."""
    if not any(windows):
        return None
    rows = []
    for r, w in enumerate(windows):
        for key, (n, wall, cpu, *work) in sorted((w or {}).get("acts", {}).items(),
                                                 key=lambda kv: (int(kv[0].split("/")[0]), TIMED.index(kv[0].split("/")[1]))):
            s, kind = int(key.split("/")[0]), key.split("/")[1]
            work, wall_sq = work[:len(WORK)], work[len(WORK)]
            row = {"rank": r, "stage": s, "kind": kind, "count": int(n), "run_s": wall / n, "cpu_s": cpu / n,
                   "run_sd_s": max(0.0, wall_sq / n - (wall / n) ** 2) ** 0.5}
            if profile is not None and s < profile.stages:
                extra = dict(zip(WORK, work))
                # (each action at the mean in-flight count: exact where the counts share a linear segment
                # of the table, e.g. all at most 4; a row with counts on both sides of 4 is charged a
                # little more than its actions' own factors would give)
                held = {"held": extra.pop("held") / n}
                charged = n * profile.cost(s, kind, held) + profile.cost(s, kind, extra) - profile.cost(s, kind)
                row["profiled_s"] = charged / n
                row["ratio"] = row["run_s"] / row["profiled_s"] if row["profiled_s"] > 0 else None
            row.update({k: v / n for k, v in zip(WORK, work) if v})  # extra work per action
            rows.append(row)
    ranks = []
    for r, w in enumerate(windows):
        if not w:
            continue
        c = w["clocks"]
        between = c["wall"] - c["execute"] - c["wait_driver"] - c["report"] - c["eval"] - c["save"] - c["signal"]
        ranks.append({"rank": r, "steps": w["steps"], "step_s": c["wall"], "wait_peer_s": c["wait_peer"],
                      "wait_driver_s": c["wait_driver"], "report_s": c["report"], "signal_s": c["signal"],
                      "between_s": between,
                      "cpu_main_s": c["cpu_main"], "other_threads_cpu_s": max(0.0, c["cpu_process"] - c["cpu_main"])})
    return {"actions": rows, "ranks": ranks,
            "method": "per step or per action over the steady steps (the first min(5, steps / 4) left out); run_s: wall "
                      "computing, transport waits excluded; profiled_s: the profile's charge for the same actions and "
                      "extra work"}


FIELD = {FORWARD: "forward", BACKWARD: "backward", INPUT: "input", WEIGHT: "weight", UPDATE: "update"}


def in_run_profile(table: dict, profile: CostProfile) -> CostProfile | None:
    """``profile`` with each stage's costs as the run's actions took them: what the simulator
    predicts when it is given a run's steady costs. Of the same run, its remaining gap to the
    measured step is the schedule's timing, the link and the loop, not the costs (a diagnostic);
    of another run on the same machine (a dist run writes it as ``profile_in_run.json``), it is a
    profile measured as a pipeline computes, for the local clock and the simulator. None when the
    table has no action of a kind the clock charges.

    The run times whole actions, not the extra work inside them (copies, predictions,
    accumulations, batches made, recomputed forwards), so that part is an assumption: a stage's
    extra work (and the held-out signal's forward) is scaled by the stage's run over charged time
    over all its actions, and so is a
    kind of action the run did not do at the stage, except the I and W of a stage that ran whole
    backwards (a 1F1B run's, for a zero-bubble schedule): those by its backwards' run over charged
    time. Each kind's own cost at a stage is then what makes the profile charge exactly the
    run's time for that stage's actions of that kind (summed over ranks, with replicas): ``(sum
    n run_s - the extra work at the scaled costs) / sum n h``, at least 0, with h the profile's
    in-flight factor at the row's mean in-flight count (1 without a ``held`` table): the cost at
    one microbatch in flight; forwards first, so that a recomputed forward costs the new forward."""
    rows = [r for r in table.get("actions", []) if r["kind"] in FIELD and r["count"] > 0]
    if not rows:
        return None
    prof = copy.deepcopy(profile)
    for s in range(prof.stages):
        mine = [r for r in rows if r["stage"] == s]
        charged = sum(r["count"] * r.get("profiled_s", 0.0) for r in mine)
        if mine and charged > 0:
            ratio = sum(r["count"] * r["run_s"] for r in mine) / charged
            for name in EXTRA_WORK:
                getattr(prof, name)[s] *= ratio
            if prof.signal:  # (the held-out signal's forward, not an action of the table: as the extra work)
                prof.signal[s] *= ratio
            # (the I and W of a stage that ran whole backwards: as its backwards, I + W being a B)
            backs = [r for r in mine if r["kind"] == BACKWARD and r.get("profiled_s", 0.0) > 0]
            b_ratio = (sum(r["count"] * r["run_s"] for r in backs) / sum(r["count"] * r["profiled_s"] for r in backs)
                       if backs else ratio)
            for kind in TIMED:
                if not any(r["kind"] == kind for r in mine):
                    getattr(prof, FIELD[kind])[s] *= b_ratio if kind in (INPUT, WEIGHT) else ratio
        for kind in TIMED:  # (FORWARD first: a recompute in a backward costs the new forward)
            of_kind = [r for r in mine if r["kind"] == kind]
            if not of_kind:
                continue
            # the kind's cost at one microbatch in flight, times each row's in-flight factor
            n = sum(r["count"] * prof.held_factor(s, kind, r.get("held", 1)) for r in of_kind)
            extra = sum(r["count"] * (prof.cost(s, kind, {k: r.get(k, 0) for k in WORK if k != "held"}) - prof.cost(s, kind))
                        for r in of_kind)
            getattr(prof, FIELD[kind])[s] = max(0.0, (sum(r["count"] * r["run_s"] for r in of_kind) - extra) / n)
    prof.meta = {**prof.meta, "in_run": "costs from the run's steady actions (runtime.action_times.in_run_profile)"}
    return prof


__all__ = ["ActionTimes", "action_table", "in_run_profile", "warm_steps"]
