"""How each update is made: the learning-rate schedule, the async phase's own knobs, and the
staleness mitigations (``schedule.mitigation=[...]``, composable).

- ``lr_reschedule``: PipeMare's learning-rate rescheduling (Yang et al., "PipeMare: Asynchronous
  Pipeline Parallel DNN Training", MLSys 2021, technique T1). A stage whose gradients are ``d``
  steps stale takes the step size ``lr * (1 + d) ** -(1 - min(k / K, 1))``, where ``k`` counts
  steps since the async phase began and ``K = schedule.lr_reschedule_steps``: scaled down by the
  delay at first, annealed back to the full rate over ``K`` steps. Restarted at every switch into
  async.
- ``predict``: weight prediction / discrepancy correction (Chen et al., "Efficient and Robust
  Parallel DNN Training through Model Parallelism on Multi-GPU Platform" (SpecTrain), 2018;
  PipeMare T2). A forward whose gradient will be applied ``d`` steps later uses the extrapolated
  weights ``W_v + d * u``, where ``u`` is the stage's update velocity, an EMA of its recent updates
  ``u <- beta u + (1 - beta) (W_{v} - W_{v-1})`` with ``beta = schedule.predict_beta``; its
  backward differentiates at the same predicted weights. Only async updates feed the velocity: a
  sync phase predicts nothing, so a sync update keeps no pre-update copy and forgets the velocity.
  Each async phase (the first included) starts without one: the stage's first async update sets
  ``u = W_v - W_{v-1}``, and the stage's forwards before that update use unpredicted weights.
- ``nesterov``: a Nesterov-style look-ahead for delayed gradients in the optimizer's momentum,
  after Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel Optimization"
  (ICML 2025), who add a weight-space look-ahead on top of the base optimizer so that the momentum
  carries the parameters ahead of the stale gradient. Here an async update with base step
  ``D_t`` becomes ``W_{t+1} = W_t + gamma (W_t - W_{t-1}) + (1 - gamma) D_t`` with
  ``gamma = schedule.nesterov_gamma``; the ``(1 - gamma)`` keeps the effective step size of the
  base optimizer (our normalisation; the paper folds it into the learning rate). Like the
  velocity, ``W_t - W_{t-1}`` is kept from async updates only: the first async update after a
  sync one (or the run's first) has no look-ahead term.

Async knobs (issue "async that pays"): ``schedule.async_lr_scale`` multiplies the learning rate of
every async update; after every switch from sync into async, ``schedule.transition_steps`` steps
ramp the learning rate linearly from ``transition_lr_scale`` to 1 and, if
``transition_momentum`` is set, use it as the first-moment/momentum coefficient.
"""

from __future__ import annotations

import torch

from ..optim import lr_factor
from .actions import ASYNC, SYNC, Plan

MITIGATIONS = ("lr_reschedule", "predict", "nesterov")


