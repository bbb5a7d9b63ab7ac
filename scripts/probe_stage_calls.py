"""What one stage's forward and backward cost under the conditions a run puts them in.

Two questions of issue 19 (where the dist step's time goes), each measured in one process, one
thread, on the stages of a pipeline cut (``--model``, ``--stages``, microbatches of ``--rows``
sequences):

1. **Computing with a stashed version.** A forward with the live weights (the module's own
   call), with a copy through ``torch.func.functional_call`` (what the executor used before
   2026-12-04) and with the copy swapped into the module's parameter slots
   (``runtime.stage.call_with``, what it uses now), interleaved call by call.
2. **Microbatches in flight.** A forward and a backward with d microbatches' graphs alive, the
   timed one's included (d = 1, 2, 4, 8; the clock's in-flight factor, ``CostProfile.held``):
   before each timed forward d - 1 others are alive, and each timed backward takes the oldest of d.
   The depths take turns call by call.

Times are thread CPU (``time.thread_time``: what the stage computes, whatever else the machine
runs), the median over ``--calls`` calls after ``--warm`` untimed ones. Not a benchmark of record.
Run: python scripts/probe_stage_calls.py [--model gpt-nano] [--stages 2] [--rows 4] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import deque

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from torch.func import functional_call  # noqa: E402

from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.data import build_data  # noqa: E402
from adapipe_cli.model import lm_loss  # noqa: E402
from adapipe_cli.model.build import make_stages, model_config  # noqa: E402
from adapipe_cli.runtime.stage import call_with, param_slots  # noqa: E402

DEPTHS = (1, 2, 4, 8)


def timed(fn) -> tuple[float, object]:
    t0 = time.thread_time()
    out = fn()
    return time.thread_time() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warm", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose_config([f"model={args.model}", f"pipeline.stages={args.stages}", "pipeline.microbatches=1",
                          f"train.batch_size={args.rows}"])
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    stages, _ = make_stages(cfg, model_config(cfg, data.vocab_size))
    tokens, targets = data.train_batch(0, args.rows)
    ms = lambda xs: f"{1e3 * statistics.median(xs):6.3f}"  # noqa: E731
    print(f"{args.model}, {args.stages} stages, microbatch {args.rows} x {tokens.shape[1]}, 1 thread; "
          f"thread CPU ms, median of {args.calls} calls")
    for s, mod in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        named = list(mod.named_parameters())
        names, live = [n for n, _ in named], [p for _, p in named]
        stash = [p.detach().clone().requires_grad_(True) for p in live]
        slots = param_slots(mod, live)
        x = tokens if first else torch.randn(args.rows, tokens.shape[1], cfg.model.d_model).requires_grad_(True)
        ways = {"live": lambda: mod(x),
                "functional_call": lambda: functional_call(mod, dict(zip(names, stash)), (x,), tie_weights=False),
                "slot swap": lambda: call_with(mod, slots, stash, x)}
        t = {k: [] for k in ways}
        for i in range(args.warm + args.calls):
            for k, f in ways.items():
                dt, _ = timed(f)
                if i >= args.warm:
                    t[k].append(dt)
        print(f"stage {s} forward: " + "  ".join(f"{k} {ms(v)}" for k, v in t.items())
              + f"  (functional_call - live: {1e3 * (statistics.median(t['functional_call']) - statistics.median(t['live'])):+.3f})")

        inputs = live if first else [x, *live]

        def fwd():
            out = mod(x)
            return lm_loss(out, targets) if last else out

        grad = None if last else torch.randn_like(fwd())
        pools = {d: deque() for d in DEPTHS}
        tf, tb = {d: [] for d in DEPTHS}, {d: [] for d in DEPTHS}
        for i in range(args.warm + args.calls):
            for d, pool in pools.items():  # (interleaved: the machine's drift slows every depth alike)
                while len(pool) < d - 1:
                    pool.append(fwd())
                dt_f, out = timed(fwd)
                pool.append(out)
                y = pool.popleft()
                dt_b, _ = timed(lambda: torch.autograd.grad(y, inputs, grad, allow_unused=True))
                if i >= args.warm:
                    tf[d].append(dt_f)
                    tb[d].append(dt_b)
        row = [(d, statistics.median(tf[d]), statistics.median(tb[d])) for d in DEPTHS]
        base_f, base_b = row[0][1], row[0][2]
        print(f"stage {s} in flight: " + "  ".join(f"{d}: F {1e3 * f:.3f} ({f / base_f:.2f}x) B {1e3 * b:.3f} ({b / base_b:.2f}x)"
                                                   for d, f, b in row))


if __name__ == "__main__":
    main()
