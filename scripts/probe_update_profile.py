"""What a stage's update costs on zero gradients, as the cost profile timed it until 2026-12-06,
against a gradient of the stage's own backward, as a run's update has.

The profile's update (``runtime.profile.stage_work``) used to be timed on fresh zero gradients.
Adam's moments then stay 0, and ``torch.sqrt`` of zeros (Adam's denominator) can be many times
slower than of other values on a CPU. This measures, in one process and one thread:

1. ``torch.sqrt`` over 65,536 floats of zeros, of uniform values in [0, 1), and of a denormal
   (1e-40: what a second moment decays to when a gradient stays 0 for long);
2. each stage's update (the executor's: squared gradient norm, the clipping multiply, the
   optimizer's step) on zero gradients, on a gradient of the stage's own backward (fresh copies
   before each call), each on its own copy and optimizer, and the profile's own update
   (``stage_work``'s: its microbatch's gradient after one step on a dense random gradient; one
   microbatch's gradient alone leaves the embedding rows of the tokens it lacks at 0),
   alternating call by call.

3. with ``--train N``: the run's own updates. The stages are trained as one chained model for N
   steps (one microbatch a step, clipped by the global norm, the optimizer's constant rate after
   its warm-up), each stage's update timed every step; at steps 50, 250, 500, 1000, ... and the
   last, the median of its last 50 updates is printed beside the profile's update of the stage as
   it is then (:func:`..runtime.profile.stage_work`'s: a copy, a fresh optimizer, one dense step)
   and a zero-gradient update of the same, and how many rows of the embedding's second moment are 0
   (tokens not seen yet) or hold a denormal (tokens not seen for about 1,300 steps at beta2 0.95).

Times are thread CPU (``time.thread_time``), the median over ``--calls`` calls after ``--warm``
untimed ones (at ``--train``'s checkpoints: over a third of ``--calls``, at least 4, after the
first). Not a benchmark of record.
Run: python scripts/probe_update_profile.py [--model gpt-micro] [--optim adamw] [--stages 4] [--rows 4]
       [--train N] [--set data=tinyshakespeare ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.data import build_data  # noqa: E402
from adapipe_cli.model import lm_loss  # noqa: E402
from adapipe_cli.model.build import make_stages, model_config  # noqa: E402
from adapipe_cli.optim import StageOptimizer, lr_factor  # noqa: E402
from adapipe_cli.runtime.profile import stage_work  # noqa: E402

CHECKPOINTS = (50, 250, 500, 1000, 1500, 2000, 3000)
NORMAL_MIN = torch.finfo(torch.float32).tiny  # the smallest normal float32: below it, denormals


def timed(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def sqrt_costs(calls: int) -> dict[str, float]:
    """Microseconds of one ``torch.sqrt`` over 65,536 floats of each kind of value."""
    values = {"zeros": torch.zeros(65536), "uniform [0, 1)": torch.rand(65536), "denormal 1e-40": torch.full((65536,), 1e-40)}
    t = {k: [] for k in values}
    for _ in range(calls):
        for k, v in values.items():
            t[k].append(timed(lambda: torch.sqrt(v)))
    return {k: 1e3 * median_ms(v) for k, v in t.items()}


def executor_update(params: list[torch.Tensor], opt: StageOptimizer, lr_scale: float, coef: float = 0.5) -> float:
    """The executor's update of gradients already in ``params``' ``.grad``: squared norm, the
    clipping multiply by ``coef``, the optimizer's step; its thread CPU seconds."""
    gs = [p.grad for p in params]
    t0 = time.thread_time()
    float(torch.stack([torch.linalg.vector_norm(g) for g in gs]).pow(2).sum())
    for g in gs:
        g.mul_(coef)
    opt.step(lr_scale)
    return time.thread_time() - t0


def profiled_update(cfg, stage, tokens, targets, calls: int, zero: bool) -> float:
    """The profile's update of ``stage`` as it is now (a copy with a fresh optimizer): on a gradient
    of its own backward (``stage_work``'s), or on zeros (the profile's until 2026-12-06)."""
    if not zero:
        work, _ = stage_work(stage, lambda named: StageOptimizer(named, cfg.optim), tokens, targets, grad_clip=1.0)
        return statistics.median([work["update"](time.thread_time) for _ in range(calls)][1:])
    st = copy.deepcopy(stage)
    ps, opt = list(st.parameters()), StageOptimizer(list(st.named_parameters()), cfg.optim)
    ts = []
    for _ in range(calls):
        for p in ps:
            p.grad = torch.zeros_like(p)
        ts.append(executor_update(ps, opt, 1.0))
    return statistics.median(ts[1:])


