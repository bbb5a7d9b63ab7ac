"""Shared test set-up: offline, no wandb, tiny configs composed through Hydra's compose API."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

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


# every shared or cached compose and config file read checked against Hydra's own (README: Tests)
COMPOSE_CHECK = os.environ.get("ADAPIPE_TEST_COMPOSE_CHECK") == "1"


def _compose_once_per_overrides() -> None:
    """Hydra composes each distinct call (overrides, config name, Hydra's node and job name, configs
    folder, and with Hydra's node the working directory it records) once per test process: 0.3-1 s a
    compose on 2 busy cores. Calls that differ only in value overrides (``train.max_steps=3``, not
    ``schedule=pipedream``) share one compose of their group overrides, and the values are applied
    to a copy as Hydra's config loader applies them (:func:`_values_apart`, :func:`_with_values`):
    170 fresh composes in the fast suite became 64. Each call gets its own deep copy (~10-40 ms), so
    a test that changes its config changes no other's. With ADAPIPE_TEST_COMPOSE_CHECK=1 every call
    not composed afresh also composes afresh and fails unless the two are equal (YAML with
    interpolations unresolved, Hydra's node, each node's struct and readonly flags and schema type)
    or, where the call raised, Hydra's compose raises the same exception (type, message, cause)."""
    import copy

    from adapipe_cli.cli import compose as module

    fresh, cache = module.compose_config, {}

    def composed(key, overrides, config_name, hydra, job_name):
        """The config for ``key``, and whether it was composed afresh."""
        if key in cache:
            return copy.deepcopy(cache[key]), False
        split = _values_apart(overrides, hydra, key[4])
        if split is None or not split[1]:
            cfg, new = fresh(overrides, config_name, hydra, job_name), True
        else:
            rest, values, parsed = split
            cfg, new = composed((tuple(rest), *key[1:]), rest, config_name, hydra, job_name)[0], False
            _with_values(cfg, values, parsed, len(rest), hydra)
        cache[key] = copy.deepcopy(cfg)
        return cfg, new

    def compose_config(overrides, config_name="config", hydra=False, job_name="adapipe"):
        key = (tuple(overrides), config_name, hydra, job_name, str(module.conf_dir()), os.getcwd() if hydra else None)
        try:
            cfg, new = composed(key, list(overrides), config_name, hydra, job_name)
        except Exception as e:
            if COMPOSE_CHECK:
                try:
                    fresh(list(overrides), config_name, hydra, job_name)
                except Exception as f:
                    assert _said(f) == _said(e), f"a shared compose raised otherwise than Hydra's: {key}"
                else:
                    raise AssertionError(f"a shared compose raised where Hydra's does not: {key}") from e
            raise
        if COMPOSE_CHECK and not new:
            assert _same(cfg, fresh(list(overrides), config_name, hydra, job_name)), f"a cached compose differs: {key}"
        return cfg

    compose_config.__wrapped__ = fresh  # for a test that counts Hydra's composes
    module.compose_config = compose_config


def _said(e: BaseException) -> tuple:
    """An exception as a check compares it: its type and message, and its cause's."""
    return type(e), str(e), type(e.__cause__), str(e.__cause__)


def _same(a, b) -> bool:
    """Two configs equal as YAML (interpolations unresolved) and in every node's own struct and
    readonly flags and schema type."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    def shape(c, path: str = "") -> list:
        out = [(path, c._get_node_flag("struct"), c._get_node_flag("readonly"),
                OmegaConf.get_type(c) if isinstance(c, DictConfig) else list)]
        content = c._content
        items = content.items() if isinstance(content, dict) else enumerate(content) if isinstance(content, list) else ()
        for k, node in items:
            if isinstance(node, (DictConfig, ListConfig)):
                out += shape(node, f"{path}.{k}")
        return out

    return OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b) and shape(a) == shape(b)


# keys of Hydra's node that a call with it may give as values: Hydra's loader derives nothing from
# them after applying the overrides (it rewrites hydra.overrides, hydra.runtime and hydra.job, and
# reads hydra.searchpath before composing)
HYDRA_VALUES = ("hydra.run.", "hydra.sweep.", "hydra.mode")


@functools.lru_cache
def _config_folders(root: str) -> frozenset[str]:
    return frozenset(str(d.relative_to(root)) for d in Path(root).rglob("*") if d.is_dir())


def _values_apart(overrides: list[str], hydra: bool, root: str):
    """``(rest, values, parsed)``: the config-group overrides (a key naming a group of the configs
    folder ``root`` or the ConfigStore, no dict value), in their order, for Hydra to compose; the
    value overrides, which Hydra applies after composing (a key naming no group; of Hydra's node
    only with it, under ``HYDRA_VALUES``); and every override as Hydra parses it. None where Hydra
    should see the whole list: an override it does not parse, and any of neither kind (a package,
    a ``/``, a sweep, a dict for a group, another key of Hydra's node), which Hydra may apply as a
    value but in their order among the others, or read before or after composing."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from adapipe_cli.config import register_configs

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return None
    register_configs()
    groups = _config_folders(root) | {k for k, v in ConfigStore.instance().repo.items() if isinstance(v, dict)}
    values, rest = [], []
    for o in parsed:
        key = o.key_or_group
        if o.package is not None or o.is_sweep_override() or "/" in key:
            return None
        if key in groups:
            if isinstance(o.value(), dict):
                return None
            rest.append(o.input_line)
        elif key == "hydra" or key.startswith("hydra."):
            if not (hydra and key.startswith(HYDRA_VALUES)):
                return None
            values.append(o)
        else:
            values.append(o)
    return rest, values, parsed


def _with_values(cfg, values, parsed, n_rest: int, hydra: bool) -> None:
    """Apply the value overrides to ``cfg`` (composed from the ``n_rest`` group overrides) as Hydra's
    config loader applies them after composing; with Hydra's node, append every override to its
    lists in the order given and derive ``override_dirname`` from them, as the loader does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname

    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    if not hydra:
        return
    task = [o for o in parsed if not o.is_hydra_override()]
    given = list(cfg.hydra.overrides.task)  # what the config held, then the group overrides
    cfg.hydra.overrides.task = given[:len(given) - n_rest] + [o.input_line for o in task]
    cfg.hydra.overrides.hydra = list(cfg.hydra.overrides.hydra) + [o.input_line for o in parsed if o.is_hydra_override()]
    dirname = cfg.hydra.job.config.override_dirname
    cfg.hydra.job.override_dirname = get_overrides_dirname(
        overrides=task, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)


def _read_each_config_file_once() -> None:
    """Hydra reads and parses each config file at every compose (about a fifth of a compose): each
    file is read once per test process (keyed by its path, modification time and size) and every
    compose gets its own deep copy of what was read. With ADAPIPE_TEST_COMPOSE_CHECK=1 each copy is
    checked against a fresh read."""
    import copy

    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from omegaconf import OmegaConf

    real, read = FileConfigSource.load_config, {}

    def load_config(self, config_path: str):
        path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            st = os.stat(path)
        except OSError:
            return real(self, config_path)  # (Hydra says what is missing)
        key = (self.provider, self.path, path, st.st_mtime_ns, st.st_size)
        if key not in read:
            read[key] = real(self, config_path)
        out = copy.deepcopy(read[key])
        if COMPOSE_CHECK:
            again = real(self, config_path)
            assert (OmegaConf.to_yaml(again.config), again.header, again.path) == (
                OmegaConf.to_yaml(out.config), out.header, out.path), f"a config file read once differs: {path}"
        return out

    FileConfigSource.load_config = load_config


_compose_once_per_overrides()
_read_each_config_file_once()


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
