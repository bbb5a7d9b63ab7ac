"""Replay AdaPipe runs' logged observations through their heuristic as the code decides today.

A heuristic's decisions depend only on what it observed (each step's phase, the loss it follows,
the clock) and on what it knew before the start (the predicted step times in ``summary.json``),
so feeding a finished run's ``metrics.jsonl`` back through it, with the training loop's protocol
(step ``u``'s phase decided after step ``u - lag`` was observed), makes the run's decisions again.
Up to the first step whose phase differs from the run's, the replay is exact; after it the run's
observations are of a trajectory the replayed heuristic would not have taken, so the replay stops
there. So, after a change to a heuristic (or with ``--set heuristic.KEY=VALUE``), it tells which
recorded runs still stand as they are (no divergence: the run would be the same number for
number) and which need a rerun, and from which step, without training anything:

    python scripts/replay_heuristic.py RUN_DIR [RUN_DIR ...] [--set heuristic.margin=0.1] [--out FILE.json]

A run directory is one ``adapipe train`` wrote with Hydra (its ``.hydra/config.yaml`` holds the
run's config; a sweep's runs have it; a setting of the heuristic that the run predates takes
today's default). Not replayed, with the reason: runs of a fixed schedule, runs with undone
probes, divergence-guard events or a resume (their observations are not one stream), unfinished
runs. ``--set`` may change only the heuristic's own settings: not its signal (which changes what
the run measures and its clock), nor the undoing of probes or the divergence guard (the training
loop acts on those). A replayed decision that undoes a probe is a divergence (the loop would
rewind the run there).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from adapipe_cli.adaptive.base import Observation
from adapipe_cli.config.schema import HeuristicConfig
from adapipe_cli.schedules.choice import schedule_choice
from adapipe_cli.train import build


class NotReplayable(Exception):
    pass


# heuristic settings the training loop acts on, not the heuristic: a replay cannot follow them
LOOP_KEYS = {"signal", "signal_tokens", "undo_probes", "guard", "guard_factor", "guard_every", "guard_cooldown"}


def check_overrides(overrides: list[str]) -> list[str]:
    """``KEY=VALUE`` settings of the heuristic's own, as dotlist entries; a bad one exits with one line."""
    names = {f.name for f in fields(HeuristicConfig)}
    out = []
    for o in overrides:
        key, eq, _ = o.partition("=")
        key = key.lstrip("+")
        name = key.removeprefix("heuristic.")
        why = ("give it as heuristic.KEY=VALUE" if not eq or not key.startswith("heuristic.") else
               f"heuristic has no setting {name!r}" if name not in names else
               "the training loop acts on it (the signal, undone probes, the divergence guard), not the heuristic"
               if name in LOOP_KEYS else None)
        if why:
            raise SystemExit(f"replay_heuristic: --set {o}: {why}; only the heuristic's own settings can be replayed")
        out.append(o.lstrip("+"))
    return out


def run_config(run: Path, overrides: list[str]):
    """The run's config, its heuristic section on today's schema (a setting the run predates takes
    today's default) with ``overrides``."""
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise NotReplayable(f"no {path.relative_to(run)} (not a run Hydra wrote)")
    cfg = OmegaConf.load(path)
    try:
        heur = OmegaConf.merge(OmegaConf.structured(HeuristicConfig), cfg.heuristic, OmegaConf.from_dotlist(
            [o.removeprefix("heuristic.") for o in overrides]))
    except OmegaConfBaseException as e:  # (a value of the wrong type, or a key the schema dropped)
        raise SystemExit(f"replay_heuristic: {run}: {str(e).splitlines()[0]}") from None
    OmegaConf.set_struct(cfg, False)
    cfg.heuristic = heur
    return cfg