def train(cfg, data, stages, steps: int, rows: int, calls: int) -> None:
    """Train the stages chained for ``steps`` steps; print the updates' times at the checkpoints."""
    opts = [StageOptimizer(list(s.named_parameters()), cfg.optim) for s in stages]
    params = [list(s.parameters()) for s in stages]
    wte = getattr(getattr(stages[0], "embed", None), "wte", None)
    times: list[list[float]] = [[] for _ in stages]
    print(f"training {steps} steps: each stage's update (ms), the median of its last 50 in the run | the "
          f"profile's now, on its own backward's gradient | on zeros")
    for t in range(steps):
        x, y = data.train_batch(t, rows)
        h = x
        for st in stages:
            h = st(h)
        lm_loss(h, y).backward()
        sq = sum(float(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]).pow(2).sum()) for ps in params)
        coef = min(1.0, cfg.optim.grad_clip / (sq ** 0.5 + 1e-6)) if cfg.optim.grad_clip > 0 else 1.0
        scale = lr_factor(t, cfg.optim.warmup_steps, steps, cfg.optim.min_lr_ratio, "constant")
        for ps, opt, ts in zip(params, opts, times):
            ts.append(executor_update(ps, opt, scale, coef))
        if t + 1 in CHECKPOINTS or t + 1 == steps:
            xs, ys = data.train_batch(0, rows)
            run = [median_ms(ts[-50:]) for ts in times]
            new = [1e3 * profiled_update(cfg, st, xs, ys, max(4, calls // 3), False) for st in stages]
            zero = [1e3 * profiled_update(cfg, st, xs, ys, max(4, calls // 3), True) for st in stages]
            line = f"step {t + 1}: " + "; ".join(f"stage {s} {r:.2f} | {n:.2f} | {z:.2f}"
                                                 for s, (r, n, z) in enumerate(zip(run, new, zero)))
            line += f"; all stages {sum(run):.2f} | {sum(new):.2f} | {sum(zero):.2f}"
            if wte is not None and wte.weight in opts[0].optimizers[-1].state:
                v = opts[0].optimizers[-1].state[wte.weight]["exp_avg_sq"]
                line += (f"; embedding rows with v = 0: {int((v.abs().amax(dim=1) == 0).sum())} of {v.shape[0]}, "
                         f"with a denormal: {int(((v != 0) & (v.abs() < NORMAL_MIN)).any(dim=1).sum())}")
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--train", type=int, default=0, help="steps of a run whose own updates are timed (0: none)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (e.g. data=tinyshakespeare)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose_config([f"model={args.model}", f"optim={args.optim}", f"pipeline.stages={args.stages}",
                          "pipeline.microbatches=1", f"train.batch_size={args.rows}", *args.set])
    print(f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread; thread CPU, "
          f"median of {args.calls} calls after {args.warm}")
    print("torch.sqrt over 65,536 floats (us): " + ", ".join(f"{k} {v:.1f}" for k, v in sqrt_costs(200).items()))
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    stages, _ = make_stages(cfg, model_config(cfg, data.vocab_size))
    tokens, targets = data.train_batch(0, args.rows)
    print(f"{args.model}, {args.optim}, {args.stages} stages, microbatch {args.rows} x {tokens.shape[1]}: one stage's "
          f"update (ms) on zero gradients, on its own backward's, and on its own after one step on a dense gradient "
          f"(the profile's own, since e974eaf)")
    total = {"zero": 0.0, "own": 0.0, "dense, own": 0.0}
    for s, stage in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        x = tokens if first else torch.randn(args.rows, tokens.shape[1], cfg.model.d_model).requires_grad_(True)
        params = list(stage.parameters())
        out = stage(x)
        out = lm_loss(out, targets) if last else out
        real = torch.autograd.grad(out, params, None if last else torch.randn_like(out), allow_unused=True)
        real = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, real)]
        ways = {}
        for name, grads in (("zero", [torch.zeros_like(g) for g in real]), ("own", real)):
            mod = copy.deepcopy(stage)  # each way its own weights and optimizer state
            ps = list(mod.parameters())
            opt = StageOptimizer(list(mod.named_parameters()), cfg.optim)

            def update(ps=ps, opt=opt, grads=grads):
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                return executor_update(ps, opt, 1.0)
            ways[name] = update
        # the profile's own: stage_work's update (its microbatch's gradient, after the dense step)
        profiled = stage_work(stage, lambda named: StageOptimizer(named, cfg.optim), tokens, targets, grad_clip=1.0)[0]
        ways["dense, own"] = lambda w=profiled["update"]: w(time.thread_time)
        t = {k: [] for k in ways}
        for i in range(args.warm + args.calls):
            for k, f in ways.items():
                dt = f()
                if i >= args.warm:
                    t[k].append(dt)
        m = {k: median_ms(v) for k, v in t.items()}
        for k in total:
            total[k] += m[k]
        print(f"stage {s}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items())
              + f" (zero over dense, own: {m['zero'] / m['dense, own']:.2f}x)")
    print("all stages: " + ", ".join(f"{k} {v:.3f}" for k, v in total.items())
          + f" (zero over dense, own: {total['zero'] / total['dense, own']:.2f}x)")
    if args.train:
        train(cfg, data, stages, args.train, args.rows, args.calls)


if __name__ == "__main__":
    main()
