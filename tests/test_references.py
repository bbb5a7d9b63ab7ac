"""The async weight rules and the mitigations against a hand-written delayed-gradient loop.

:class:`DelayedLoop` trains the project's tiny GPT stages one step at a time, with the weight version
of every forward and backward taken from ``version_table`` (the documented semantics, written apart
from the engine), and applies each mitigation from its formula in schedules/mitigations.py. It
uses AdamW at a constant learning rate, no weight decay, no clipping and no dropout, so the only
differences from the local runtime are float rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.func import functional_call

from adapipe_cli.model import build_stages, lm_loss, partition
from helpers import GCFG, B, local_runtime, make_data, optim_cfg, rel_close, run_losses, sched_cfg, one_block_per_stage
from version_table import PHASE, microbatch_versions

LR, BETAS, EPS = 5e-3, (0.9, 0.95), 1e-8


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: the same reduction order in both loops, and fast on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def async_start(plan: str, t: int) -> int:
    while t > 0 and plan[t - 1] == "a":
        t -= 1
    return t


class DelayedLoop:
    """The delayed-gradient loop, one step at a time, with every stage's weight versions kept.

    Per microbatch: a forward through the stages with each stage's forward version, then a backward
    from the last stage; a stage whose backward version differs (``latest``) recomputes its forward
    from its saved input at that version. After each step every stage applies its summed gradient
    with AdamW, then
    - ``lr_reschedule`` (async): lr * (1 + d) ** -(1 - min(k / K, 1)), d the step's mean forward delay;
    - ``nesterov`` (async): W(t+1) = W(t) + gamma (W(t) - W(t-1)) + (1 - gamma) D(t), with no
      gamma term when update t - 1 was sync (or there was none);
    - ``predict``: a forward of version v in step t > v uses W(v) + (t - v) u, u the velocity after
      the stage's updates so far, made of async updates only: a sync update leaves none, the next
      async update n sets u = W(n) - W(n-1), each async update after it u = beta u + (1 - beta)
      (W(n) - W(n-1)); with no velocity the forward uses W(v).
    """

    def __init__(self, p, m, plan, rule, mitigation=(), beta=0.0, gamma=0.5, resched_steps=3, gcfg=GCFG, table=None):
        """``table`` (default: the 1F1B one of ``version_table``) gives the versions of every stage."""
        self.p, self.m, self.plan, self.mitigation = p, m, plan, set(mitigation)
        self.beta, self.gamma, self.K = beta, gamma, resched_steps
        self.stages = build_stages(gcfg, partition(gcfg, p), seed=0)
        self.names = [[n for n, _ in st.named_parameters()] for st in self.stages]
        self.live = [[q for _, q in st.named_parameters()] for st in self.stages]
        self.opts = [torch.optim.AdamW(w, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)
                     for w in self.live]
        self.versions = [[[q.detach().clone() for q in w]] for w in self.live]  # versions[s][v]
        self.velocity = [dict() for _ in range(p)]  # velocity[s][n]: after n updates (none after a sync one)
        self.previous = [None] * p  # W(t) - W(t-1) of an async update t, for nesterov
        # table[s][j] = (forward v, backward v, updates)
        self.table = table if table is not None else microbatch_versions(p, m, plan, rule)

    def weights(self, s, v, t, made):
        w = self.versions[s][v]
        if "predict" in self.mitigation and t > v and made in self.velocity[s]:
            w = [q + (t - v) * u for q, u in zip(w, self.velocity[s][made])]
        return [q.clone().requires_grad_(True) for q in w]

    def call(self, s, w, h):
        return functional_call(self.stages[s], dict(zip(self.names[s], w)), (h,))

    def microbatch(self, j, x, y, grads) -> float:
        """Forward and backward of microbatch ``j``; adds its gradient to ``grads``, returns its loss."""
        t, p = j // self.m, self.p
        inputs, outs, used, h = [], [], [], x
        for s in range(p):
            vf, _, made = self.table[s][j]
            used.append(self.weights(s, vf, t, made))
            inputs.append(h if s == 0 else h.detach().requires_grad_(True))
            h = self.call(s, used[s], inputs[s])
            outs.append(h)
        loss = lm_loss(h, y)
        outs[-1] = loss / self.m
        g = None
        for s in reversed(range(p)):
            vf, vb, made = self.table[s][j]
            w, out = used[s], outs[s]
            if vb != vf:  # differentiate at the weights current when the backward runs
                w = self.weights(s, vb, t, made)
                out = self.call(s, w, inputs[s])
                if s == p - 1:
                    out = lm_loss(out, y) / self.m
            gs = torch.autograd.grad(out, w if s == 0 else [inputs[s], *w], g)
            if s > 0:
                g, gs = gs[0], gs[1:]
            for acc, gi in zip(grads[s], gs):
                acc.add_(gi)
        return loss.item()

    def update(self, s, t, grads) -> None:
        phase, w = PHASE[self.plan[t]], self.live[s]
        delay = sum(t - self.table[s][t * self.m + i][0] for i in range(self.m)) / self.m
        scale = 1.0
        if phase == "async" and "lr_reschedule" in self.mitigation and delay > 0:
            k = t - async_start(self.plan, t)
            scale = (1 + delay) ** -(1 - min(k / self.K, 1.0))
        for group in self.opts[s].param_groups:
            group["lr"] = LR * scale
        before = [q.detach().clone() for q in w]
        for q, g in zip(w, grads):
            q.grad = g
        self.opts[s].step()
        self.opts[s].zero_grad(set_to_none=True)
        with torch.no_grad():
            if "nesterov" in self.mitigation and phase == "async":
                for n, (q, w0) in enumerate(zip(w, before)):
                    ahead = 0 if self.previous[s] is None else self.gamma * self.previous[s][n]
                    q.copy_(w0 + ((1 - self.gamma) * (q - w0) + ahead))
            delta = [q.detach() - w0 for q, w0 in zip(w, before)]
        n = len(self.versions[s])  # updates made, this one included
        if phase == "async":
            self.previous[s] = delta
            u = self.velocity[s].get(n - 1)  # (none when update n - 1 was sync)
            self.velocity[s][n] = delta if u is None else [self.beta * a + (1 - self.beta) * d for a, d in zip(u, delta)]
        else:  # nothing of a sync update is kept for async's look-ahead or prediction
            self.previous[s] = None
        self.versions[s].append([q.detach().clone() for q in w])

    def step(self, t, x, y) -> float:
        mb = B // self.m
        grads = [[torch.zeros_like(q) for q in w] for w in self.live]
        losses = [self.microbatch(t * self.m + i, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb], grads)
                  for i in range(self.m)]
        for s in range(self.p):
            self.update(s, t, grads[s])
        return sum(losses) / len(losses)


def reference(p, m, plan, rule, data, mitigation=(), **kw):
    """Losses of every step and the final weights of every stage."""
    loop = DelayedLoop(p, m, plan, rule, mitigation, gcfg=one_block_per_stage(p), **kw)
    losses = [loop.step(t, *data[t]) for t in range(len(plan))]
    return losses, [v[-1] for v in loop.versions]


def engine(p, m, plan, rule, data, mitigation=(), sync="1f1b", **sched):
    phases = [PHASE[c] for c in plan]
    ocfg = optim_cfg(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.0, decay="constant", warmup_steps=0)
    rt = local_runtime(p, m, phases, data, weights=rule, ocfg=ocfg, clip=0.0, sync=sync, gcfg=one_block_per_stage(p),
                       scfg=sched_cfg(mitigation=list(mitigation), **sched))
    return run_losses(rt, len(plan)), [ex.params for ex in rt.executors]


def assert_matches(p, m, plan, rule, mitigation=(), ref_kw=None, sync="1f1b", **sched):
    data = make_data(len(plan))
    if mitigation or ref_kw:
        ref_losses, ref_w = reference(p, m, plan, rule, data, mitigation, **(ref_kw or {}))
    else:
        ref_losses, ref_w = plain_reference(p, m, plan, rule)
    got_losses, got_w = engine(p, m, plan, rule, data, mitigation, sync, **sched)
    assert rel_close(got_losses, ref_losses, 1e-6), (got_losses, ref_losses)
    # weights move by about LR per step; rounding (e.g. a fused multiply-add) that Adam's
    # normalisation amplifies stays near 1e-6
    for s, (a, b) in enumerate(zip(got_w, ref_w)):
        for x, y in zip(a, b):
            assert torch.allclose(x.detach(), y, rtol=1e-4, atol=1e-5), f"stage {s} weights"
    return ref_losses


@functools.lru_cache(maxsize=None)
def plain_reference(p, m, plan, rule):
    """The reference without mitigations, computed once per case (read only): the sync schedules
    draining into the same plan share it, and so do the sensitivity checks."""
    return reference(p, m, plan, rule, make_data(len(plan)))


def plain(p, m, plan, rule):
    """The reference's losses without mitigations (shared by the sensitivity checks)."""
    return plain_reference(p, m, plan, rule)[0]


