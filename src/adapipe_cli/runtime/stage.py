"""The stage executor: runs one stage's actions. Both runtimes use it; only the transport differs.

A stage owns its parameters (the *live* version, updated in place by its optimizer), the older
versions that in-flight or future actions still need (stashed copies), the activations of its
in-flight microbatches and the gradient accumulators of unfinished steps.

Synchronous actions compute with the live parameters directly. Asynchronous ones compute with a
copy of their version (made once per version): an update may land between a forward and its
backward, and it must not change the weights the backward differentiates. Which buffers exist and
when they are freed is decided by the stage's :class:`~..schedules.ledger.Ledger`, which the
simulator drives too; :meth:`StageExecutor.run` returns the extra work an action did (copies,
predictions, recomputed forwards) for the pipeline clock.

Gradient clipping is by the global norm over all stages in both phases (what a single process
would do). A synchronous update gets it exactly from a collective. An asynchronous stage cannot
wait for the other stages' gradients of the same step, so it clips by the norm of the newest
gradient it knows of each stage: its own of this step, and the others' squared norms, which travel
with every activation and gradient message of the async stream (a stage's table of ``(step,
squared norm)`` per stage, merged by newest step). Downstream stages' entries are of the same step
(their backward of the step's last microbatch comes first); upstream ones are older. A stage not
heard from yet counts as much as the stage's own. With one stage both rules are the same.

Precision (``precision="bf16"``): every forward (training, a backward's recompute, a refill,
evaluation) runs under bf16 autocast; the backward differentiates the graph outside autocast.
What travels between stages is fp32 (activations cast up before sending, received gradients cast
to the output's dtype), so the transports and their fp32 receive buffers do not depend on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model import GPTStage, lm_loss

from ..schedules import ASYNC, BACKWARD, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Action, StageProgram
from ..schedules.ledger import LIVE, Ledger, StageBytes
from ..optim import StageOptimizer
from .device import autocast
from .replicas import ReplicaGroup
from .transport import Transport


UNKNOWN = -(2**24)  # the step of a stage's gradient norm not heard of yet (exact in float32)


@dataclass
class InFlight:
    action: Action  # the forward that put it in flight
    version: int
    weights: list[torch.Tensor] | None  # None: the live parameters
    x: torch.Tensor  # stage input (leaf; requires grad except on the first stage)
    out: torch.Tensor  # stage output, or the scaled loss on the last stage
    table: torch.Tensor | None = None  # the table of gradient norms sent with its activation
    split: object = None  # after its I (a split backward): what the W needs


@dataclass
class StepStats:
    """What a stage records about one optimizer step."""

    losses: list[float] = field(default_factory=list)  # last stage: microbatch losses
    delays: list[int] = field(default_factory=list)  # step - version of each forward
    grad_sq: float = float("nan")  # squared norm of this stage's share of the step's gradient
    clip_norm: float = float("nan")  # the global norm the update was clipped by (exact or estimated)
    lr: float = float("nan")  # the schedule's learning rate of the update (same at every stage)
    lr_stage: float = float("nan")  # this stage's own, after PipeMare rescheduling


def param_slots(module: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[dict, str, int]]:
    """Where each of ``params`` sits in ``module``: (the owning submodule's ``_parameters``, the
    name there, the index in ``params``), one entry per place a parameter is registered (a
    parameter registered twice, tied embeddings in one stage, has two)."""
    index = {id(p): i for i, p in enumerate(params)}
    slots = []
    for name, p in module.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        slots.append((module.get_submodule(owner)._parameters, leaf, index[id(p)]))
    return slots


def call_with(module: torch.nn.Module, slots: list[tuple[dict, str, int]], weights: list[torch.Tensor],
              x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed with ``weights`` (in ``params``' order, :func:`param_slots`) in place
    of its parameters, which are put back after. What ``torch.func.functional_call`` does, without
    its per-call bookkeeping, which cost 0.09 to 0.13 ms (2 to 4%) over a gpt-nano stage's 3.5 ms
    forward on one CPU thread (``scripts/probe_stage_calls.py``, docs/results/probe_stage_calls.txt),
    paid by every forward and recompute with a stashed or predicted version."""
    saved = [table[name] for table, name, _ in slots]
    try:
        for table, name, i in slots:
            table[name] = weights[i]
        return module(x)
    finally:
        for (table, name, _), p in zip(slots, saved):
            table[name] = p


