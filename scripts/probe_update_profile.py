"""What a stage's update costs on zero gradients, as the cost profile timed it until 2026-12-06,
against a gradient of the stage's own backward, as a run's update has.

The profile's update (``runtime.profile.stage_work``) used to be timed on fresh zero gradients.
Adam's moments then stay 0, and ``torch.sqrt`` of zeros (Adam's denominator) can be many times
slower than of other values on a CPU. This measures, in one process and one thread:

1. ``torch.sqrt`` over 65,536 floats of zeros, of uniform values in [0, 1), and of a denormal
   (1e-40: what a second moment decays to when a gradient stays 0 for long);
2. each stage's update (the executor's: squared gradient norm, the clipping multiply, the
   optimizer's step) on zero gradients and on a gradient of the stage's own backward (fresh
   copies before each call), alternating call by call, each on its own optimizer.

Times are thread CPU (``time.thread_time``), the median over ``--calls`` calls after ``--warm``
untimed ones. Not a benchmark of record.
Run: python scripts/probe_update_profile.py [--model gpt-micro] [--optim adamw] [--stages 4] [--rows 4]
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
from adapipe_cli.optim import StageOptimizer  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--warm", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose_config([f"model={args.model}", f"optim={args.optim}", f"pipeline.stages={args.stages}",
                          "pipeline.microbatches=1", f"train.batch_size={args.rows}"])
    print(f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread; thread CPU, "
          f"median of {args.calls} calls after {args.warm}")
    print("torch.sqrt over 65,536 floats (us): " + ", ".join(f"{k} {v:.1f}" for k, v in sqrt_costs(200).items()))
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    stages, _ = make_stages(cfg, model_config(cfg, data.vocab_size))
    tokens, targets = data.train_batch(0, args.rows)
    print(f"{args.model}, {args.optim}, {args.stages} stages, microbatch {args.rows} x {tokens.shape[1]}: "
          f"one stage's update (ms)")
    total = {"zero": 0.0, "real": 0.0}
    for s, stage in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        x = tokens if first else torch.randn(args.rows, tokens.shape[1], cfg.model.d_model).requires_grad_(True)
        params = list(stage.parameters())
        out = stage(x)
        out = lm_loss(out, targets) if last else out
        real = torch.autograd.grad(out, params, None if last else torch.randn_like(out), allow_unused=True)
        real = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, real)]
        ways = {}
        for name, grads in (("zero", [torch.zeros_like(g) for g in real]), ("real", real)):
            mod = copy.deepcopy(stage)  # each way its own weights and optimizer state
            ps = list(mod.parameters())
            opt = StageOptimizer(list(mod.named_parameters()), cfg.optim)

            def update(ps=ps, opt=opt, grads=grads):
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                gs = [p.grad for p in ps]
                return timed(lambda: (float(torch.stack([torch.linalg.vector_norm(g) for g in gs]).pow(2).sum()),
                                      [g.mul_(0.5) for g in gs], opt.step(1.0)))
            ways[name] = update
        t = {k: [] for k in ways}
        for i in range(args.warm + args.calls):
            for k, f in ways.items():
                dt = f()
                if i >= args.warm:
                    t[k].append(dt)
        z, r = median_ms(t["zero"]), median_ms(t["real"])
        total["zero"] += z
        total["real"] += r
        print(f"stage {s}: zero gradients {z:.3f}, its own backward's {r:.3f} ({z / r:.2f}x)")
    print(f"all stages: zero {total['zero']:.3f}, real {total['real']:.3f} ({total['zero'] / total['real']:.2f}x)")


if __name__ == "__main__":
    main()