def assert_differs(a, b):
    """The case is sensitive: without the rule or mitigation under test the losses differ by ten
    times the tolerance of the match."""
    assert not rel_close(a, b, 1e-5), (a, b)


def test_reference_is_the_sync_loop_when_every_step_is_sync():
    """The loop itself, with every step sync, is gradient accumulation at W(t), as the engine."""
    assert_matches(2, 2, "sss", "stash")


# (4, 1, aaaaaa) is slow (make test-all): latest's recompute at the current weights stays fast here
# at (4, 2) (async runs and switches) and with predict and nesterov (3, 2)
@pytest.mark.parametrize("p,m,plan", [pytest.param(4, 1, "aaaaaa", marks=pytest.mark.slow), (4, 2, "saassaaa")])
def test_latest_differentiates_at_the_current_weights(p, m, plan):
    got = assert_matches(p, m, plan, "latest")
    assert_differs(got, plain(p, m, plan, "stash"))


# (4, 1, aaasaaa) is slow (make test-all): vertical's versions stay fast here at (4, 2), and through
# a drain and a fill with predict (4, 2, aaasaaa)
@pytest.mark.parametrize("p,m,plan", [(4, 2, "aaaaaa"), pytest.param(4, 1, "aaasaaa", marks=pytest.mark.slow)])
def test_vertical_uses_the_first_stages_version(p, m, plan):
    got = assert_matches(p, m, plan, "vertical")
    assert_differs(got, plain(p, m, plan, "stash"))


