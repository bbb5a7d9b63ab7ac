"""Data sources: the synthetic source's entropy rate, seeded batches, the BPE cache, user errors."""

import dataclasses
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from adapipe_cli.config.schema import DataConfig
from adapipe_cli.data import DataError, MarkovSource, build_data, cache, corpus
from adapipe_cli.data.synthetic import stationary_distribution
from adapipe_cli.data.text import split_tail

from conftest import shared_data_dir  # noqa: E402

SHARED = shared_data_dir()
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
WIKI = SHARED / "wikitext-2-raw"
CONF = Path(__file__).resolve().parents[1] / "conf" / "data"
SEQ = 32

needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.exists(), reason="no tinyshakespeare copy")
needs_wiki = pytest.mark.skipif(not (WIKI / "wiki.test.raw").exists(), reason="no wikitext-2 copy")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Never reach the network, nor write caches outside tmp_path. The flags are also set on the
    modules, which read the environment once, at import (maybe by another test module)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ADAPIPE_CACHE", str(tmp_path / "default-cache"))
    for module in ("datasets.config", "huggingface_hub.constants"):
        monkeypatch.setattr(importlib.import_module(module), "HF_HUB_OFFLINE", True)


def text_cfg(tmp_path, **kw) -> DataConfig:
    kw.setdefault("vocab_size", 512)
    kw.setdefault("eval_tokens", 256)
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def write(tmp_path, name, text) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- synthetic -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def markov():
    return build_data(DataConfig(eval_tokens=1000), SEQ, seed=0)


def test_synthetic_entropy_rate_matches_a_long_sample(markov):
    # 60,000 tokens as 100 stationary rows of 600: the walk steps every row at once, so this is 600
    # steps of it, not the 60,000 of one long row (4-7 s); the same number of tokens, so the same
    # noise against the 2% (sd 0.3% over seeds, as one row's); one row is the validation stream
    sample = markov.sample_rows(100, 600, torch.Generator().manual_seed(5))
    measured = -markov.log_prob(sample)
    assert measured == pytest.approx(markov.entropy_rate, rel=0.02)
    assert markov.min_ppl == pytest.approx(math.exp(markov.entropy_rate), rel=1e-12)
    assert 1.0 < markov.min_ppl < markov.branching  # exp(H(P(.|s))) <= the successors per state
    assert "min ppl" in markov.describe()


def test_synthetic_order1_entropy_rate():
    src = MarkovSource(
        vocab_size=64, order=1, branching=8, concentration=1.0, seq_len=SEQ, eval_tokens=64
    )
    rows = src.sample_rows(64, 600, torch.Generator().manual_seed(1))  # 64 stationary rows
    assert -src.log_prob(rows) == pytest.approx(src.entropy_rate, rel=0.02)


def test_stationary_distribution_is_fixed_by_the_chain(markov):
    pi = markov.pi
    moved = np.bincount(markov.next_states().ravel(), (pi[:, None] * markov.probs).ravel(), len(pi))
    assert pi.sum() == pytest.approx(1.0)
    assert np.abs(moved - pi).sum() < 1e-9


def test_stationary_distribution_of_a_periodic_chain():
    # a 3-cycle: plain power iteration would rotate forever; the lazy chain converges
    nxt = np.array([[1], [2], [0]])
    pi = stationary_distribution(nxt, np.ones((3, 1)))
    assert np.allclose(pi, 1 / 3)


