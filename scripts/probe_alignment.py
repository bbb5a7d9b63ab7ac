"""Can a fresh gradient tell async's statistical efficiency without a phase switch? (AdaPipe #13)

The first-order signal: a stale update applies the gradient g_s of batch b computed d steps ago;
the fresh gradient of the same batch at the current weights is g_f. Along the held-out gradient
g_h (the direction of progress), the stale step makes progress g_h . P g_s against g_h . P g_f for
the fresh one (P: AdamW's diagonal preconditioner 1 / (sqrt(v) + eps), or 1 for SGD), so

    rho = (g_h . P g_s) / (g_h . P g_f)

would be async's efficiency per step if staleness only rotated the gradient. This script measures
rho every ``--every`` steps inside a hand-written delayed-gradient AdamW loop (every parameter's
gradient d steps old, PipeDream's stage 0 at depth d + 1 with one microbatch), and beside it the
efficiency that counts, E = sync's steps to a target over the delayed loop's steps to it, where the
target is the fresh loop's held-out loss at 3/4 of its steps. If rho tracks E, a fresh gradient
every k steps (one extra forward and backward) could replace probes.

    python scripts/probe_alignment.py [--steps 600] [--delays 1 3 7] [--every 25]

gpt-micro on tinyshakespeare, AdamW (lr 1e-3, betas 0.9/0.95, warm-up 20 steps, constant, the
applied gradient clipped to global norm 1.0 as the runs do), batches of 4 sequences of 64 tokens,
one thread, no mitigation (no weight prediction). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.config.paths import shared_data  # noqa: E402
from adapipe_cli.data import build_data  # noqa: E402
from adapipe_cli.model.gpt import build_full_model, lm_loss  # noqa: E402
from adapipe_cli.model.build import model_config  # noqa: E402


def grads(model, x, y) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def dot(a, b, pre=None) -> float:
    if pre is None:
        return float(sum((u * v).sum() for u, v in zip(a, b)))
    return float(sum((u * w * v).sum() for u, v, w in zip(a, b, pre)))


def run(cfg, data, val, delay: int, steps: int, every: int) -> dict:
    torch.manual_seed(cfg.seed)
    model = build_full_model(model_config(cfg, data.vocab_size), cfg.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 20))
    xh, yh = val[0]
    pending: list[tuple[list[torch.Tensor], int]] = []  # (gradient, the step whose batch it is)
    curve, rhos = [], []
    for t in range(steps):
        x, y = data.train_batch(t, 4)
        pending.append((grads(model, x, y), t))
        if t % 10 == 0:
            with torch.no_grad():
                curve.append((t, float(lm_loss(model(xh), yh))))
        if len(pending) <= delay:
            continue  # the pipeline fills: nothing to apply yet
        g_s, b = pending.pop(0)
        if every and t % every == 0 and delay > 0 and opt.state:
            g_h = grads(model, xh, yh)
            xb, yb = data.train_batch(b, 4)
            g_f = grads(model, xb, yb)
            pre = [1.0 / (opt.state[p]["exp_avg_sq"].sqrt() + 1e-8) for p in params]
            rhos.append((t, dot(g_h, g_s, pre) / dot(g_h, g_f, pre), dot(g_h, g_s) / dot(g_h, g_f)))
        for p, g in zip(params, g_s):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # the runs' optim.grad_clip (global norm 1.0)
        opt.step()
        sched.step()
    return {"curve": curve, "rho": rhos}


def steps_to(curve, target: float) -> float:
    return next((t for t, v in curve if v <= target), float("inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--delays", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose_config(["model=gpt-micro", "data=tinyshakespeare", f"data.path={shared_data('tinyshakespeare')}",
                          "data.eval_tokens=1024", f"seed={a.seed}"])
    data = build_data(cfg.data, cfg.model.block_size, cfg.seed)
    val = data.val_batches(16)
    t0 = time.time()
    fresh = run(cfg, data, val, 0, a.steps, 0)
    target = dict(fresh["curve"])[int(0.75 * a.steps) // 10 * 10]
    n_sync = steps_to(fresh["curve"], target)
    print(f"fresh: target held-out loss {target:.4f} at step {n_sync} ({time.time() - t0:.0f} s)", file=sys.stderr)
    rows = ["| delay d | E = steps(sync) / steps(delayed) | rho (AdamW-preconditioned), median (min-max) | rho (plain dot), median |",
            "|---|---|---|---|"]
    for d in a.delays:
        r = run(cfg, data, val, d, 2 * a.steps, a.every)
        n = steps_to(r["curve"], target)
        rho_p = [x for _, x, _ in r["rho"]]
        rho_g = [x for _, _, x in r["rho"]]
        e = n_sync / n if n != float("inf") else 0.0
        rows.append(f"| {d} | {e:.3f} ({n_sync} / {n}) | {statistics.median(rho_p):.3f} ({min(rho_p):.3f}-{max(rho_p):.3f}) "
                    f"| {statistics.median(rho_g):.3f} |")
        print(rows[-1], f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
