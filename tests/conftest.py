"""Shared test set-up: offline, no wandb, tiny configs composed through Hydra's compose API."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# one torch thread, as runs default to (pipeline.threads=1): tests that build runtimes directly
# would otherwise run torch's default threads, several times slower on a busy 2-core machine
torch.set_num_threads(1)

# A model and data small enough that a step takes milliseconds.
TINY = [
    "model.n_layer=4", "model.d_model=32", "model.n_head=2", "model.block_size=16",
    "data.vocab_size=64", "data.eval_tokens=256",
    "train.batch_size=8", "train.max_steps=12", "train.eval_every=4", "train.progress=off",
    "pipeline.profile_reps=1", "pipeline.threads=1", "optim.warmup_steps=2",
]


def _compose_once_per_overrides() -> None:
    """Hydra composes each distinct call (overrides, config name, Hydra's node and job name, configs
    folder, and with Hydra's node the working directory it records) once per test process: 0.3-1 s a compose on
    2 busy cores, 121 distinct calls in the fast suite, many more calls. Each call gets its own deep
    copy (~20-40 ms), so a test that changes its config changes no other's. With
    ADAPIPE_TEST_COMPOSE_CHECK=1 every repeated call also composes afresh and fails unless the two
    are equal (YAML with interpolations unresolved, struct and readonly flags, schema type)."""
    import copy

    from omegaconf import OmegaConf

    from adapipe_cli.cli import compose as module

    fresh, cache = module.compose_config, {}
    check = os.environ.get("ADAPIPE_TEST_COMPOSE_CHECK") == "1"

    def same(a, b) -> bool:
        flags = lambda c: [(k, c._get_flag(k)) for k in ("struct", "readonly")]  # noqa: E731
        return (OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b) and flags(a) == flags(b)
                and OmegaConf.get_type(a) == OmegaConf.get_type(b))

    def compose_config(overrides, config_name="config", hydra=False, job_name="adapipe"):
        key = (tuple(overrides), config_name, hydra, job_name, str(module.conf_dir()), os.getcwd() if hydra else None)
        if key not in cache:
            cfg = fresh(overrides, config_name, hydra, job_name)
            cache[key] = copy.deepcopy(cfg)
            return cfg
        cfg = copy.deepcopy(cache[key])
        if check:
            assert same(cfg, fresh(overrides, config_name, hydra, job_name)), f"a cached compose differs: {key}"
        return cfg

    module.compose_config = compose_config


_compose_once_per_overrides()


@pytest.fixture
def make_cfg():
    """``make_cfg(*overrides)``: the composed config of a tiny run with these overrides."""
    from adapipe_cli.cli.compose import compose_config

    def make(*overrides: str):
        return compose_config([*TINY, *overrides])

    return make


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ADAPIPE_CACHE", str(tmp_path_factory.getbasetemp() / "adapipe-cache"))


@pytest.fixture(autouse=True)
def _run_plots_unrendered(request, monkeypatch):
    """A run's plots (``plot_run``) are built from its records, every figure and artist, but not
    laid out, drawn or written: drawing was a third of a tiny run's time. Tests marked ``plots``
    (those that check the files: a sync run, a switching run, a dist run) draw and write them."""
    if request.node.get_closest_marker("plots"):
        return
    from adapipe_cli.train import loop

    monkeypatch.setattr(loop, "plot_run", built_not_drawn(loop.plot_run))


def built_not_drawn(plot):
    """``plot`` building its figure, every artist, but not laying it out, drawing or writing it: for
    the plots a test does not check."""
    from matplotlib.figure import Figure

    def undrawn(*args, **kwargs):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Figure, "tight_layout", lambda self, *a, **k: None)
            m.setattr(Figure, "savefig", lambda self, *a, **k: None)
            return plot(*args, **kwargs)
    return undrawn


def fixed_clock(folder, stages: int = 4) -> str:
    """``pipeline.profile=`` a uniform cost profile of ``stages`` saved in ``folder``, for a run whose
    test does not check a measured one: the run measures none (a second or more of a tiny run on 2
    busy cores, several in bf16). Tests of a measured profile measure it."""
    from adapipe_cli.simulator.clock import CostProfile

    path = folder / f"uniform-{stages}.json"
    CostProfile.uniform(stages).save(path)
    return f"pipeline.profile={path}"


@contextlib.contextmanager
def drawn_plots():
    """Runs draw and write their plots here, as in a test marked ``plots`` (``_run_plots_unrendered``
    leaves the others' undrawn): for the one run of several whose plot files a test checks."""
    from adapipe_cli.train import loop, summary

    with pytest.MonkeyPatch.context() as m:
        m.setattr(loop, "plot_run", summary.plot_run)
        yield


def shared_data_dir():
    """The read-only real text beside the project (../shared/data), or $ADAPIPE_SHARED_DATA."""
    from pathlib import Path

    candidates = [os.environ.get("ADAPIPE_SHARED_DATA"), Path(__file__).resolve().parents[2] / "shared" / "data",
                  "/work/shared/data"]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return Path(__file__).resolve().parents[2] / "shared" / "data"
