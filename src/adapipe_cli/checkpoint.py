"""Checkpoints on disk: written atomically, verified when read, the last few kept.

Layout: ``RUN_DIR/checkpoints/step-0000123/`` holds one file per part (``trainer.pt``, and the
pipeline's state: ``pipeline.pt`` from the local runtime, or ``stage-S.pt`` from each worker of
the distributed one) and ``manifest.json``, written last, with every part's size and SHA-256. A
checkpoint is built in a hidden temporary folder and renamed into place only once complete, so a
crash at any moment leaves either no new checkpoint or a complete one. A checkpoint of a step
written again (a resumed or rolled-back run passing it once more) replaces the old one by two
renames, the old folder moved aside first: a crash between them leaves the old checkpoint, which is
still listed and resumed from. Reading verifies the manifest and every hash; a damaged checkpoint
is reported and the previous one is used instead.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path

import torch

from .adaptive.gain import prior_probe_se
from .config import RETIRED_DEFAULTS, RETIRED_KEYS

MANIFEST = "manifest.json"
PREFIX = "step-"
REPLACED = ".replaced-"  # a checkpoint moved aside while a new one of its step takes its place

# keys that may differ between a checkpoint and the run that resumes it: none of them changes the
# numbers a run produces
# (not ``pipeline.runtime``: the two runtimes cut the pipeline at different points and store it in
# different parts, ``pipeline`` vs ``stage-S``, so a checkpoint resumes on the runtime that wrote it;
# not ``pipeline.threads``: some CPU kernels split their reductions by thread, so float results can
# differ with the thread count)
FREE_KEYS = {
    "train.max_time_s", "train.target_ppl", "train.stop_at_target", "train.checkpoint_every",
    "train.keep_checkpoints", "train.save_final", "train.resume", "train.progress",
    "pipeline.timeout_s", "pipeline.order", "pipeline.backend",
    "pipeline.devices", "pipeline.profile_reps", "data.cache_dir",
    # the local runtime's device: a GPU run may go on on the CPU and back (its rounding changes,
    # like another thread count's, but moving a run is what the key is for)
    "pipeline.device",
}
# keys newer than some checkpoints, with the value that keeps what a run did before they existed
# (gain's prior_logit_sd and probe_se: their defaults, which only price a first probe; a resumed
# gain run restores its belief and its next probe; gain's delay_drift: a checkpoint from before it
# held the retired heuristic.drift, and resumes under the new drift if that was at its default,
# :data:`RETIRED_DEFAULTS`; gain's delay_trend and drift_taper_kd: a gain run from before them had
# none, and goes on with the default trend and taper, as with the drift, which changes its numbers
# from there where the delay's k d exceeds 1.35; or with drift_taper_kd=null, as it ran): a
# checkpoint without the key resumes when the run leaves it there
SINCE = {"pipeline.replicas": 1, "pipeline.dp_bandwidth": 0.0, "pipeline.dp_latency_s": 0.0, "schedule.chunks": 1,
         "heuristic.delay_drift": 0.37, "heuristic.delay_trend": 0.24, "heuristic.drift_taper_kd": [1.35, 3.15],
         "heuristic.prior_logit_sd": 1.0,
         "heuristic.probe_se": 0.5}
# keys whose default changed: (the default before, since when); a checkpoint holding the old one
# is refused with the override that resumes it
CHANGED_DEFAULTS = {"heuristic.signal": ("heldout", "2026-12-04"), "heuristic.probe_se": (0.5, "2026-12-05")}
# where the data and the cost profile are read from: free when the checkpoint records fingerprints
# of what they held (see :mod:`.fingerprint`), so that a file may move but not change
LOCATION_KEYS = {"data.path", "data.train", "data.valid", "pipeline.profile"}


def free_keys(manifest: dict) -> set[str]:
    """The keys a resume of the checkpoint with ``manifest`` may change."""
    return FREE_KEYS | LOCATION_KEYS if manifest.get("fingerprints") else FREE_KEYS


def resume_free_keys(manifest: dict, current: dict) -> set[str]:
    """:func:`free_keys`, and ``train.max_steps`` where a run may be continued for more (or fewer)
    steps: a synchronous schedule (every step ends with a flush, so the state after a step does not
    depend on the run's length) with a learning rate constant after warm-up (``optim.decay=constant``
    in both configs; a cosine decay spans max_steps)."""
    saved = manifest["config"]
    sync = current["schedule"]["name"] in ("1f1b", "gpipe")
    constant = saved["optim"]["decay"] == current["optim"]["decay"] == "constant"
    runtime = manifest.get("runtime", "local")
    clocks = {clock_of(c["pipeline"].get("clock", "auto"), runtime) for c in (saved, current)}
    # gain's probe_se prices only gain's probes: free for every other run (whose checkpoints from
    # before 2026-12-05 hold its old default, 0.5), and for a gain run whose null now means the
    # value it holds (0.5 on the held-out signal)
    gain = all(c["schedule"]["name"] == "adapipe" and c["heuristic"]["name"] == "gain" for c in (saved, current))
    h_saved, h_now = saved["heuristic"], current["heuristic"]
    same_se = (h_now.get("probe_se") is None and h_saved.get("signal") == h_now.get("signal")
               and h_saved.get("probe_se") == prior_probe_se(h_now))
    return (free_keys(manifest) | ({"train.max_steps"} if sync and constant else set())
            | ({"pipeline.clock"} if len(clocks) == 1 else set())
            | (set() if gain and not same_se else {"heuristic.probe_se"}))


# the clock of pipeline.clock=auto on each runtime (a run written before auto existed says profiled)
DEFAULT_CLOCK = {"local": "profiled", "dist": "wall"}


def clock_of(clock: str, runtime: str) -> str:
    """The clock a run's time is on: ``pipeline.clock``, ``auto`` resolved for ``runtime``."""
    return DEFAULT_CLOCK[runtime] if clock == "auto" else clock


