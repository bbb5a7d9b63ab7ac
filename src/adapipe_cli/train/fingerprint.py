"""What a resumed run must find unchanged besides its configuration: the data it reads and its clock.

A checkpoint's manifest records SHA-256 fingerprints of

- ``train data``: the training token array of a corpus (so the file, the tokenizer trained on it and
  every setting that shapes it are covered), or the synthetic source's transition table;
- ``validation data``: the validation set's tokens;
- ``cost profile``: the numbers of the pipeline clock's cost profile (its ``meta``, how and where it
  was measured, left out);
- ``profile link``: the link between stages the profile holds (``link``: latency and bandwidth, as a
  dist run measured it; none is a value too), which the profiled clock charges. A fingerprint of its
  own, so that a checkpoint written before it was recorded still resumes.

So a file may move (``data.path``, ``data.train``, ``data.valid`` and ``pipeline.profile`` are free
keys when the checkpoint has fingerprints) but not change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np
import torch

from ..simulator.clock import LinkModel

TRAIN, VALID, PROFILE, LINK = "train data", "validation data", "cost profile", "profile link"


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def data_fingerprints(data) -> dict[str, str]:
    """{train data, validation data: SHA-256} of a data source (see the module's docstring)."""
    tokens = getattr(data, "train_tokens", None)
    if tokens is not None:
        train = _sha(tokens)
    elif hasattr(data, "successors"):  # the synthetic Markov source: its table is the whole corpus
        train = _sha(data.successors, data.probs)
    else:  # a source of another kind: its first batches at least
        train = _sha(*data.train_batch(0, 8))
    valid = _sha(*(x for batch in data.val_batches(64) for x in batch))
    return {TRAIN: train, VALID: valid}


# cost entries added after profiles were first fingerprinted: all zero or empty (a profile
# measured before them) they change no number, and leaving them out keeps such a profile's old
# fingerprint (``held``, the in-flight table, and ``signal``, the held-out signal's costs: empty)
LATER_ENTRIES = ("accumulate", "data", "held", "signal")


def _all_zero(v) -> bool:
    if isinstance(v, dict):
        return not v
    return all(_all_zero(x) for x in v) if isinstance(v, (list, tuple)) else v == 0


def profile_fingerprint(profile) -> str:
    """SHA-256 of a cost profile's numbers (every field but ``meta`` and ``link``, which has its own:
    :func:`link_fingerprint`; and the later entries ``accumulate`` and ``data`` where they are all
    zero, and ``held`` and ``signal`` where they are empty, as in a profile measured before them, so that its runs'
    checkpoints still resume)."""
    numbers = {k: v for k, v in asdict(profile).items()
               if k not in ("meta", "link") and not (k in LATER_ENTRIES and _all_zero(v))}
    return hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()


def link_fingerprint(profile, configured: bool = False) -> str:
    """SHA-256 of the link a cost profile holds (``{}`` when it holds none); of a constant when a
    link is configured (``pipeline.link_latency_s`` or ``pipeline.link_bandwidth``), which the clock
    charges instead (a configured key itself is compared with the configuration)."""
    link = {"configured": True} if configured else (profile.link or {})
    return hashlib.sha256(json.dumps(link, sort_keys=True).encode()).hexdigest()


def link_configured(cfg) -> bool:
    """Whether the run's configuration sets the link, so that the profile's is not used
    (:meth:`.LinkModel.configured`, the rule :meth:`.LinkModel.choose` follows)."""
    return LinkModel.configured(cfg.pipeline.link_latency_s, cfg.pipeline.link_bandwidth)


def profile_fingerprints(profile, configured_link: bool = False) -> dict[str, str]:
    """{cost profile, profile link: SHA-256} of the run's cost profile."""
    return {PROFILE: profile_fingerprint(profile), LINK: link_fingerprint(profile, configured_link)}


def first_change(saved: dict, now: dict) -> str | None:
    """The first fingerprint that ``saved`` (a manifest's) has and ``now`` differs in, or None."""
    return next((k for k in (TRAIN, VALID, PROFILE, LINK) if k in saved and k in now and saved[k] != now[k]), None)


def where(cfg, kind: str) -> str:
    """The config keys that gave ``kind``, for the user's line: ``data.train=FILE``, ``pipeline.profile=FILE``."""
    d = cfg.data
    if kind in (PROFILE, LINK):
        return f"pipeline.profile={cfg.pipeline.profile}" if cfg.pipeline.profile else "the run's profile.json"
    key = "train" if kind == TRAIN else "valid"
    if d.get(key):
        return f"data.{key}={d[key]}"
    if d.get("path"):
        return f"data.path={d.path}"
    return f"data={d.name}"


def refusal(cfg, folder, manifest: dict, now: dict) -> str | None:
    """One line refusing to resume the checkpoint in ``folder`` when what it was trained on (its
    manifest's fingerprints) differs from ``now``; None when nothing recorded changed."""
    changed = first_change(manifest.get("fingerprints") or {}, now)
    if changed is None:
        return None
    if changed in (PROFILE, LINK):
        what = "cost profile" if changed == PROFILE else "link between stages (latency, bandwidth) in the cost profile"
        return (f"checkpoint {folder} ran on another clock: the {what} of {where(cfg, changed)} differs from "
                f"the checkpoint's; resume with the profile the run used (its profile.json)")
    return (f"checkpoint {folder} was trained on other data: the {changed} of {where(cfg, changed)} differs from "
            f"the checkpoint's (a file may move, not change)")