def to_device(obj, device: torch.device):
    """``obj`` (tensors in dicts, lists and tuples) with every tensor on ``device`` (a tensor already
    there is returned as it is)."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # (named tuples)
    return obj


class StageExecutor:
    """Executes the actions of stage ``index`` of ``stages``.

    ``batch(step, mb)`` returns the microbatch's (inputs, targets); the first stage reads the
    inputs, the last the targets. ``policy`` gives each update's learning-rate scale and optional
    momentum override, and applies the staleness mitigations (see :mod:`..schedules.mitigations`).
    """

    def __init__(
        self,
        index: int,
        stages: int,
        microbatches: int,
        module: GPTStage,
        optimizer: StageOptimizer,
        transport: Transport,
        batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
        policy,
        program: StageProgram,
        grad_clip: float = 0.0,
        seed: int = 0,
        tied: bool = False,
        nbytes: StageBytes | None = None,
        precision: str = "fp32",
        dp: ReplicaGroup | None = None,
    ) -> None:
        self.s, self.p, self.m = index, stages, microbatches
        self.dp = dp if dp is not None and dp.count > 1 else None  # the stage's copies in other replicas
        self._dp_pending: Action | None = None  # the backward that completed a step's gradient, before its all-reduce
        self.first, self.last = index == 0, index == stages - 1
        self.module, self.opt, self.transport = module, optimizer, transport
        self.batch, self.policy, self.program = batch, policy, program
        self.grad_clip, self.seed = grad_clip, seed
        self.precision = precision
        # tied embeddings across first and last stage: the two copies' gradients are summed
        self.tied = tied and stages > 1 and (self.first or self.last)
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.slots = param_slots(module, self.params)
        self.tied_index = self._tied_index() if self.tied else -1
        if not program.spec.barrier and (grad_clip > 0 or self.tied):
            raise ValueError("a sync update without a barrier can neither clip by the global norm nor sum tied embeddings")
        mit = set(getattr(policy, "mitigations", ()))
        self.ledger = Ledger(index, predict="predict" in mit, keep_before=bool(mit & {"predict", "nesterov"}),
                             nbytes=nbytes or StageBytes(), reads_data=self.first or self.last, microbatches=microbatches)
        self.copies: dict[int, list[torch.Tensor]] = {}  # version -> frozen copy of its weights
        self.predicted: dict[tuple, list[torch.Tensor]] = {}  # (version, d, live) -> predicted weights
        self.inflight: dict[int, InFlight] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}  # step -> accumulated gradient
        self.backwards: dict[int, int] = {}  # step -> backwards run (the m-th completes its gradient)
        self.known = [(UNKNOWN, 0.0)] * stages  # per stage: (step, squared gradient norm), the newest known
        self.stats: dict[int, StepStats] = {}
        self.eval_losses: dict[int, list[float]] = {}  # version -> validation losses (last stage)
        self.work: dict[str, int] = {}  # extra work of the action being run (see the ledger)
        self.dropout = module.cfg.dropout > 0
        self._posted: set[tuple] = set()  # collectives of synchronous updates already posted
        self._norms: dict[int, torch.Tensor] = {}  # step -> global squared gradient norm
        self.val: list[tuple[torch.Tensor, torch.Tensor]] = []  # validation batches for E actions

    @property
    def live(self) -> int:
        """The version held by the live parameters."""
        return self.ledger.live

    @property
    def peak_inflight(self) -> int:
        return self.ledger.peak.activations

    @property
    def peak_versions(self) -> int:
        return self.ledger.peak.versions

    def _tied_index(self) -> int:
        name = "embed.wte.weight" if self.first else "head.lm_head.weight"
        return self.names.index(name)

    # -- readiness (local runtime) -----------------------------------------------------------
    def ready(self, a: Action) -> bool:
        """Whether ``a``'s inputs have arrived. A synchronous update first posts this stage's
        share of the collective (squared gradient norm, tied gradient) and waits for the rest."""
        t = self.transport
        if self._dp_pending is not None and not self._all_reduce():
            return False
        if a.kind == FORWARD:
            return self.first or t.ready("act", self.s - 1, self.s, a.mb)
        if a.kind in (BACKWARD, INPUT):
            # (with replicas the table of norms may follow the gradient: see _all_reduce)
            return self.last or (t.ready("grad", self.s + 1, self.s, a.mb)
                                 and (not self._gossips(a) or t.ready("gradn", self.s + 1, self.s, a.mb)))
        if a.kind == EVAL:
            return self.first or t.ready("eval", self.s - 1, self.s, (a.version, 0))
        if a.kind == UPDATE and a.phase == SYNC and self.program.spec.barrier:
            return self._sync_norm(a.step) is not None
        return True

    @property
    def _all(self) -> tuple[int, ...]:
        return tuple(range(self.p))

    @property
    def _ends(self) -> tuple[int, ...]:
        return (0, self.p - 1)

    def _sync_norm(self, step: int) -> torch.Tensor | None:
        """The squared norm of step ``step``'s gradient over all stages, or None while other stages'
        shares are missing (the local runtime polls; a distributed transport blocks instead).
        With tied embeddings the first and last stage first sum their copies' gradients; the
        tied matrix then counts once in the norm, as in the unpartitioned model."""
        if step in self._norms:
            return self._norms[step]
        t, g, state = self.transport, self.grads[step], self._posted
        if self.tied and ("tied-done", step) not in state:
            if ("tied", step) not in state:
                t.post_reduce(("tied", step), self.s, self._ends, [g[self.tied_index]])
                state.add(("tied", step))
            if not t.reduce_ready(("tied", step), self._ends):
                return None
            (g[self.tied_index],) = t.reduce(("tied", step), self.s, self._ends, [g[self.tied_index]])
            state.add(("tied-done", step))
        share = [x for i, x in enumerate(g) if not (self.tied and self.last and i == self.tied_index)]
        if ("norm", step) not in state:
            t.post_reduce(("norm", step), self.s, self._all, [self._share_vector(share)])
            state.add(("norm", step))
        if not t.reduce_ready(("norm", step), self._all):
            return None
        (shares,) = t.reduce(("norm", step), self.s, self._all, [self._share_vector(share)])
        for key in (("tied", step), ("tied-done", step), ("norm", step)):
            state.discard(key)
        # every stage's share is known exactly now: the async stream starts from them
        self.known = [(step, float(x)) for x in shares]
        sq = shares.sum()
        self._norms[step] = sq
        return sq

    def _share_vector(self, share: list[torch.Tensor]) -> torch.Tensor:
        """This stage's squared norm at its own index of a length-p vector: summed over the stages
        it gives every stage's share (adding zeros is exact)."""
        v = torch.zeros(self.p, dtype=torch.float32)
        v[self.s] = self._sq_norm(share).float()
        return v

    # -- execution -----------------------------------------------------------------------------
    def run(self, a: Action) -> dict[str, int]:
        """Run ``a``; returns the extra work it did ({"copy": n, "predict": n, "recompute": n}) and
        the microbatches it ``held`` in flight (see the ledger)."""
        self.work = {}
        if a.kind == FORWARD:
            self.forward(a)
        elif a.kind == BACKWARD:
            self.backward(a)
        elif a.kind == INPUT:
            self.input_grad(a)
        elif a.kind == WEIGHT:
            self.weight_grad(a)
        elif a.kind == UPDATE:
            self.update(a)
        elif a.kind == EVAL:
            self.evaluate(a)
        self._release()
        return self.work

    def _tensors(self, key: tuple) -> list[torch.Tensor] | None:
        """The tensors of the ledger's buffer ``key``, materialised the first time they are used."""
        if key == LIVE:
            return None
        if key[0] == "copy":
            if key[1] not in self.copies:
                self.copies[key[1]] = self._clone_live()
            return self.copies[key[1]]
        pk = key[1:]
        if pk not in self.predicted:
            version, d, _ = pk
            base = self.params if version == self.live else self.copies[version]
            self.predicted[pk] = self.policy.predict(self.s, base, d)
        return self.predicted[pk]

    def _clone_live(self) -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.params]

    def _call(self, x: torch.Tensor, weights: list[torch.Tensor] | None, mb: int) -> torch.Tensor:
        if self.dropout:  # the same dropout mask whatever the execution order
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((self.seed * 1_000_003 + self.s) * 1_000_003 + mb)
                return self._call_plain(x, weights)
        return self._call_plain(x, weights)

    def _call_plain(self, x: torch.Tensor, weights: list[torch.Tensor] | None) -> torch.Tensor:
        with autocast(x.device, self.precision):
            if weights is None:
                return self.module(x)
            return call_with(self.module, self.slots, weights, x)

    @staticmethod
    def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss in fp32 whatever the logits' dtype (bf16 under autocast; fp32: no-op cast)."""
        return lm_loss(out.float(), targets)

    def _input(self, a: Action) -> torch.Tensor:
        if self.first:
            return self.batch(a.step, a.mb % self.m)[0]
        x = self.transport.recv("act", self.s - 1, self.s, a.mb)
        self._hear("actn", self.s - 1, a)
        return x.requires_grad_(True)

    # -- the async stream's table of gradient norms (see the module docstring) -----------------
    def _gossips(self, a: Action) -> bool:
        return a.phase == ASYNC and self.grad_clip > 0 and self.p > 1

    def _tell(self, channel: str, dst: int, a: Action) -> torch.Tensor | None:
        if not self._gossips(a):
            return None
        table = torch.tensor(self.known, dtype=torch.float32)
        self.transport.send(channel, self.s, dst, a.mb, table)
        return table

    def _hear(self, channel: str, src: int, a: Action) -> None:
        if self._gossips(a):
            table = self.transport.recv(channel, src, self.s, a.mb)
            for i, (step, sq) in enumerate(table.tolist()):
                if i != self.s and step > self.known[i][0]:
                    self.known[i] = (int(step), sq)

    def forward(self, a: Action) -> None:
        x = self._input(a)
        key = self.ledger.forward(a, self.work)
        w = self._tensors(key)
        out = self._call(x, w, a.mb)
        st = self.stats.setdefault(a.step, StepStats())
        st.delays.append(a.step - a.version)
        if self.last:
            loss = self._loss(out, self.batch(a.step, a.mb % self.m)[1])
            st.losses.append(loss.item())
            out = loss / self.m  # the step's gradient is the mean over its microbatches
        table = None
        if not self.last:
            self.transport.send("act", self.s, self.s + 1, a.mb, out.detach().float())
            table = self._tell("actn", self.s + 1, a)
        self.inflight[a.mb] = InFlight(a, a.version, w, x, out, table)

    def resend(self, mb: int) -> None:
        """Send in-flight microbatch ``mb``'s activation (and its table of norms) again: a resumed
        distributed run's next stage had not received it at the cut."""
        rec = self.inflight[mb]
        self.transport.send("act", self.s, self.s + 1, mb, rec.out.detach().float())
        if rec.table is not None:
            self.transport.send("actn", self.s, self.s + 1, mb, rec.table)

    def backward(self, a: Action) -> None:
        rec = self.inflight.pop(a.mb)
        grad_out = received = None
        if not self.last:
            grad_out = received = self.transport.recv("grad", self.s + 1, self.s, a.mb)
            self._hear("gradn", self.s + 1, a)
        w, out, x = rec.weights, rec.out, rec.x
        key = self.ledger.backward(a, self.work)
        if a.version != rec.version:  # no stashing: differentiate at the weights current now
            w = self._tensors(key)
            x = x.detach().requires_grad_(not self.first)
            out = self._call(x, w, a.mb)
            if self.last:
                out = self._loss(out, self.batch(a.step, a.mb % self.m)[1]) / self.m
        if grad_out is not None:
            grad_out = grad_out.to(out.dtype)  # sent in fp32; the output may be bf16
        params = self.params if w is None else w
        inputs = params if self.first else [x, *params]
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        if received is not None:  # (autograd.grad freed the graph: the received buffers are free)
            self.transport.release("grad", received)
        if not self.first:
            self.transport.release("act", rec.x)
            self.transport.send("grad", self.s, self.s - 1, a.mb, grads[0])
            grads = grads[1:]
        self._accumulate(a, grads)

    def _accumulate(self, a: Action, grads) -> None:
        """Add one microbatch's weight gradient to its step's accumulator."""
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        acc = self.grads.get(a.step)
        if acc is None:
            self.grads[a.step] = acc = grads
        else:
            for g_acc, g in zip(acc, grads):
                g_acc.add_(g)
        n = self.backwards[a.step] = self.backwards.get(a.step, 0) + 1
        if n == self.m:  # the step's gradient is complete here
            del self.backwards[a.step]
            if self.dp is not None:  # the rest waits for the other replicas' gradients
                self.dp.transport.post_reduce(self.dp.key(a.step), self.dp.index, self.dp.members, acc)
                self._dp_pending = a
                self._all_reduce()  # the last replica to arrive (or a blocking transport) goes on at once
                return
            self._gradient_complete(a)
        if not self.first and a.kind == BACKWARD:
            self._tell("gradn", self.s - 1, a)

    def _gradient_complete(self, a: Action) -> None:
        """The step's gradient is whole (and averaged over the replicas): its norm enters the async
        stream's table."""
        if a.phase == ASYNC:
            sq = float(self._sq_norm(self.grads[a.step]))
            self.known[self.s] = (a.step, sq)
            self.stats.setdefault(a.step, StepStats()).grad_sq = sq

    def _all_reduce(self) -> bool:
        """``g <- (1/R) sum_r g_r`` of the pending step over the stage's R copies; False while other
        replicas' shares are missing (the local runtime polls). Then the step's gradient is
        complete, and the backward's table of norms goes upstream with the mean's norm in it."""
        a, g = self._dp_pending, self.dp
        if not g.transport.reduce_ready(g.key(a.step), g.members):
            return False
        summed = g.transport.reduce(g.key(a.step), g.index, g.members, self.grads[a.step])
        self.grads[a.step] = [x.div_(g.count) for x in summed]  # (new tensors: the posted ones stay as others read them)
        self._dp_pending = None
        self._gradient_complete(a)
        if not self.first and a.kind == BACKWARD:
            self._tell("gradn", self.s - 1, a)
        return True

    # -- a backward split in two (zero-bubble schedules; sync only) ---------------------------
    def input_grad(self, a: Action) -> None:
        """``I``: the gradient of the stage's input, sent upstream at once; the graph's
        intermediate gradients that the weight gradient needs are kept for the ``W`` (torch's
        pipelining helpers). The first stage has no input gradient: its ``W`` runs the whole
        backward."""
        rec = self.inflight[a.mb]
        self.ledger.input(a, self.work)
        grad_out = None if self.last else self.transport.recv("grad", self.s + 1, self.s, a.mb).to(rec.out.dtype)
        if self.first:
            rec.split = grad_out
            return
        params = self.params if rec.weights is None else rec.weights
        # imported here, not at the top: the package's import (torch.export, dynamo) costs a process
        # about 2 s on 2 cores, and only a split backward needs it
        from torch.distributed.pipelining._backward import stage_backward_input
        dx, groups = stage_backward_input([rec.out], None if grad_out is None else [grad_out], [rec.x], iter(params))
        self.transport.send("grad", self.s, self.s - 1, a.mb, dx[0])
        rec.split = groups

    def weight_grad(self, a: Action) -> None:
        """``W``: the weight gradient of a microbatch whose ``I`` ran, added to its step's."""
        rec = self.inflight.pop(a.mb)
        self.ledger.backward(a, self.work)
        params = self.params if rec.weights is None else rec.weights
        if self.first:
            grads = torch.autograd.grad(rec.out, params, rec.split, allow_unused=True)
        else:
            before = [p.grad for p in params]
            for p in params:
                p.grad = None
            from torch.distributed.pipelining._backward import stage_backward_weight  # as in input_grad
            stage_backward_weight(iter(params), rec.split)
            grads = [p.grad for p in params]
            for p, g in zip(params, before):
                p.grad = g
        self._accumulate(a, grads)

    @staticmethod
    def _sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.linalg.vector_norm(g) for g in grads]).pow(2).sum()

    def update(self, a: Action) -> None:
        """``U(t)``: clip and apply step ``t``'s accumulated gradient, with the clipping coefficient
        ``min(1, grad_clip / (||g|| + 1e-6))`` of the global norm ``||g||`` over all stages: exact
        in sync, the newest known shares in async (see the module docstring)."""
        st = self.stats.setdefault(a.step, StepStats())
        if a.phase == SYNC and self.program.spec.barrier:
            sq = float(self._sync_norm(a.step))  # sums tied gradients first
            del self._norms[a.step]
            st.grad_sq = self.known[self.s][1]
        elif a.phase == SYNC:  # no barrier: nothing to clip by, no tied copy (see ScheduleSpec.barrier)
            sq = st.grad_sq = float(self._sq_norm(self.grads[a.step]))
        grads = self.grads.pop(a.step)
        if a.phase != SYNC:
            own = self.known[self.s][1]
            sq = sum(own if step == UNKNOWN else x for step, x in self.known)
        norm = math.sqrt(sq)
        st.clip_norm = norm
        if self.grad_clip > 0:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        floor = self.program.floor_version()
        self.ledger.update(a, self.ledger.needed(self.live, floor), self.work, self.policy.mitigations)
        for v in self.ledger.copies:  # the live version, copied before the update changes it
            if v not in self.copies:
                self.copies[v] = self._clone_live()
        for p, g in zip(self.params, grads):
            p.grad = g
        delay = sum(st.delays) / max(1, len(st.delays))
        lr_scale, beta1 = self.policy.update_scale(self.s, a.step, a.phase, delay)
        before = self.policy.before_update(self, a.phase)
        self.opt.step(lr_scale, beta1)
        self.policy.after_update(self, before, a.phase, delay)
        st.lr_stage = self.opt.current_lr()
        st.lr = self.opt.base_lr() * self.policy.schedule_scale(a.step, a.phase)

    @torch.no_grad()
    def evaluate(self, a: Action) -> None:
        """``E``: forward of the validation batches with ``a.version`` (the weights after
        ``a.step + 1`` updates), passed on batch by batch; the last stage records the losses."""
        losses = []
        for i, (x, y) in enumerate(self.val):
            h = x if self.first else self.transport.recv("eval", self.s - 1, self.s, (a.version, i))
            out = self.eval_forward(a.version, h)
            if not self.first:
                self.transport.release("eval", h)
            if self.last:
                losses.append(self._loss(out, y).item())
            else:
                self.transport.send("eval", self.s, self.s + 1, (a.version, i), out.float())
        if self.last:
            self.eval_losses[a.version] = losses

    @torch.no_grad()
    def eval_forward(self, version: int, x: torch.Tensor) -> torch.Tensor:
        """Forward of one validation batch with ``version``'s weights, without dropout."""
        w = self._tensors(self.ledger.eval_weights(version))
        self.module.eval()
        try:
            return self._call_plain(x, w)
        finally:
            self.module.train()

    # -- memory ----------------------------------------------------------------------------------
    def _release(self) -> None:
        gone, dropped = self.ledger.release(self.program.floor_version())
        for v in gone:
            self.copies.pop(v, None)
        for k in dropped:
            self.predicted.pop(k, None)

    def versions_held(self) -> int:
        """Distinct weight versions this stage must keep: the live one and every older one an
        in-flight microbatch or a pending action still uses."""
        return self.ledger.versions_held()

    def param_sets(self) -> int:
        """Parameter sets held now: live, copies and predictions (the ledger's count)."""
        return self.ledger.param_sets()

    def take_stats(self, step: int) -> StepStats:
        return self.stats.pop(step, StepStats())

    # -- state (checkpoints, the divergence guard) ---------------------------------------------
    def state_dict(self) -> dict:
        """Everything that determines this stage's future numbers, at a step boundary (after one
        of its updates): weights, optimizer, stashed and predicted weights, in-flight microbatches
        (their inputs; the graphs are rebuilt by recomputing the forward, which gives identical
        values), unfinished steps' gradients and statistics, the table of known gradient norms,
        the ledger, the mitigations' state and the program's position."""
        if self._dp_pending is not None:
            raise RuntimeError("an all-reduce across replicas is in progress: state can only be taken between steps")
        clone = lambda ts: [t.detach().clone() for t in ts]  # noqa: E731
        return {
            "stage": self.s, "program": self.program.popped,
            "params": clone(self.params), "optimizer": self.opt.state_dict(),
            "copies": {v: clone(w) for v, w in self.copies.items()},
            "predicted": {k: clone(w) for k, w in self.predicted.items()},
            "inflight": {mb: {"action": tuple(r.action), "x": r.x.detach().clone(), "table": r.table}
                         for mb, r in self.inflight.items()},
            "grads": {t: clone(g) for t, g in self.grads.items()},
            "backwards": dict(self.backwards), "known": list(self.known),
            "stats": {t: dict(st.__dict__) for t, st in self.stats.items()},
            "eval_losses": dict(self.eval_losses),
            "ledger": self.ledger.state_dict(),
            "policy": self.policy.stage_state(self.s),
        }

    def load_state_dict(self, state: dict, program: StageProgram) -> None:
        """Restore ``state`` into this stage, with ``program`` a fresh program of the same plan,
        which is fast-forwarded to the saved position. Stale collective bookkeeping is dropped."""
        if state["stage"] != self.s or len(state["params"]) != len(self.params):
            raise ValueError(f"state of stage {state['stage']} does not fit stage {self.s}")
        # a state saved on another device (a GPU run resumed on the CPU, or back): the optimizer
        # moves its own state to the parameters' device, the rest is moved here
        state = {k: v if k == "optimizer" else to_device(v, self.params[0].device) for k, v in state.items()}
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
        self.opt.load_state_dict(state["optimizer"])
        grad = lambda w: [t.clone().requires_grad_(True) for t in w]  # noqa: E731
        self.copies = {int(v): grad(w) for v, w in state["copies"].items()}
        self.predicted = {tuple(k): grad(w) for k, w in state["predicted"].items()}
        self.grads = {int(t): [g.clone() for g in gs] for t, gs in state["grads"].items()}
        self.backwards = {int(t): n for t, n in state["backwards"].items()}
        self.known = [tuple(k) for k in state["known"]]
        self.stats = {int(t): StepStats(**st) for t, st in state["stats"].items()}
        self.eval_losses = dict(state["eval_losses"])
        self.ledger.load_state_dict(state["ledger"])
        self._posted, self._norms, self._dp_pending = set(), {}, None
        self.policy.load_stage_state(self.s, state["policy"])
        self.program = program
        program.skip(state["program"])
        self.inflight = {}
        for mb, rec in sorted(state["inflight"].items()):
            self._refill(Action(*rec["action"]), rec["x"], self._tensors(self.ledger.inflight[mb][1]), rec["table"])

    def _refill(self, a: Action, x: torch.Tensor, w: list[torch.Tensor] | None, table: torch.Tensor | None) -> None:
        """Put a saved in-flight microbatch back: recompute its forward from its saved input."""
        x = x.clone() if self.first else x.clone().requires_grad_(True)
        out = self._call(x, w, a.mb)
        if self.last:
            out = self._loss(out, self.batch(a.step, a.mb % self.m)[1]) / self.m
        self.inflight[a.mb] = InFlight(a, a.version, w, x, out, table)