def stage_part(stage: int, replica: int = 0) -> str:
    """The name of a distributed run's part holding stage ``stage``'s state (of replica
    ``replica`` > 0 with ``pipeline.replicas``: each worker writes its whole own state)."""
    return f"stage-{stage}" if replica == 0 else f"replica-{replica}-stage-{stage}"


def due(train, steps: int, start: int) -> bool:
    """Whether the training loop writes a checkpoint after ``steps`` steps (``start``: the step a
    resumed session started at, whose checkpoint exists already). :meth:`Trainer.run` decides by it,
    and so do the workers of a distributed run, to know in advance at which gates to write their parts."""
    return bool(train.checkpoint_every) and steps > start and steps % train.checkpoint_every == 0


def due_at_end(train, steps: int) -> bool:
    """Whether a run that ends after ``steps`` steps writes its final checkpoint then (``save_final``
    and not written already by :func:`due`), for :meth:`Trainer.run` and the workers alike."""
    return bool(train.save_final) and not (train.checkpoint_every and steps % train.checkpoint_every == 0)


def finite(params) -> bool:
    """Whether every tensor of ``params`` is finite: no checkpoint is written from diverged weights."""
    return all(bool(torch.isfinite(p).all()) for p in params)


def refusal(steps: int, stage: int, replica: int | None = None) -> str:
    """Why a checkpoint after ``steps`` steps is not written: ``stage``'s weights (of ``replica``'s
    pipeline, when there are replicas) are not finite."""
    of = "" if replica is None else f" of replica {replica}"
    return f"refusing to write a checkpoint at step {steps}: stage {stage}{of} has non-finite weights (training diverged)"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not belong to this run; one line for the user."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _test_delay() -> None:
    """Tests that kill a run while it writes a checkpoint widen the window with
    ``ADAPIPE_TEST_CHECKPOINT_DELAY`` (seconds, in the middle of every part)."""
    delay = os.environ.get("ADAPIPE_TEST_CHECKPOINT_DELAY")
    if delay:
        time.sleep(float(delay))


