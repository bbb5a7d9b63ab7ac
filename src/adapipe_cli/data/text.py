"""Raw text of the text sources, split into train and validation.

Local files are read as they are (UTF-8, newlines kept), never written to. Without a local path,
tinyshakespeare and wikitext come from the Hugging Face Hub through ``datasets``. Every source
ends as a :class:`RawText`: the train text, the validation text, and where they came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from adapipe_cli.data.source import DataError

TEXT_SOURCES = ("text", "tinyshakespeare", "wikitext2", "wikitext103")

# (hf_path, hf_name) used when data.path is not given; data.hf_path / data.hf_name override them.
HUB_DEFAULTS = {
    "tinyshakespeare": ("karpathy/tiny_shakespeare", None),
    "wikitext2": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext103": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
}


@dataclass(frozen=True)
class RawText:
    train: str
    valid: str
    origin: str  # for the logs: which files or Hub dataset, and how it was split


def load_raw_text(cfg) -> RawText:
    """The train and validation text that ``cfg.name`` (one of TEXT_SOURCES) points at."""
    if cfg.name == "text":
        if not cfg.train:
            raise DataError(
                "data=text needs data.train=FILE (and data.valid=FILE, or data.valid_fraction)"
            )
        return from_files(cfg.train, cfg.valid, cfg.valid_fraction)
    if cfg.name == "tinyshakespeare":
        return tinyshakespeare(cfg)
    if cfg.name in ("wikitext2", "wikitext103"):
        return wikitext(cfg)
    raise DataError(
        f"data.name={cfg.name!r} is not a text source; choose one of {', '.join(TEXT_SOURCES)}"
    )


def from_files(train: str, valid: str | None, valid_fraction: float) -> RawText:
    """data.train and data.valid as they are, or data.train split by valid_fraction."""
    train_text = read_text_file(train, "data.train")
    if valid:
        return RawText(train_text, read_text_file(valid, "data.valid"), f"{train} + {valid}")
    head, tail = split_tail(train_text, valid_fraction)
    return RawText(head, tail, f"{train}, last {valid_fraction:g} for validation")


def tinyshakespeare(cfg) -> RawText:
    """data.train=FILE, or data.path=DIR holding input.txt (or =FILE), else the Hub copy; the last
    valid_fraction of the text (0.1: the usual 90/10 split) is validation."""
    if cfg.train:
        return from_files(cfg.train, cfg.valid, cfg.valid_fraction)
    if cfg.path:
        path = Path(cfg.path).expanduser()
        path = path / "input.txt" if path.is_dir() else path
        text = read_text_file(str(path), "data.path", "set data.path=DIR holding input.txt")
        head, tail = split_tail(text, cfg.valid_fraction)
        return RawText(head, tail, f"{path}, last {cfg.valid_fraction:g} for validation")
    hf_path, hf_name = hub_ids(cfg)
    splits = load_hub_splits(hf_path, hf_name, "data.path=DIR holding input.txt")
    # The Hub copy cuts the one file into train/validation/test; glued back it is input.txt.
    whole = "".join(splits[s] for s in ("train", "validation", "test") if s in splits)
    head, tail = split_tail(whole, cfg.valid_fraction)
    return RawText(head, tail, f"hf:{hf_path}, last {cfg.valid_fraction:g} for validation")


def wikitext(cfg) -> RawText:
    """data.path=DIR holding wiki.train.raw and wiki.valid.raw, else the Hub dataset."""
    hint = "data.path=DIR holding wiki.train.raw and wiki.valid.raw"
    if cfg.path:
        folder = Path(cfg.path).expanduser()
        if not folder.is_dir():
            raise DataError(f"data.path={cfg.path}: no such folder; set {hint}")
        if not (folder / "wiki.train.raw").exists():
            raise DataError(f"data.path={cfg.path} has no wiki.train.raw; set {hint}")
        train = read_text_file(str(folder / "wiki.train.raw"), "data.path", f"set {hint}")
        valid = read_text_file(str(folder / "wiki.valid.raw"), "data.path", f"set {hint}")
        return RawText(train, valid, f"{folder}/wiki.{{train,valid}}.raw")
    hf_path, hf_name = hub_ids(cfg)
    splits = load_hub_splits(hf_path, hf_name, hint)
    if "train" not in splits or "validation" not in splits:
        raise DataError(f"hf:{hf_path}/{hf_name} has no train and validation splits; set {hint}")
    return RawText(splits["train"], splits["validation"], f"hf:{hf_path}/{hf_name}")


def read_text_file(path: str, key: str, fix: str | None = None) -> str:
    """The whole file as text, newlines kept; DataError if it is missing, empty or not UTF-8.

    ``key`` names the setting that led here; ``fix`` says what to change if the file is missing."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"{key}: {path} is not a file; {fix or f'point {key} at an existing text file'}"
        )
    try:
        # newline="" keeps \r\n as it is: the text the model sees is the file, byte for byte
        with open(p, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{key}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{key}: cannot read {path} ({e.strerror})") from None
    if not text:
        raise DataError(f"{key}: {path} is empty; point {key} at a file with text in it")
    return text


def split_tail(text: str, valid_fraction: float) -> tuple[str, str]:
    """(text[:cut], text[cut:]) with cut = int(len(text) * (1 - valid_fraction)): the last
    valid_fraction of the characters is validation."""
    if not 0 < valid_fraction < 1:
        raise DataError(
            f"data.valid_fraction={valid_fraction}: must be between 0 and 1 (exclusive)"
        )
    cut = int(len(text) * (1 - valid_fraction))
    return text[:cut], text[cut:]


def hub_ids(cfg) -> tuple[str, str | None]:
    default_path, default_name = HUB_DEFAULTS[cfg.name]
    return cfg.hf_path or default_path, cfg.hf_name or default_name


def load_hub_splits(hf_path: str, hf_name: str | None, hint: str) -> dict[str, str]:
    """Each split of a Hub dataset's ``text`` column, its rows joined: {split: text}.

    Rows are joined with "" because both wikitext (one line per row) and tiny_shakespeare (one
    document per split) keep their newlines inside the rows."""
    label = f"hf:{hf_path}" + (f"/{hf_name}" if hf_name else "")
    if not hub_cached(hf_path):  # fail at once where the Hub cannot answer (datasets retries for ~30 s)
        if hub_offline():
            raise DataError(f"cannot load the Hugging Face dataset {label} (offline mode is on and it is not "
                            f"in the local cache); set {hint}")
        host = hub_unreachable()
        if host:
            raise DataError(f"cannot load the Hugging Face dataset {label} ({host} cannot be reached: offline?); "
                            f"set {hint}")
    import datasets  # slow to import; only needed on this path

    try:
        dd = datasets.load_dataset(hf_path, hf_name)
    except Exception as e:  # network, offline mode, unknown dataset: all mean "use a local copy"
        why = "offline mode is on" if hub_offline() else first_line(e)
        raise DataError(
            f"cannot load the Hugging Face dataset {label} ({why}); set {hint}"
        ) from None
    if any("text" not in split.column_names for split in dd.values()):
        raise DataError(f"{label} has no 'text' column; set {hint}")
    return {name: "".join(split["text"]) for name, split in dd.items()}


def hub_offline() -> bool:
    """HF_DATASETS_OFFLINE or HF_HUB_OFFLINE set to a true value, as the HF libraries read them."""
    flags = (os.environ.get(k, "").upper() for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def hub_cached(hf_path: str) -> bool:
    """Whether a copy of Hub dataset ``hf_path`` may be in the local caches (the datasets cache's
    ``org___name`` or the Hub cache's ``datasets--org--name``), which load in offline mode too."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    hub_cache = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    return (datasets_cache / hf_path.replace("/", "___")).exists() or \
        (hub_cache / f"datasets--{hf_path.replace('/', '--')}").exists()


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """The Hub's host when it cannot be reached within ``timeout_s`` (no network, no DNS), else None."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return host
    return None


def first_line(e: Exception) -> str:
    """A short one-line summary of an exception whose message may span many lines."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__
