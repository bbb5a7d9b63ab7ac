"""The buffer ledger: which weight and gradient buffers a stage holds after each action, and what
extra work (weight copies, predictions, recomputed forwards) each action does. Tensor-free.

The stage executor asks it which buffer an action computes with and which buffers to free, and
the simulator drives the same ledger without tensors, so the memory and the extra work both
report cannot drift apart.

Buffers of one stage, each the size of the stage's parameters unless said otherwise:

- ``live``: the parameters the optimizer updates in place (always held);
- ``copy v``: a frozen copy of version ``v``. An asynchronous action computes with a copy of its
  version, made when the version is first used (an update may land between a forward and its
  backward and must not change what the backward differentiates); a *shadow* is a copy of the
  live version, a *stash* a copy of an older one;
- ``pred (v, d, l)``: weights predicted ``d`` steps ahead from version ``v`` with the velocity of
  live version ``l`` (``schedule.mitigation=[predict]``);
- ``grad t``: the gradient accumulator of step ``t``, from its first backward to its update (with a
  split backward, from its first ``W``: an ``I`` keeps its microbatch's activations for the ``W``);
- during an async update with ``predict`` or ``nesterov``, a copy of the weights before it
  (transient; a sync update keeps none and forgets the velocity);
- optimizer state (constant) and the activations of in-flight microbatches (``act_bytes`` each:
  what autograd saves for the backward).

Work an action does besides its own kind: ``copy`` (one parameter-set copy), ``predict`` (one
element-wise pass over the parameters: a prediction, the velocity's EMA, or nesterov's step),
``recompute`` (a forward run again inside the backward, ``weights=latest``) and ``accumulate``
(the microbatch's weight gradient added into its step's accumulator: every backward, or ``W``,
of a step but the first, which becomes the accumulator) and ``data`` (the step's batch made, at
the first forward of each step on the stages that read it: the first, its inputs, and the last,
its targets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .actions import ASYNC, BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Action

LIVE = ("live",)


@dataclass(frozen=True)
class StageBytes:
    """Bytes of one parameter set, of the optimizer state, and of one microbatch's saved
    activations, for one stage (0 where unknown: the ledger then counts buffers only)."""

    params: float = 0.0
    optimizer: float = 0.0
    activation: float = 0.0


@dataclass
class Peak:
    """The most a stage held at once, by kind (parameter sets: live + copies + predictions +
    the transient pre-update copy; gradient accumulators; in-flight microbatches) and in bytes."""

    param_sets: int = 1
    grad_sets: int = 0
    activations: int = 0
    versions: int = 1
    bytes: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    activation_bytes: float = 0.0
    optimizer_bytes: float = 0.0


@dataclass
class Ledger:
    """The buffers of stage ``stage`` (see the module docstring). ``floor()`` is a lower bound on
    the version of every action the stage has not run yet (its program's ``floor_version``)."""

    stage: int
    predict: bool = False  # schedule.mitigation has predict
    keep_before: bool = False  # predict or nesterov: the update keeps a copy of the weights before it
    nbytes: StageBytes = field(default_factory=StageBytes)
    reads_data: bool = False  # the first or the last stage: makes each step's batch
    microbatches: int = 1  # per step (microbatch mb is the step's mb % microbatches-th)
    live: int = 0
    copies: set = field(default_factory=set)  # versions with a frozen copy
    predicted: set = field(default_factory=set)  # (version, d, live) of predicted weight sets
    inflight: dict = field(default_factory=dict)  # mb -> (version of its forward, buffer key)
    uses: dict = field(default_factory=dict)  # version -> in-flight microbatches of that version
    pred_uses: dict = field(default_factory=dict)  # prediction key -> in-flight microbatches using it
    grads: set = field(default_factory=set)  # steps with a gradient accumulator
    velocity: bool = False  # predict: a velocity exists (the stage's last update was async)
    peak: Peak = field(default_factory=Peak)

    # -- which buffer an action computes with ----------------------------------------------
    def weights(self, version: int, phase: str, step: int, work: dict) -> tuple:
        """The buffer a forward (or a recomputing backward) of ``version`` at ``step`` uses,
        created (and counted in ``work``) if it does not exist yet."""
        if phase == SYNC and version == self.live:
            return LIVE
        d = step - version
        if self.predict and d > 0 and self.velocity:
            key = ("pred", version, d, self.live)
            if key[1:] not in self.predicted:
                if version != self.live and version not in self.copies:
                    raise RuntimeError(f"stage {self.stage}: weight version {version} is no longer held (live {self.live})")
                self.predicted.add(key[1:])
                work["predict"] = work.get("predict", 0) + 1
            return key
        if version not in self.copies:
            if version != self.live:
                raise RuntimeError(f"stage {self.stage}: weight version {version} is no longer held (live {self.live})")
            self.copies.add(version)
            work["copy"] = work.get("copy", 0) + 1
        return ("copy", version)

    def eval_weights(self, version: int) -> tuple:
        if version == self.live:
            return LIVE
        if version not in self.copies:
            raise RuntimeError(f"stage {self.stage}: weight version {version} is no longer held (live {self.live})")
        return ("copy", version)

    # -- actions -----------------------------------------------------------------------------
    def forward(self, a: Action, work: dict) -> tuple:
        if self.reads_data and a.mb % self.microbatches == 0:  # (forwards run in microbatch order)
            work["data"] = work.get("data", 0) + 1
        key = self.weights(a.version, a.phase, a.step, work)
        self.inflight[a.mb] = (a.version, key)
        work["held"] = len(self.inflight)
        self.uses[a.version] = self.uses.get(a.version, 0) + 1
        if key[0] == "pred":
            self.pred_uses[key[1:]] = self.pred_uses.get(key[1:], 0) + 1
        return key

    def backward(self, a: Action, work: dict) -> tuple:
        """The buffer the backward differentiates at: its forward's, or (no stashing) the weights
        of ``a.version`` with the forward recomputed."""
        work["held"] = len(self.inflight)
        version, key = self.inflight.pop(a.mb)
        _drop(self.uses, version)
        if key[0] == "pred":
            _drop(self.pred_uses, key[1:])
        if a.version != version:
            key = self.weights(a.version, a.phase, a.step, work)
            work["recompute"] = work.get("recompute", 0) + 1
        if a.step in self.grads:  # (the step's first backward's gradient becomes its accumulator)
            work["accumulate"] = work.get("accumulate", 0) + 1
        self.grads.add(a.step)
        return key

    def input(self, a: Action, work: dict) -> None:
        """A split backward's ``I``: it changes no buffer (its microbatch stays in flight for the ``W``)."""
        work["held"] = len(self.inflight)

    def update(self, a: Action, needed: bool, work: dict, mitigations: set) -> None:
        """``U(t)``: the live version is copied first if an action still needs it (``needed``)."""
        if needed and self.live not in self.copies:
            self.copies.add(self.live)
            work["copy"] = work.get("copy", 0) + 1
        asynchronous = a.phase == ASYNC
        if self.keep_before and asynchronous:  # the pre-update copy exists while the optimizer steps
            work["copy"] = work.get("copy", 0) + 1
            self._measure(extra_params=1)
        self.grads.discard(a.step)
        if "nesterov" in mitigations and asynchronous:
            work["predict"] = work.get("predict", 0) + 1
        if self.predict and asynchronous:
            work["predict"] = work.get("predict", 0) + 1  # the velocity's EMA
        # (a sync update forgets the velocity: each async phase rebuilds it, see mitigations.py)
        self.velocity = self.predict and asynchronous
        self.live += 1

    def needed(self, version: int, floor: int) -> bool:
        """Whether an in-flight microbatch or a pending action still uses ``version``."""
        return version in self.uses or floor <= version

    def release(self, floor: int | Callable[[], int]) -> tuple[list[int], list[tuple]]:
        """Free the copies and predictions nothing needs any more; returns (versions, prediction
        keys) freed. ``floor``: the program's floor, or a callable giving it, called only if a
        copy is neither live nor in use (the simulator's: most actions free nothing)."""
        gone = []
        unused = self.copies - self.uses.keys() - {self.live} if self.copies else None
        if unused:
            floor = floor() if callable(floor) else floor
            gone = [v for v in self.copies if v in unused and v < floor]
        for v in gone:
            self.copies.discard(v)
        dropped = [k for k in self.predicted if k not in self.pred_uses and k[2] < self.live] if self.predicted else []
        for k in dropped:
            self.predicted.discard(k)
        self._measure()
        return gone, dropped

    def run(self, a: Action, floor_after: int | Callable[[], int], needed_live: bool, mitigations: set,
            work: dict | None = None) -> dict:
        """Account for action ``a`` and release what it freed (the simulator's entry point; the
        executor calls the pieces as it runs them; ``floor_after``: :meth:`release`'s). Returns
        the work done."""
        work = {} if work is None else work
        if a.kind == FORWARD:
            self.forward(a, work)
        elif a.kind in (BACKWARD, WEIGHT):  # (a split backward's I holds on to its activations)
            self.backward(a, work)
        elif a.kind == INPUT:
            self.input(a, work)
        elif a.kind == UPDATE:
            self.update(a, needed_live, work, mitigations)
        elif a.kind == EVAL:
            self.eval_weights(a.version)
        self.release(floor_after)
        return work

    # -- counts --------------------------------------------------------------------------------
    def versions_held(self) -> int:
        """Distinct weight versions this stage keeps: the live one and every older one an in-flight
        microbatch or a pending action still uses."""
        # (no copy is of a version beyond the live one: each is made of the live weights or of a copy,
        # and the live version only grows; a copy of the live version is the live version once)
        return len(self.uses.keys() | self.copies | {self.live})

    def param_sets(self) -> int:
        return 1 + len(self.copies) + len(self.predicted)

    def _measure(self, extra_params: int = 0) -> None:
        pk, b = self.peak, self.nbytes
        sets = self.param_sets() + extra_params
        grads = len(self.grads)
        acts = len(self.inflight)
        if sets > pk.param_sets:
            pk.param_sets = sets
        if grads > pk.grad_sets:
            pk.grad_sets = grads
        if acts > pk.activations:
            pk.activations = acts
        versions = self.versions_held()
        if versions > pk.versions:
            pk.versions = versions
        total = (sets + grads) * b.params + acts * b.activation + b.optimizer
        if total >= pk.bytes:
            pk.bytes = total
            pk.param_bytes, pk.grad_bytes = sets * b.params, grads * b.params
            pk.activation_bytes, pk.optimizer_bytes = acts * b.activation, b.optimizer

    def report(self) -> dict:
        """The peaks, for summary.json and ``adapipe simulate``."""
        pk = self.peak
        return {"stage": self.stage, "peak_activations": pk.activations, "peak_weight_versions": pk.versions,
                "peak_param_sets": pk.param_sets, "peak_grad_sets": pk.grad_sets,
                "peak_bytes": pk.bytes, "peak_param_bytes": pk.param_bytes, "peak_grad_bytes": pk.grad_bytes,
                "peak_activation_bytes": pk.activation_bytes, "optimizer_bytes": pk.optimizer_bytes}

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"live": self.live, "copies": sorted(self.copies), "predicted": sorted(self.predicted),
                "inflight": dict(self.inflight), "grads": sorted(self.grads), "velocity": self.velocity,
                "peak": dict(self.peak.__dict__)}

    def load_state_dict(self, st: dict) -> None:
        self.live, self.copies = st["live"], set(st["copies"])
        self.predicted = {tuple(k) for k in st["predicted"]}
        self.inflight = {int(mb): (v, tuple(k)) for mb, (v, k) in st["inflight"].items()}
        self.uses, self.pred_uses = {}, {}
        for v, k in self.inflight.values():
            self.uses[v] = self.uses.get(v, 0) + 1
            if k[0] == "pred":
                self.pred_uses[k[1:]] = self.pred_uses.get(k[1:], 0) + 1
        self.grads, self.velocity = set(st["grads"]), st["velocity"]
        self.peak = Peak(**st["peak"])


def _drop(counts: dict, key) -> None:
    if counts[key] == 1:
        del counts[key]
    else:
        counts[key] -= 1