def test_successors_are_distinct_and_probabilities_normalised(markov):
    s = np.sort(markov.successors, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    assert np.allclose(markov.probs.sum(axis=1), 1.0)


def test_synthetic_structure_depends_on_source_seed_only():
    a = build_data(DataConfig(vocab_size=32, eval_tokens=128), SEQ, seed=0)
    b = build_data(DataConfig(vocab_size=32, eval_tokens=128), SEQ, seed=1)
    c = build_data(DataConfig(vocab_size=32, eval_tokens=128, source_seed=7), SEQ, seed=0)
    assert a.entropy_rate == b.entropy_rate != c.entropy_rate
    assert same_batches(a.val_batches(4), b.val_batches(4))
    assert not torch.equal(a.train_batch(0, 4)[0], b.train_batch(0, 4)[0])


def test_synthetic_bad_parameters():
    for kw in (
        {"order": 3},
        {"branching": 0},
        {"branching": 300},
        {"concentration": 0.0},
        {"vocab_size": 1},
    ):
        with pytest.raises(DataError, match="data\\."):
            build_data(DataConfig(**kw), SEQ, seed=0)


# -- batches (both kinds of source) ---------------------------------------------------------------


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


def check_train_batches(build):
    """build(seed) -> a fresh source, as another process (or a resumed run) would make it."""
    src = build(0)
    x, y = src.train_batch(7, 5)
    assert x.shape == y.shape == (5, SEQ) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert 0 <= int(x.min()) and int(x.max()) < src.vocab_size

    other = build(0)
    for step in range(7):  # the other "process" walks steps 0..6 first: step 7 must not care
        other.train_batch(step, 5)
    assert same_batches([src.train_batch(7, 5)], [other.train_batch(7, 5)])
    assert not torch.equal(x, src.train_batch(8, 5)[0])
    assert not torch.equal(x, build(1).train_batch(7, 5)[0])


def check_val_batches(build, eval_tokens):
    a, b = build(0), build(1)
    batches = a.val_batches(3)
    assert same_batches(batches, a.val_batches(3)) and same_batches(batches, b.val_batches(3))
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert all(len(bx) <= 3 for bx, _ in batches)
    assert y.numel() == max(1, eval_tokens // SEQ) * SEQ
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1:, 0], y[:-1, -1])  # consecutive windows: targets tile the stream


