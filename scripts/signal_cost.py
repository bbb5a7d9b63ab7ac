"""Add the held-out signal's cost to a cost profile measured before the profile timed it.

A heuristic that follows the held-out loss (``heuristic.signal=heldout``) runs one forward of
``heuristic.signal_tokens`` tokens through every stage after each step; the clock charges it
(``CostProfile.signal``). A profile from before 2026-12-04 has no ``signal`` entry, and the clock
then charges the training forward scaled by rows (``CostProfile.signal_costs``), an estimate. This
script measures, on this machine, each stage's signal forward (no gradient, ``--rows`` rows) over
its training forward (one microbatch of the profile's rows), interleaved round by round
(``runtime.profile.time_interleaved``), and writes a copy of the profile whose ``signal`` is the
profile's own forward times that ratio. So the recorded costs stay the clock's, every fixed
method's included, and only the ratio comes from today. ``meta.signal_method`` says so.

Run: python scripts/signal_cost.py PROFILE.json [...] --out DIR [--rows 8] [--rounds 20] [--vocab 2048]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from adapipe_cli.cli.compose import compose_config  # noqa: E402
from adapipe_cli.model.build import make_stages, model_config  # noqa: E402
from adapipe_cli.optim import StageOptimizer  # noqa: E402
from adapipe_cli.runtime.profile import stage_work, time_interleaved  # noqa: E402
from adapipe_cli.simulator.clock import CostProfile  # noqa: E402

def ratios(meta: dict, rows: int, rounds: int, vocab: int) -> list[float]:
    """Per stage: the signal forward's time over the training forward's (medians of ``rounds``)."""
    shape = meta["model_shape"]
    cfg = compose_config([f"model={meta['model']}", f"pipeline.stages={meta['stages']}", "pipeline.microbatches=1",
                          f"train.batch_size={meta['microbatch_size']}", f"optim={meta['optimizer']}",
                          f"pipeline.partition={meta.get('partition', 'flops')}",
                          *(f"model.{k}={v}" for k, v in shape.items() if v is not None)])
    stages, _ = make_stages(cfg, model_config(cfg, vocab))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (meta["microbatch_size"], meta["seq_len"]), generator=g)
    y = torch.randint(0, vocab, x.shape, generator=g)
    out = []
    for st in stages:
        work, _ = stage_work(st, lambda named: StageOptimizer(named, cfg.optim), x, y, signal_rows=rows)
        t = time_interleaved({k: work[k] for k in ("forward", "signal")}, rounds, statistic="median")
        out.append(t["signal"][0] / t["forward"][0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for the copies (never the profiles' own)")
    ap.add_argument("--rows", type=int, default=8, help="the signal's rows: heuristic.signal_tokens / model.block_size")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=2048, help="the data's vocabulary (the grids' tinyshakespeare BPE: 2048)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.profiles:
        dest = args.out / path.name
        if dest.resolve() == path.resolve():
            raise SystemExit(f"--out {args.out} holds {path} itself: give another folder")
        prof = CostProfile.load(path)
        r = ratios(prof.meta, args.rows, args.rounds, args.vocab)
        prof.signal = [f * q for f, q in zip(prof.forward, r)]
        prof.meta["signal_rows"] = args.rows
        prof.meta["signal_method"] = (f"the profile's forward x the signal forward's ({args.rows} rows, no gradient) over "
                                      f"the training forward's time, medians of {args.rounds} interleaved rounds x 2 passes "
                                      f"measured later by scripts/signal_cost.py")
        prof.save(dest)
        print(f"{dest}: signal / forward per stage " + " ".join(f"{q:.3f}" for q in r))


if __name__ == "__main__":
    main()
