"""The stage executor: runs one stage's actions. Both runtimes use it; only the transport differs.

A stage owns its parameters (the *live* version, updated in place by its optimizer), the older
versions that in-flight or future actions still need (stashed copies), the activations of its
in-flight microbatches and the gradient accumulators of unfinished steps.

Synchronous actions compute with the live parameters directly. Asynchronous ones compute with a
copy of their version (made once per version): an update may land between a forward and its
backward, and it must not change the weights the backward differentiates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.func import functional_call

from ..model import GPTStage, lm_loss
from ..schedules import BACKWARD, EVAL, FORWARD, SYNC, UPDATE, Action, StageProgram
from ..train.optim import StageOptimizer
from .transport import Transport


@dataclass
class InFlight:
    action: Action  # the forward that put it in flight
    version: int
    weights: list[torch.Tensor] | None  # None: the live parameters
    x: torch.Tensor  # stage input (leaf; requires grad except on the first stage)
    out: torch.Tensor  # stage output, or the scaled loss on the last stage


@dataclass
class StepStats:
    """What a stage records about one optimizer step."""

    losses: list[float] = field(default_factory=list)  # last stage: microbatch losses
    delays: list[int] = field(default_factory=list)  # step - version of each forward
    grad_norm: float = float("nan")
    lr: float = float("nan")


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
    ) -> None:
        self.s, self.p, self.m = index, stages, microbatches
        self.first, self.last = index == 0, index == stages - 1
        self.module, self.opt, self.transport = module, optimizer, transport
        self.batch, self.policy, self.program = batch, policy, program
        self.grad_clip, self.seed = grad_clip, seed
        # tied embeddings across first and last stage: the two copies' gradients are summed
        self.tied = tied and stages > 1 and (self.first or self.last)
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.tied_index = self._tied_index() if self.tied else -1
        self.live = 0  # version held by the live parameters
        self.copies: dict[int, list[torch.Tensor]] = {}  # version -> frozen copy of its weights
        self.inflight: dict[int, InFlight] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}  # step -> accumulated gradient
        self.stats: dict[int, StepStats] = {}
        self.eval_losses: dict[int, list[float]] = {}  # version -> validation losses (last stage)
        self.peak_inflight = 0
        self.peak_versions = 1
        self.dropout = module.cfg.dropout > 0
        self._posted: set[tuple] = set()  # collectives of synchronous updates already posted
        self._norms: dict[int, torch.Tensor] = {}  # step -> global squared gradient norm
        self.val: list[tuple[torch.Tensor, torch.Tensor]] = []  # validation batches for E actions

    def _tied_index(self) -> int:
        name = "embed.wte.weight" if self.first else "head.lm_head.weight"
        return self.names.index(name)

    # -- readiness (local runtime) -----------------------------------------------------------
    def ready(self, a: Action) -> bool:
        """Whether ``a``'s inputs have arrived. A synchronous update first posts this stage's
        share of the collective (squared gradient norm, tied gradient) and waits for the rest."""
        t = self.transport
        if a.kind == FORWARD:
            return self.first or t.ready("act", self.s - 1, self.s, a.mb)
        if a.kind == BACKWARD:
            return self.last or t.ready("grad", self.s + 1, self.s, a.mb)
        if a.kind == EVAL:
            return self.first or t.ready("eval", self.s - 1, self.s, (a.version, 0))
        if a.phase == SYNC:
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
            t.post_reduce(("norm", step), self.s, self._all, [self._sq_norm(share)])
            state.add(("norm", step))
        if not t.reduce_ready(("norm", step), self._all):
            return None
        (sq,) = t.reduce(("norm", step), self.s, self._all, [self._sq_norm(share)])
        for key in (("tied", step), ("tied-done", step), ("norm", step)):
            state.discard(key)
        self._norms[step] = sq
        return sq

    # -- execution -----------------------------------------------------------------------------
    def run(self, a: Action) -> None:
        if a.kind == FORWARD:
            self.forward(a)
        elif a.kind == BACKWARD:
            self.backward(a)
        elif a.kind == UPDATE:
            self.update(a)
        elif a.kind == EVAL:
            self.evaluate(a)
        self._release()

    def _weights(self, version: int, phase: str, step: int) -> list[torch.Tensor] | None:
        """Tensors to compute with for ``version``: None means the live parameters."""
        if phase == SYNC and version == self.live:
            return None
        predicted = self.policy.predicted_weights(self, version, step)
        if predicted is not None:
            return predicted
        if version not in self.copies:
            if version != self.live:
                raise RuntimeError(f"stage {self.s}: weight version {version} is no longer held (live {self.live})")
            self.copies[version] = [p.detach().clone().requires_grad_(True) for p in self.params]
        return self.copies[version]

    def _call(self, x: torch.Tensor, weights: list[torch.Tensor] | None, mb: int) -> torch.Tensor:
        if self.dropout:  # the same dropout mask whatever the execution order
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((self.seed * 1_000_003 + self.s) * 1_000_003 + mb)
                return self._call_plain(x, weights)
        return self._call_plain(x, weights)

    def _call_plain(self, x: torch.Tensor, weights: list[torch.Tensor] | None) -> torch.Tensor:
        if weights is None:
            return self.module(x)
        return functional_call(self.module, dict(zip(self.names, weights)), (x,), tie_weights=False)

    def _input(self, a: Action) -> torch.Tensor:
        if self.first:
            return self.batch(a.step, a.mb % self.m)[0]
        return self.transport.recv("act", self.s - 1, self.s, a.mb).requires_grad_(True)

    def forward(self, a: Action) -> None:
        x = self._input(a)
        w = self._weights(a.version, a.phase, a.step)
        out = self._call(x, w, a.mb)
        st = self.stats.setdefault(a.step, StepStats())
        st.delays.append(a.step - a.version)
        if self.last:
            loss = lm_loss(out, self.batch(a.step, a.mb % self.m)[1])
            st.losses.append(loss.item())
            out = loss / self.m  # the step's gradient is the mean over its microbatches
        else:
            self.transport.send("act", self.s, self.s + 1, a.mb, out.detach())
        self.inflight[a.mb] = InFlight(a, a.version, w, x, out)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def backward(self, a: Action) -> None:
        rec = self.inflight.pop(a.mb)
        grad_out = None if self.last else self.transport.recv("grad", self.s + 1, self.s, a.mb)
        w, out, x = rec.weights, rec.out, rec.x
        if a.version != rec.version:  # no stashing: differentiate at the weights current now
            w = self._weights(a.version, a.phase, a.step)
            x = x.detach().requires_grad_(not self.first)
            out = self._call(x, w, a.mb)
            if self.last:
                out = lm_loss(out, self.batch(a.step, a.mb % self.m)[1]) / self.m
        params = self.params if w is None else w
        inputs = params if self.first else [x, *params]
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        if not self.first:
            self.transport.send("grad", self.s, self.s - 1, a.mb, grads[0])
            grads = grads[1:]
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        acc = self.grads.get(a.step)
        if acc is None:
            self.grads[a.step] = grads
        else:
            for g_acc, g in zip(acc, grads):
                g_acc.add_(g)

    @staticmethod
    def _sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.linalg.vector_norm(g) for g in grads]).pow(2).sum()

    def update(self, a: Action) -> None:
        """``U(t)``: clip and apply step ``t``'s accumulated gradient.

        Sync: the gradient is clipped by the norm over all stages (a collective), so a pipeline
        clips exactly as one process would. Async stages update at different times, so each clips
        its own gradient to ``grad_clip / sqrt(p)`` (which bounds the norm over all stages by
        ``grad_clip``)."""
        st = self.stats.setdefault(a.step, StepStats())
        if a.phase == SYNC:
            sq = self._sync_norm(a.step)  # sums tied gradients first
            del self._norms[a.step]
            clip = self.grad_clip
        grads = self.grads.pop(a.step)
        if a.phase != SYNC:
            sq = self._sq_norm(grads)
            clip = self.grad_clip / math.sqrt(self.p)
        norm = float(sq.sqrt())
        st.grad_norm = norm
        if clip > 0:
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        if self._needed(self.live) and self.live not in self.copies:
            self.copies[self.live] = [p.detach().clone().requires_grad_(True) for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        delay = sum(st.delays) / max(1, len(st.delays))
        lr_scale, beta1 = self.policy.update_scale(self.s, a.step, a.phase, delay)
        before = self.policy.before_update(self)
        self.opt.step(lr_scale, beta1)
        self.live += 1
        self.policy.after_update(self, before, a.phase, delay)
        st.lr = self.opt.current_lr()

    @torch.no_grad()
    def evaluate(self, a: Action) -> None:
        """``E``: forward of the validation batches with ``a.version`` (the weights after
        ``a.step + 1`` updates), passed on batch by batch; the last stage records the losses."""
        losses = []
        for i, (x, y) in enumerate(self.val):
            h = x if self.first else self.transport.recv("eval", self.s - 1, self.s, (a.version, i))
            out = self.eval_forward(a.version, h)
            if self.last:
                losses.append(lm_loss(out, y).item())
            else:
                self.transport.send("eval", self.s, self.s + 1, (a.version, i), out)
        if self.last:
            self.eval_losses[a.version] = losses

    @torch.no_grad()
    def eval_forward(self, version: int, x: torch.Tensor) -> torch.Tensor:
        """Forward of one validation batch with ``version``'s weights, without dropout."""
        w = None if version == self.live else self.copies.get(version)
        if version != self.live and w is None:
            raise RuntimeError(f"stage {self.s}: weight version {version} is no longer held (live {self.live})")
        self.module.eval()
        try:
            return self._call_plain(x, w)
        finally:
            self.module.train()

    # -- memory ----------------------------------------------------------------------------------
    def _needed(self, version: int) -> bool:
        return any(r.version == version for r in self.inflight.values()) or self.program.floor_version() <= version

    def _release(self) -> None:
        floor = self.program.floor_version()
        held = {r.version for r in self.inflight.values()}
        for v in list(self.copies):
            if v != self.live and v not in held and v < floor:
                del self.copies[v]
        self.policy.release(self, floor, held)
        self.peak_versions = max(self.peak_versions, self.versions_held())

    def versions_held(self) -> int:
        """Distinct weight versions this stage must keep: the live one and every older one an
        in-flight microbatch or a pending action still uses."""
        return len({self.live, *(r.version for r in self.inflight.values()), *(v for v in self.copies if v < self.live)})

    def take_stats(self, step: int) -> StepStats:
        return self.stats.pop(step, StepStats())

    # -- state (checkpoints, the divergence guard) ---------------------------------------------
    def state_dict(self) -> dict:
        """Everything that determines this stage's future numbers, at a step boundary (after one
        of its updates): weights, optimizer, stashed versions, in-flight microbatches (their
        inputs; the graphs are rebuilt by recomputing the forward, which gives identical values),
        unfinished steps' gradients and statistics, the mitigations' state and the program's
        position."""
        clone = lambda ts: [t.detach().clone() for t in ts]  # noqa: E731
        # weights of in-flight microbatches that are neither live nor a stashed version (predicted
        # ones): saved as they are, since the velocity they were predicted with has moved on
        own = {id(w): v for v, w in self.copies.items()}
        extra = {id(r.weights): r.weights for r in self.inflight.values() if r.weights is not None and id(r.weights) not in own}
        order = list(extra)
        return {
            "stage": self.s, "live": self.live, "program": self.program.popped,
            "params": clone(self.params), "optimizer": self.opt.state_dict(),
            "copies": {v: clone(w) for v, w in self.copies.items()},
            # a stashed version is named: recomputing the weights could predict where the forward
            # did not (a velocity that appeared since, with the stage's first update)
            "inflight": {mb: {"action": tuple(r.action), "x": r.x.detach().clone(),
                              "weights": order.index(id(r.weights)) if id(r.weights) in extra else None,
                              "stashed": own.get(id(r.weights))}
                         for mb, r in self.inflight.items()},
            "inflight_weights": [clone(extra[i]) for i in order],
            "grads": {t: clone(g) for t, g in self.grads.items()},
            "stats": {t: dict(st.__dict__) for t, st in self.stats.items()},
            "eval_losses": dict(self.eval_losses),
            "peaks": (self.peak_inflight, self.peak_versions),
            "policy": self.policy.stage_state(self.s),
        }

    def load_state_dict(self, state: dict, program: StageProgram) -> None:
        """Restore ``state`` into this stage, with ``program`` a fresh program of the same plan,
        which is fast-forwarded to the saved position. Stale collective bookkeeping is dropped."""
        if state["stage"] != self.s or len(state["params"]) != len(self.params):
            raise ValueError(f"state of stage {state['stage']} does not fit stage {self.s}")
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
        self.opt.load_state_dict(state["optimizer"])
        self.live = state["live"]
        self.copies = {int(v): [t.clone().requires_grad_(True) for t in w] for v, w in state["copies"].items()}
        self.grads = {int(t): [g.clone() for g in gs] for t, gs in state["grads"].items()}
        self.stats = {int(t): StepStats(**st) for t, st in state["stats"].items()}
        self.eval_losses = dict(state["eval_losses"])
        self.peak_inflight, self.peak_versions = state["peaks"]
        self._posted, self._norms = set(), {}
        self.policy.load_stage_state(self.s, state["policy"])
        self.program = program
        program.skip(state["program"])
        self.inflight = {}
        saved = [[t.clone().requires_grad_(True) for t in w] for w in state["inflight_weights"]]
        for mb, rec in sorted(state["inflight"].items()):
            w = saved[rec["weights"]] if rec["weights"] is not None else None
            if rec.get("stashed") is not None:
                w = self.copies[int(rec["stashed"])]
            self._refill(Action(*rec["action"]), rec["x"], w)

    def _refill(self, a: Action, x: torch.Tensor, w: list[torch.Tensor] | None) -> None:
        """Put a saved in-flight microbatch back: recompute its forward from its saved input."""
        x = x.clone() if self.first else x.clone().requires_grad_(True)
        if w is None:
            w = self._weights(a.version, a.phase, a.step)
        out = self._call(x, w, a.mb)
        if self.last:
            out = lm_loss(out, self.batch(a.step, a.mb % self.m)[1]) / self.m
        self.inflight[a.mb] = InFlight(a, a.version, w, x, out)

