"""On-disk cache of a trained tokenizer and the token arrays it made.

An entry is a folder named by a hash of what determines it: the train and validation text (so the
input files' contents and the split rule) and the vocabulary size. It is written whole into a
temporary folder and renamed into place, so a reader sees a complete entry or none, even while
several processes (pipeline stages) build the same entry at once. Input files are never written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from adapipe_cli.data.source import DataError

FORMAT = "adapipe-bpe-v1"  # bump when the tokenizer recipe or the file layout changes
FILES = ("tokenizer.json", "train.npy", "valid.npy", "meta.json")


@dataclass
class Entry:
    tokenizer: Tokenizer
    train: np.ndarray  # token ids, memory-mapped read-only
    valid: np.ndarray
    path: Path


def cache_root(cache_dir: str | None) -> Path:
    """data.cache_dir, else $ADAPIPE_CACHE, else ~/.cache/adapipe."""
    root = cache_dir or os.environ.get("ADAPIPE_CACHE") or "~/.cache/adapipe"
    return Path(root).expanduser()


def entry_key(train: str, valid: str, vocab_size: int) -> str:
    """sha256 of (format, vocab_size, train text, valid text); lengths delimit the two texts."""
    h = hashlib.sha256()
    for part in (FORMAT, str(vocab_size), str(len(train)), train, str(len(valid)), valid):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def entry_path(root: Path, key: str, vocab_size: int) -> Path:
    return root / "bpe" / f"v{vocab_size}-{key[:24]}"


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES)


def load(path: Path) -> Entry | None:
    """The entry at path, or None when it is absent or incomplete."""
    if not is_complete(path):
        return None
    return Entry(
        tokenizer=Tokenizer.from_file(str(path / "tokenizer.json")),
        train=np.load(path / "train.npy", mmap_mode="r"),
        valid=np.load(path / "valid.npy", mmap_mode="r"),
        path=path,
    )


def store(
    path: Path, tokenizer: Tokenizer, train: np.ndarray, valid: np.ndarray, meta: dict
) -> Entry:
    """Write the entry to a temporary folder next to ``path`` and rename it into place.

    If another process got there first its entry is kept and ours dropped: both were built from
    the same inputs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry may be shared like any cache
    except OSError as e:
        raise DataError(
            f"cannot write the token cache under {path.parent} ({e.strerror}); "
            "set data.cache_dir or $ADAPIPE_CACHE to a writable folder"
        ) from None
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        np.save(tmp / "train.npy", train)
        np.save(tmp / "valid.npy", valid)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        publish(tmp, path)
    except OSError as e:
        raise DataError(
            f"cannot write the token cache entry {path} ({e.strerror or e}); "
            "free some space or set data.cache_dir"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    entry = load(path)
    assert entry is not None, f"token cache entry {path} vanished after it was written"
    return entry


def publish(tmp: Path, path: Path) -> None:
    """Rename tmp to path atomically; replace an incomplete leftover, keep a complete one."""
    try:
        os.rename(tmp, path)
    except OSError:
        if is_complete(path):  # a concurrent builder won the race
            return
        shutil.rmtree(path, ignore_errors=True)  # a broken entry (e.g. a file deleted by hand)
        os.rename(tmp, path)
