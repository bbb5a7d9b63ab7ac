"""What a run writes: metrics.jsonl (one record per step, evaluation and event), summary.json,
and, with ``logger=wandb``, the same to Weights & Biases."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..config.validate import ConfigError


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and not isinstance(v, (list, dict)):  # numpy and torch scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    out: list[dict] = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
    return out


def _start_wandb(logger_cfg, config: dict, run_dir: Path):
    """The wandb run, or a ConfigError saying how to log in (wandb raises when it has no API key and
    cannot prompt for one)."""
    import wandb

    mode = logger_cfg.mode or os.environ.get("WANDB_MODE")
    try:
        return wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, name=logger_cfg.run_name,
                          mode=mode, dir=str(run_dir), config=config, reinit=True)
    except Exception as e:  # wandb raises UsageError, CommError, timeouts...
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"logger=wandb could not start ({reason}): run `wandb login` or set WANDB_API_KEY, "
                          f"or log locally with WANDB_MODE=offline (or use logger=none)") from None


class RunLog:
    """Appends records to ``metrics.jsonl`` and mirrors them to wandb when configured."""

    def __init__(self, run_dir: Path, logger_cfg, config: dict, keep_lines: int | None = None):
        """A new ``metrics.jsonl``; or, resuming (``keep_lines``), the first ``keep_lines`` records of
        the existing one, continued (records written after the checkpoint are dropped: the resumed
        run writes them again)."""
        self.dir = Path(run_dir)
        self.path = self.dir / "metrics.jsonl"
        self._wandb = _start_wandb(logger_cfg, config, self.dir) if logger_cfg.name == "wandb" else None
        if logger_cfg.name not in ("none", "wandb"):
            raise ConfigError(f"unknown logger {logger_cfg.name!r}: use none or wandb")
        self.records: list[dict] = read_jsonl(self.path)[:keep_lines] if keep_lines is not None else []
        self._rewrite()
        self._f = open(self.path, "a", buffering=1)

    def write(self, rec: dict) -> None:
        rec = {k: _clean(v) for k, v in rec.items()}
        self.records.append(rec)
        self._f.write(json.dumps(rec) + "\n")
        if self._wandb is not None:
            kind = rec.get("kind", "step")
            data = {f"{kind}/{k}": v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb.log(data, step=rec["step"])

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)

    def truncate(self, n: int, drop=None) -> None:
        """Keep only the first ``n`` records (a rollback), less those for which ``drop(record)`` is
        true (an undone probe's switch)."""
        self._f.close()
        del self.records[n:]
        if drop is not None:
            self.records[:] = [r for r in self.records if not drop(r)]
        self._rewrite()
        self._f = open(self.path, "a", buffering=1)

    def summary(self, data: dict) -> None:
        data = {k: _clean(v) for k, v in data.items()}
        write_json(self.dir / "summary.json", data)
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in data.items() if isinstance(v, (int, float, str, type(None)))})

    def close(self) -> None:
        self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