@pytest.mark.parametrize("p,m,plan,rule", [(4, 2, "aaasaaa", "stash"), (3, 2, "saassaaa", "2bw"),
                                           (2, 1, "aaasaaa", "2bw")])
def test_mixed_plans_train_with_the_table_versions(p, m, plan, rule):
    assert_matches(p, m, plan, rule)


# AdaPipe's sync phase as each sync schedule: the drain into a sync step and the fill after it are
# the same whatever the step's inner order (ZB-H2 without clipping: no barrier at the update, so a
# stage starts the next step, or the async fill, while later stages finish theirs)
@pytest.mark.parametrize("sync", ["gpipe", "zbh1", "zbh2"])
@pytest.mark.parametrize("p,m,plan,rule", [(4, 2, "saassaaa", "stash"),
                                           pytest.param(3, 4, "aasasaa", "2bw", marks=pytest.mark.slow)])
def test_every_sync_schedule_drains_and_fills_as_the_table_says(p, m, plan, rule, sync):
    assert_matches(p, m, plan, rule, sync=sync)


@pytest.mark.parametrize("p,m,plan,rule,beta", [(4, 1, "aaaaaa", "stash", 0.5), (3, 4, "saassaaa", "2bw", 0.5),
                                                (4, 2, "aaasaaa", "vertical", 0.0), (3, 2, "aaasaaa", "latest", 0.5)])
def test_predict_is_the_closed_form(p, m, plan, rule, beta):
    """2bw at m > p - 1 and vertical forward some microbatches of a step after the stage's next
    update: those use the velocity current then; latest's backward (delay 0) is not predicted."""
    got = assert_matches(p, m, plan, rule, ["predict"], {"beta": beta}, predict_beta=beta)
    assert_differs(got, plain(p, m, plan, rule))


@pytest.mark.parametrize("p,m,plan,rule", [(4, 1, "saassaaa", "stash"), (3, 2, "aaasaaa", "latest")])
def test_nesterov_is_its_formula(p, m, plan, rule):
    got = assert_matches(p, m, plan, rule, ["nesterov"], {"gamma": 0.7}, nesterov_gamma=0.7)
    assert_differs(got, plain(p, m, plan, rule))


@pytest.mark.parametrize("p,m,plan,rule", [(4, 1, "saassaaa", "stash"), (3, 2, "aaasaaa", "2bw")])
def test_lr_reschedule_is_its_formula(p, m, plan, rule):
    got = assert_matches(p, m, plan, rule, ["lr_reschedule"], {"resched_steps": 3}, lr_reschedule_steps=3)
    assert_differs(got, plain(p, m, plan, rule))


def test_mitigations_compose():
    kw = {"beta": 0.5, "gamma": 0.6, "resched_steps": 2}
    assert_matches(4, 2, "aaasaaa", "stash", ["predict", "nesterov", "lr_reschedule"], kw,
                   predict_beta=0.5, nesterov_gamma=0.6, lr_reschedule_steps=2)