def replay(run: Path, overrides: list[str] = ()) -> dict:
    """The replay of one run: ``{"run", "steps", "divergence", "run_phase", "replay_phase",
    "decision"}`` (divergence None: the replay made every decision of the run), or ``{"run",
    "skipped": reason}``."""
    overrides = check_overrides(list(overrides))
    try:
        cfg = run_config(run, overrides)
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None
        if not summary or not summary.get("completed", True) or "predicted" not in summary:
            raise NotReplayable("no summary.json of a finished run with the predicted step times")
        choice = schedule_choice(cfg)
        if cfg.schedule.name != "adapipe" or choice.phase is not None:
            raise NotReplayable("a fixed schedule (no heuristic)")
        if cfg.train.get("resume"):
            raise NotReplayable("a resumed run (its log holds one stream, its heuristic two sessions)")
        for key, why in (("undone_probes", "undone probes"), ("guard_events", "divergence-guard events")):
            if summary.get(key):
                raise NotReplayable(f"{why} (the observations are not one stream)")
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in records if r.get("kind") == "step"]
        if [r["step"] for r in steps] != list(range(len(steps))):
            raise NotReplayable("its steps are not one stream from step 0")
        pred = summary["predicted"]
        ctx = build.heuristic_context(cfg, pred["sync_step_time"], pred["async_step_time"], pred["switch_time"])
        lag = build.decision_lag(cfg)
        try:
            h = build.make_heuristic(cfg, choice, ctx)
        except ValueError as e:  # (heuristic.start and a user-written heuristic's options)
            raise SystemExit(f"replay_heuristic: {run}: {e}") from None
    except NotReplayable as e:
        return {"run": str(run), "skipped": str(e)}
    except (OSError, KeyError, ValueError, OmegaConfBaseException) as e:  # (a file or key the run lacks)
        return {"run": str(run), "skipped": f"cannot read it: {type(e).__name__}: {str(e).splitlines()[0]}"}
    decided = {u: h.decide(u) for u in range(min(lag, cfg.train.max_steps))}
    prev_time = 0.0
    for rec in steps:
        u = rec["step"]
        d = decided[u]
        # an undo sends the run back to its state before the probe (the loop, not this replay): the
        # runs replayed have none, so the replay parts from the run there
        if d.phase != rec["phase"] or d.undo is not None:
            info = {k: v for k, v in d.info.items() if isinstance(v, (int, float, str)) and v == v and abs(v) != math.inf}
            return {"run": str(run), "steps": len(steps), "divergence": u, "run_phase": rec["phase"],
                    "replay_phase": d.phase if d.undo is None else f"{d.phase} (undoing the probe from step {d.undo})",
                    "decision": {"reason": d.reason, **info}}
        loss = rec.get("signal", rec["loss"])  # the held-out loss where the run followed it
        h.observe(Observation(u, rec["phase"], loss, rec["time_s"], rec["time_s"] - prev_time, rec["staleness"]))
        prev_time = rec["time_s"]
        if u + lag < cfg.train.max_steps:
            decided[u + lag] = h.decide(u + lag)
    return {"run": str(run), "steps": len(steps), "divergence": None}


def line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['run']}: not replayed: {r['skipped']}"
    if r["divergence"] is None:
        return f"{r['run']}: the same decisions at all {r['steps']} steps"
    return (f"{r['run']}: diverges at step {r['divergence']} of {r['steps']}: the run ran {r['run_phase']}, the replay "
            f"decides {r['replay_phase']} ({r['decision']['reason'] or 'no reason given'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (a sweep's p*_b*_METHOD_sSEED folders)")
    ap.add_argument("--set", action="append", default=[], metavar="heuristic.KEY=VALUE",
                    help="a heuristic setting to replay with instead of the run's (repeatable)")
    ap.add_argument("--out", type=Path, help="also write the replays as JSON to this file")
    a = ap.parse_args(argv)
    missing = [str(r) for r in a.runs if not r.is_dir()]
    if missing:
        print(f"replay_heuristic: no such run directory: {missing[0]}", file=sys.stderr)
        return 2
    results = []
    for r in a.runs:
        results.append(replay(r, a.set))
        print(line(results[-1]), flush=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
