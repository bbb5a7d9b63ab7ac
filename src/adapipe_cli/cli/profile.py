"""``adapipe profile [key=value ...] [--out FILE]``: measure the cost profile of a run's config and
write it, for runs and sweeps to share with ``pipeline.profile=FILE``.

The overrides are those of ``adapipe train``; the profile is measured as a run measures its own
(:func:`..runtime.profile.measure_profile` on the run's stages and a microbatch of its data), so
every run of the same model, depth, microbatch size, sequence length, optimizer and partition can
use it, on one clock.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .compose import compose_or_fail
from .errors import fail

HELP = """usage: adapipe profile [key=value ...] [--out FILE]

Measures the cost profile (each stage's forward, backward and update seconds) of the run that
`adapipe train` with the same overrides would start, and writes it to FILE (default:
outputs/profiles/MODEL_pP_mbB.json). Reuse it with `adapipe train ... pipeline.profile=FILE`;
measure on an idle machine, with pipeline.threads as the runs will use."""


def _split_out(args: list[str]) -> tuple[list[str], str | None]:
    """The overrides, and the ``--out FILE`` / ``--out=FILE`` among ``args``."""
    rest, out, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a in ("--out", "-o"):
            if i + 1 >= len(args):
                fail("--out needs a file name: adapipe profile ... --out profile.json")
            out, i = args[i + 1], i + 2
            continue
        if a.startswith("--out="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, out


def profile_command(args: list[str]) -> int:
    from ..config import ConfigError
    from ..data import DataError
    from ..schedules.choice import microbatch_size
    from ..sweep.profile import measure_depth_profile

    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return 0
    overrides, out = _split_out(args)
    cfg = compose_or_fail(overrides)
    micro = microbatch_size(cfg)  # (a replica's microbatch)
    path = Path(out or Path("outputs") / "profiles" / f"{cfg.model.name}_p{cfg.pipeline.stages}_mb{micro}.json")
    if path.is_dir():
        fail(f"--out {path} is a directory: name the file, e.g. --out {path / 'profile.json'}")
    try:
        prof = measure_depth_profile(cfg, path)
    except (ConfigError, DataError) as e:
        fail(str(e))
    fb = sum(prof.forward) + sum(prof.backward)
    print(f"profile of {cfg.model.name}, {prof.stages} stages, microbatches of {micro} x {cfg.model.block_size} "
          f"tokens, {cfg.optim.name}: forward+backward {fb * 1e3:.2f} ms per microbatch over all stages, update "
          f"{sum(prof.update) * 1e3:.2f} ms; use it with pipeline.profile={path}", file=sys.stderr)
    print(path)
    return 0
