"""``adapipe train``: one experiment, configured by Hydra, in a Hydra run directory."""

from __future__ import annotations

import sys
from pathlib import Path

from .compose import HELP_FLAGS, compose_or_fail
from .errors import fail


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..config import ConfigError
    from ..data import DataError
    from ..train.loop import TrainingDiverged, train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = train(cfg, run_dir)
    except (ConfigError, DataError) as e:
        fail(str(e))
    except TrainingDiverged as e:
        fail(str(e), code=1)
    except KeyboardInterrupt:
        fail(f"interrupted; partial results are in {run_dir}", code=130)
    ttt = summary["time_to_target_s"]
    target = f", time to ppl {summary['target_ppl']:g}: {ttt:.2f}s" if ttt is not None else ""
    print(f"final val ppl {summary['final_val_ppl']:.3f} after {summary['steps']} steps "
          f"({summary['time_s']:.2f}s {summary['clock']} time{target})", file=sys.stderr)
    print(f"results: {run_dir}")


def train_command(overrides: list[str]) -> int:
    import hydra

    from ..config import conf_dir, register_configs

    wants_help = any(a in HELP_FLAGS for a in overrides)
    multirun = any(a in ("-m", "--multirun") for a in overrides)
    if not wants_help and not multirun:
        compose_or_fail([a for a in overrides if not a.startswith("-")])
    register_configs()
    sys.argv = ["adapipe train", *overrides]
    main = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task)
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


__all__ = ["train_command", "fail"]