# a Python that imports torch (5 s on 2 busy cores); fast: the dist runs of tests/test_dist.py, whose
# workers (other processes) build their batches and must give the local run's losses bitwise, and
# check_train_batches below (a fresh source gives the same batch whatever it drew before)
@pytest.mark.slow
def test_train_batch_is_the_same_in_another_process():
    code = (
        "from adapipe_cli.config.schema import DataConfig\n"
        "from adapipe_cli.data import build_data\n"
        f"src = build_data(DataConfig(vocab_size=64, eval_tokens=64), {SEQ}, 3)\n"
        "print(src.train_batch(7, 4)[0].tolist())\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    here = build_data(DataConfig(vocab_size=64, eval_tokens=64), SEQ, 3).train_batch(7, 4)[0]
    assert out.strip() == str(here.tolist())


def test_synthetic_batches():
    cfg = DataConfig(vocab_size=64, eval_tokens=300)
    check_train_batches(lambda seed: build_data(cfg, SEQ, seed))
    check_val_batches(lambda seed: build_data(cfg, SEQ, seed), 300)


# -- text sources ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bpe-cache")


@pytest.fixture(scope="module")
def shakespeare_text(tmp_path_factory):
    """The first 4000 lines of tinyshakespeare (100 KB of its 1.1 MB), in a folder of their own as
    input.txt: the real text, which a tokenizer learns and encodes in a tenth of the time of the
    whole file (2.5 s on a quiet core)."""
    if not SHAKESPEARE.exists():
        pytest.skip("no tinyshakespeare copy")
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    path = tmp_path_factory.mktemp("tinyshakespeare") / "input.txt"
    path.write_text("".join(lines[:4000]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def shakespeare(shakespeare_cache, shakespeare_text):
    cfg = DataConfig(
        name="tinyshakespeare",
        path=str(shakespeare_text.parent),
        vocab_size=512,
        eval_tokens=256,
        cache_dir=str(shakespeare_cache),
    )
    return cfg, build_data(cfg, SEQ, seed=0)


@needs_shakespeare
def test_tinyshakespeare_round_trip_and_split(shakespeare, shakespeare_text):
    _, src = shakespeare
    text = shakespeare_text.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    assert 256 < src.vocab_size <= 512
    assert src.min_ppl is None
    snippet = text[1000:1600]
    assert src.decode(src.encode(snippet)) == snippet
    assert src.decode(src.valid_tokens) == text[cut:]  # the last 10% is validation, losslessly
    assert src.decode(src.train_tokens) == text[:cut]
    assert src.train_tokens.dtype == np.uint16


@needs_shakespeare
def test_tinyshakespeare_cache_is_reused(shakespeare, shakespeare_cache, monkeypatch):
    cfg, first = shakespeare
    entries = list((shakespeare_cache / "bpe").iterdir())
    assert [e.name for e in entries] == [first.cache_path.name]  # one entry, no temp folders left
    assert sorted(p.name for p in entries[0].iterdir()) == sorted(cache.FILES)

    def no_training(*_):
        raise AssertionError("the tokenizer was trained again instead of read from the cache")

    monkeypatch.setattr(corpus, "train_bpe", no_training)
    again = build_data(cfg, SEQ, seed=0)
    assert np.array_equal(again.train_tokens, first.train_tokens)
    assert same_batches(again.val_batches(4), first.val_batches(4))

    # another vocabulary size is another entry
    with pytest.raises(AssertionError, match="trained again"):
        build_data(dataclasses.replace(cfg, vocab_size=300), SEQ, 0)


@needs_shakespeare
def test_text_batches(shakespeare):
    cfg, _ = shakespeare
    check_train_batches(lambda seed: build_data(cfg, SEQ, seed))
    check_val_batches(lambda seed: build_data(cfg, SEQ, seed), cfg.eval_tokens)


@needs_shakespeare
def test_val_windows_are_the_start_of_the_validation_text(shakespeare):
    _, src = shakespeare
    [(x, y)] = src.val_batches(batch_size=1000)
    stream = torch.cat([x.flatten(), y[-1, -1:]])  # the inputs in order, then the last target
    assert torch.equal(stream, torch.from_numpy(src.valid_tokens[: len(stream)].astype(np.int64)))


def test_text_valid_fraction_split(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(400))
    head, tail = split_tail(text, 0.25)
    assert head + tail == text and len(head) == int(len(text) * 0.75)

    src = build_data(
        text_cfg(tmp_path, name="text", train=write(tmp_path, "a.txt", text), valid_fraction=0.25),
        SEQ,
        0,
    )
    assert src.decode(src.train_tokens) == head and src.decode(src.valid_tokens) == tail


def test_text_with_a_validation_file(tmp_path):
    train, valid = "to be or not to be\n" * 300, "that is the question\n" * 40
    cfg = text_cfg(
        tmp_path,
        name="text",
        train=write(tmp_path, "t.txt", train),
        valid=write(tmp_path, "v.txt", valid),
    )
    src = build_data(cfg, SEQ, 0)
    assert src.decode(src.valid_tokens) == valid
    beside_inputs = sorted(p.name for p in tmp_path.iterdir())
    assert beside_inputs == ["cache", "t.txt", "v.txt"]  # the cache went to data.cache_dir only


@needs_wiki
def test_wikitext_from_a_local_folder(tmp_path):
    folder = tmp_path / "wikitext-2"
    folder.mkdir()
    # there is no wiki.train.raw to test with: stand the valid and test splits in for train, valid;
    # their first 400 lines (130 KB each: real wikitext, headings and @-@ escapes), which a
    # tokenizer learns and encodes in a tenth of the time of the whole files (3-6 s)
    for name, split in (("wiki.train.raw", "wiki.valid.raw"), ("wiki.valid.raw", "wiki.test.raw")):
        lines = (WIKI / split).read_text(encoding="utf-8").splitlines(keepends=True)
        (folder / name).write_text("".join(lines[:400]), encoding="utf-8")
    src = build_data(text_cfg(tmp_path, name="wikitext2", path=str(folder)), SEQ, 0)
    assert src.name == "wikitext2"
    assert src.decode(src.valid_tokens) == (folder / "wiki.valid.raw").read_text(encoding="utf-8")
    x, y = src.train_batch(0, 2)
    assert x.shape == (2, SEQ)


# -- user errors ----------------------------------------------------------------------------------


def test_unknown_name(tmp_path):
    with pytest.raises(DataError, match="choose one of synthetic, text"):
        build_data(text_cfg(tmp_path, name="imagenet"), SEQ, 0)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="data.train: .* is not a file"):
        build_data(text_cfg(tmp_path, name="text", train=str(tmp_path / "nope.txt")), SEQ, 0)
    with pytest.raises(DataError, match="is empty"):
        build_data(text_cfg(tmp_path, name="text", train=write(tmp_path, "e.txt", "")), SEQ, 0)
    train = write(tmp_path, "t.txt", "x" * 999)
    with pytest.raises(DataError, match="data.valid: .* is not a file"):
        build_data(text_cfg(tmp_path, name="text", train=train, valid="/nope"), SEQ, 0)
    with pytest.raises(DataError, match="needs data.train"):
        build_data(text_cfg(tmp_path, name="text"), SEQ, 0)


def test_text_shorter_than_one_sequence(tmp_path):
    short, long = (
        write(tmp_path, "short.txt", "hello world\n"),
        write(tmp_path, "long.txt", "ab" * 99),
    )
    bytes_only = {"name": "text", "vocab_size": 256}  # no merges: one token per byte
    with pytest.raises(DataError, match="train text is 12 tokens, less than one sequence of seq_"):
        build_data(text_cfg(tmp_path, train=short, valid=long, **bytes_only), SEQ, 0)
    with pytest.raises(DataError, match="validation text is 12 tokens.*smaller model.block_size"):
        build_data(text_cfg(tmp_path, train=long, valid=short, **bytes_only), SEQ, 0)


def test_wikitext_folder_without_train_file(tmp_path):
    (tmp_path / "wiki.valid.raw").write_text("a valid split\n")
    with pytest.raises(DataError, match="has no wiki.train.raw; set data.path=DIR"):
        build_data(text_cfg(tmp_path, name="wikitext2", path=str(tmp_path)), SEQ, 0)
    with pytest.raises(DataError, match="no such folder"):
        build_data(text_cfg(tmp_path, name="wikitext103", path=str(tmp_path / "missing")), SEQ, 0)


@pytest.mark.parametrize(
    "name, needs", [("tinyshakespeare", "input.txt"), ("wikitext2", "wiki.train.raw")]
)
def test_offline_hub_source_asks_for_a_local_path(tmp_path, name, needs):
    with pytest.raises(DataError, match=f"offline mode is on.*set data.path=DIR holding {needs}"):
        build_data(text_cfg(tmp_path, name=name), SEQ, 0)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Empty Hugging Face caches under tmp_path, and datasets.load_dataset replaced by a recorder
    that returns one tiny split per name."""
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    def load_dataset(path, name=None):
        calls.append(path)
        split = datasets.Dataset.from_dict({"text": ["to be or not to be, that is the question\n" * 200]})
        return {"train": split, "validation": split, "test": split}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_offline_without_a_cached_copy_fails_without_asking_the_hub(tmp_path, hub):
    with pytest.raises(DataError, match="offline mode is on and it is not in the local cache.*set data.path=DIR"):
        build_data(text_cfg(tmp_path, name="tinyshakespeare"), SEQ, 0)
    assert hub == []  # no load_dataset, so none of its retries


def test_offline_with_a_cached_copy_loads_it(tmp_path, hub):
    (tmp_path / "hf" / "datasets" / "karpathy___tiny_shakespeare").mkdir(parents=True)
    build_data(text_cfg(tmp_path, name="tinyshakespeare", vocab_size=300), SEQ, 0)
    assert hub == ["karpathy/tiny_shakespeare"]


def test_an_unreachable_hub_fails_at_once(tmp_path, hub, monkeypatch):
    import socket

    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_network(address, timeout=None):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(DataError, match=r"huggingface.co cannot be reached: offline\?\); set data.path=DIR"):
        build_data(text_cfg(tmp_path, name="wikitext2"), SEQ, 0)
    assert hub == []


def test_bad_text_settings(tmp_path):
    train = write(tmp_path, "t.txt", "some text\n" * 100)
    with pytest.raises(DataError, match="data.vocab_size=100"):
        build_data(text_cfg(tmp_path, name="text", train=train, vocab_size=100), SEQ, 0)
    with pytest.raises(DataError, match="data.valid_fraction=1.5"):
        build_data(text_cfg(tmp_path, name="text", train=train, valid_fraction=1.5), SEQ, 0)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        build_data(text_cfg(tmp_path, name="text", train=str(tmp_path / "latin1.txt")), SEQ, 0)


# -- configs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["synthetic", "text", "tinyshakespeare", "wikitext2", "wikitext103"]
)
def test_config_file_sets_only_schema_keys(name):
    raw = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert raw.pop("defaults") == ["base"]
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), raw)  # raises on an unknown key
    assert cfg.name == name