def begin(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of ``step``."""
    tmp = root(run_dir) / f".tmp-{PREFIX}{step:07d}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir(parents=True)
    return tmp


def write_part(folder: Path, name: str, obj) -> dict:
    """Serialise ``obj`` to ``folder/name.pt``; returns its manifest entry (size, SHA-256)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    path = folder / f"{name}.pt"
    with open(path, "wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        _test_delay()
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(run_dir: Path, folder: Path, step: int, parts: dict[str, dict], meta: dict, keep: int) -> Path:
    """Write the manifest last, rename the folder into place, drop all but the newest ``keep``."""
    manifest = {"step": step, "parts": parts, "created": time.time(), **meta}
    with open(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    final = root(run_dir) / f"{PREFIX}{step:07d}"
    aside = None
    if final.exists():  # the same step written again (a resumed or rolled-back run passing it once more)
        aside = root(run_dir) / f"{REPLACED}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)  # (until the next rename, complete() lists it under its own name)
    os.rename(folder, final)
    _fsync_dir(root(run_dir))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for old in complete(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _step_name(aside: Path) -> str:
    """The name a checkpoint moved aside by :func:`commit` had (``step-0000123``; its name is that,
    the pid and a timestamp)."""
    return aside.name[len(REPLACED):].rsplit("-", 2)[0]


def complete(run_dir: Path) -> list[Path]:
    """Checkpoint folders with a manifest, oldest first (the manifest's presence is only a claim;
    :func:`load_latest` verifies it)."""
    r = root(run_dir)
    if not r.is_dir():
        return []
    entries = [p for p in r.iterdir() if (p / MANIFEST).is_file()]  # (one listing: a rename between two would hide a step)
    found = {p.name: p for p in entries if p.name.startswith(PREFIX)}
    for p in entries:  # one moved aside whose replacement never arrived stands for its step
        if p.name.startswith(REPLACED):
            found.setdefault(_step_name(p), p)
    return [found[name] for name in sorted(found)]


def clean_partial(run_dir: Path) -> None:
    """Remove temporary folders left by an interrupted write, and put back a checkpoint moved aside
    whose replacement never arrived (one whose replacement did is removed)."""
    r = root(run_dir)
    if r.is_dir():
        for p in sorted(r.iterdir()):
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(REPLACED):
                step = r / _step_name(p)
                if (p / MANIFEST).is_file() and not (step / MANIFEST).is_file():
                    shutil.rmtree(step, ignore_errors=True)  # (a folder without a manifest)
                    os.rename(p, step)
                else:
                    shutil.rmtree(p, ignore_errors=True)
        _fsync_dir(r)


def verify(folder: Path) -> dict:
    """The manifest of ``folder`` after checking every part's size and hash (raises otherwise)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, entry in manifest["parts"].items():
        data = (folder / entry["file"]).read_bytes()
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"part {name} is damaged ({len(data)} of {entry['bytes']} bytes, or a different hash)")
    return manifest


def read_part(folder: Path, manifest: dict, name: str):
    """A part's objects, loaded onto the CPU wherever they were saved (a GPU run's checkpoint loads
    on a machine without one; the runtime moves its state to its own device)."""
    return torch.load(folder / manifest["parts"][name]["file"], map_location="cpu", weights_only=False)


def load_latest(run_dir: Path, warn=print) -> tuple[Path, dict]:
    """The newest checkpoint that verifies, as (folder, manifest); damaged ones are reported with
    ``warn`` and skipped."""
    for folder in reversed(complete(run_dir)):
        if folder.name.startswith(REPLACED) and not folder.exists():  # put back meanwhile by clean_partial
            folder = root(run_dir) / _step_name(folder)                # (another process of the same run)
        try:
            return folder, verify(folder)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            warn(f"adapipe: checkpoint {folder.name} is unusable ({e}); falling back to the previous one")
    raise CheckpointError(f"no complete checkpoint in {root(run_dir)}: nothing to resume")


def config_differences(saved: dict, current: dict, free: set[str] = FREE_KEYS) -> list[str]:
    """Keys (dotted) whose values differ between two resolved configs, except the ``free`` ones
    (:func:`free_keys` of the checkpoint's manifest)."""
    out = []
    missing = object()  # (a key one config lacks, unlike one it holds as null)

    def walk(a, b, prefix):
        keys = set(a) | set(b) if isinstance(a, dict) and isinstance(b, dict) else None
        if keys is None:
            if b is missing and prefix in RETIRED_KEYS:  # (held by the checkpoint, gone now)
                if prefix in RETIRED_DEFAULTS and a != RETIRED_DEFAULTS[prefix]:
                    out.append(f"{prefix}={a!r} in the checkpoint, a key retired since: {RETIRED_KEYS[prefix]}")
                return
            if a is missing and prefix in SINCE and b == SINCE[prefix]:
                return
            a, b = (None if x is missing else x for x in (a, b))
            if a != b and prefix not in free:
                old = CHANGED_DEFAULTS.get(prefix)
                hint = (f" (the default until {old[1]}: resume with {prefix}={a})" if old and a == old[0] else "")
                out.append(f"{prefix}={a!r} in the checkpoint, {b!r} now{hint}")
            return
        for k in sorted(keys):
            walk(a.get(k, missing), b.get(k, missing), f"{prefix}.{k}" if prefix else k)

    walk(saved, current, "")
    return out
