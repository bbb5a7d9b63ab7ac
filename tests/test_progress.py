"""What a run prints while it trains, off a terminal, and its copy in run.log."""

from __future__ import annotations

from types import SimpleNamespace

from adapipe_cli.cli.main import main
from adapipe_cli.train import progress
from adapipe_cli.train.progress import Console, Progress
from conftest import TINY, fixed_clock


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _steps(p: Progress, clock: Clock, n: int, dt: float) -> None:
    for step in range(n):
        clock.t += dt
        p.update(SimpleNamespace(step=step, loss=2.0, phase="sync"), {"val_ppl": 7.0} if step == 1 else None, 1000.0)


def test_off_a_terminal_a_plain_line_every_few_seconds(tmp_path, capsys):
    clock = Clock()
    p = Progress(10, "auto", Console(tmp_path), every_s=5.0, clock=clock)  # (pytest's stderr is no terminal)
    _steps(p, clock, 10, 2.0)  # 20 s: lines after steps 3, 6 and 9 (6, 12 and 18 s)
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert err == ["adapipe: step 3/10 (30%) loss 2.000 val ppl 7.00 phase sync 1,000 tok/s, 6 s",
                   "adapipe: step 6/10 (60%) loss 2.000 val ppl 7.00 phase sync 1,000 tok/s, 12 s",
                   "adapipe: step 9/10 (90%) loss 2.000 val ppl 7.00 phase sync 1,000 tok/s, 18 s"]
    assert (tmp_path / "run.log").read_text().splitlines() == err


def test_progress_off_prints_nothing_but_keeps_the_log(tmp_path, capsys):
    clock = Clock()
    p = Progress(4, "off", Console(tmp_path), every_s=1.0, clock=clock)
    _steps(p, clock, 4, 2.0)
    p.close()
    assert capsys.readouterr().err == ""
    assert len((tmp_path / "run.log").read_text().splitlines()) == 4


def test_run_log_is_what_stderr_showed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)  # a progress line after every step
    d = tmp_path / "run"
    # (a given profile: the run measures none; what it prints is the same)
    assert main(["train", *TINY, "train.progress=auto", "schedule=adapipe", "heuristic=fixed",
                 "heuristic.plan=[[sync,4],[async,null]]", fixed_clock(tmp_path), f"hydra.run.dir={d}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == (d / "run.log").read_text().splitlines()
    assert err[0].startswith("adapipe: runtime=local") and err[-1].startswith("final val ppl")
    assert "adapipe: switch sync -> async at step 4 (plan: async from step 4)" in err
    assert [line.split()[2] for line in err if " tok/s, " in line] == [f"{k}/12" for k in range(1, 13)]