class UpdatePolicy:
    """Decides each update's learning-rate scale and momentum, and applies the mitigations.

    Everything it decides is a function of (stage, step, plan, config), so every runtime and a
    resumed run take the same decisions."""

    def __init__(self, optim_cfg, sched_cfg, plan: Plan, total_steps: int):
        self.o, self.c, self.plan, self.total = optim_cfg, sched_cfg, plan, total_steps
        # the knobs read once: a config node's attribute costs several microseconds, and every
        # stage's every update reads up to eight of them (neither config changes during a run)
        self._warmup, self._min_ratio, self._decay = optim_cfg.warmup_steps, optim_cfg.min_lr_ratio, optim_cfg.decay
        self._async_scale, self._reschedule_steps = sched_cfg.async_lr_scale, sched_cfg.lr_reschedule_steps
        self._ramp, self._ramp_from = sched_cfg.transition_steps, sched_cfg.transition_lr_scale
        self._ramp_momentum = sched_cfg.transition_momentum
        self._gamma, self._beta = sched_cfg.nesterov_gamma, sched_cfg.predict_beta
        self.mitigations = set(sched_cfg.mitigation)
        unknown = self.mitigations - set(MITIGATIONS)
        if unknown:
            raise ValueError(f"unknown mitigation {sorted(unknown)[0]!r}: use {', '.join(MITIGATIONS)}")
        # (both from async updates only: a sync update forgets them, see the module docstring)
        self.velocity: dict[int, list[torch.Tensor]] = {}  # stage -> update velocity (predict)
        self.previous_step: dict[int, list[torch.Tensor]] = {}  # stage -> W_t - W_{t-1} (nesterov)

    def replica(self) -> "UpdatePolicy":
        """A policy for another replica of the pipeline: the same plan and decisions, its own
        mitigation state (each replica's stages update their own velocities)."""
        return UpdatePolicy(self.o, self.c, self.plan, self.total)

    # -- learning rate -----------------------------------------------------------------------
    def base_scale(self, step: int) -> float:
        return lr_factor(step, self._warmup, self.total, self._min_ratio, self._decay)

    def _async_age(self, step: int, limit: int) -> tuple[int, bool]:
        """``(k, after_sync)``: ``k`` the steps of ``step``'s async phase before it (``step`` minus
        the phase's first step), counted only up to ``limit`` (the
        knobs look no further back: a ramp of ``transition_steps``, PipeMare's anneal over
        ``lr_reschedule_steps``), and whether that async phase began after a sync step (not at
        the run's first step; meaningful while ``k < limit``). A scan of the whole phase would
        cost every update time linear in the step."""
        phases, k = self.plan.phases, 0
        while k < limit and step - k > 0 and phases[step - k - 1] == ASYNC:
            k += 1
        return k, step - k > 0

    def schedule_scale(self, step: int, phase: str) -> float:
        """The learning-rate scale every stage's update of ``step`` shares: warm-up and decay, and
        in async the phase's own scale and the transition ramp (PipeMare's per-stage rescheduling
        comes on top, in :meth:`update_scale`)."""
        if phase == SYNC:
            return self.base_scale(step)
        return self._async_schedule_scale(step, *self._async_age(step, self._ramp))

    def _async_schedule_scale(self, step: int, k: int, after_sync: bool) -> float:
        scale = self.base_scale(step) * self._async_scale
        if after_sync and k < self._ramp:  # a switch from sync into async
            r = self._ramp_from
            scale *= r + (1 - r) * k / self._ramp
        return scale

    def update_scale(self, stage: int, step: int, phase: str, delay: float) -> tuple[float, float | None]:
        """(learning-rate scale, momentum override or None) of stage ``stage``'s update of
        ``step``, whose gradient is ``delay`` steps stale on average."""
        if phase == SYNC:
            return self.base_scale(step), None
        reschedule = "lr_reschedule" in self.mitigations and delay > 0
        anneal_steps = max(1, self._reschedule_steps) if reschedule else 0
        k, after_sync = self._async_age(step, max(self._ramp, anneal_steps))
        scale, beta1 = self._async_schedule_scale(step, k, after_sync), None
        if after_sync and k < self._ramp:  # a switch from sync into async
            beta1 = self._ramp_momentum
        if reschedule:
            anneal = 1 - min(k / anneal_steps, 1.0)
            scale *= (1 + delay) ** (-anneal)
        return scale, beta1

    # -- weight prediction -------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, stage: int, base: list[torch.Tensor], d: int) -> list[torch.Tensor]:
        """``W_v + d * u``: the weights ``base`` (version v) extrapolated ``d`` updates ahead with
        the stage's current velocity (the stage's ledger decides when a prediction is made)."""
        u = self.velocity[stage]
        return [(w.detach() + d * v).requires_grad_(True) for w, v in zip(base, u)]

    # -- around an update --------------------------------------------------------------------
    def before_update(self, ex, phase: str) -> list[torch.Tensor] | None:
        """The weights before an async update, for the velocity and nesterov (a sync update needs
        none: nothing in a sync phase is predicted or looked ahead)."""
        if phase == ASYNC and self.mitigations & {"predict", "nesterov"}:
            return [p.detach().clone() for p in ex.params]
        return None

    @torch.no_grad()
    def after_update(self, ex, before: list[torch.Tensor] | None, phase: str, delay: float) -> None:
        if phase == SYNC:  # forgotten: the next async phase rebuilds them from its own updates
            self.velocity.pop(ex.s, None)
            self.previous_step.pop(ex.s, None)
            return
        if before is None:
            return
        if "nesterov" in self.mitigations and phase == ASYNC:
            g = self._gamma
            prev = self.previous_step.get(ex.s)
            for p, w0, d0 in zip(ex.params, before, prev or [None] * len(before)):
                step = (p - w0) * (1 - g)
                if d0 is not None:
                    step.add_(d0, alpha=g)
                p.copy_(w0 + step)
        deltas = [p.detach() - w0 for p, w0 in zip(ex.params, before)]
        self.previous_step[ex.s] = deltas
        if "predict" in self.mitigations:
            b = self._beta
            u = self.velocity.get(ex.s)
            self.velocity[ex.s] = deltas if u is None or b == 0 else [v.mul(b).add_(d, alpha=1 - b) for v, d in zip(u, deltas)]

    def stage_state(self, stage: int) -> dict:
        """What the mitigations remember about a stage."""
        clone = lambda ts: None if ts is None else [t.clone() for t in ts]  # noqa: E731
        return {"velocity": clone(self.velocity.get(stage)), "previous_step": clone(self.previous_step.get(stage))}

    def load_stage_state(self, stage: int, state: dict) -> None:
        for name in ("velocity", "previous_step"):
            table = getattr(self, name)
            table.pop(stage, None)
            if state.get(name) is not None:
                table[stage] = [t.clone() for t in state[name]]
