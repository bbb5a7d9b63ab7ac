"""``adapipe``: the command line.

    adapipe train [overrides]      one experiment (Hydra; -m for a multirun)
    adapipe simulate [overrides]   time a schedule with the discrete-event simulator
    adapipe profile [overrides]    measure a run's cost profile for runs and sweeps to share
    adapipe sweep sweep=NAME       a grid of experiments and its report
    adapipe report SWEEP_DIR       tables and plots of a finished or partial sweep
"""

from __future__ import annotations

import sys

from .errors import fail

COMMANDS = {
    "train": "run one experiment: adapipe train [key=value ...] (see adapipe train --help)",
    "simulate": "time a schedule's action lists: adapipe simulate schedule=1f1b pipeline.stages=4 ...",
    "profile": "measure a run's cost profile: adapipe profile [key=value ...] [--out FILE]",
    "sweep": "run a grid of experiments: adapipe sweep sweep=smoke [key=value ...]",
    "report": "tables and plots of a sweep: adapipe report SWEEP_DIR",
}


def usage() -> str:
    lines = ["usage: adapipe COMMAND [ARGS]", "",
             "adapipe: synchronous, asynchronous and adaptive (AdaPipe) pipeline-parallel training of GPT models.", "",
             "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Overrides use Hydra syntax: group=option or key=value, e.g. pipeline.stages=4 schedule=pipedream."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns its exit status (errors were reported in one line on stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _dispatch(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from .train import train_command

        return train_command(rest)
    if cmd == "simulate":
        from .simulate import simulate_command

        return simulate_command(rest)
    if cmd == "profile":
        from .profile import profile_command

        return profile_command(rest)
    if cmd == "sweep":
        from .sweep import sweep_command

        return sweep_command(rest)
    if cmd == "report":
        from .report import report_command

        return report_command(rest)
    fail(f"unknown command '{cmd}': use one of {', '.join(COMMANDS)} (adapipe --help)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
