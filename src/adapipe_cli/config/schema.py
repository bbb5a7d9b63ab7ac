"""Typed configuration: one dataclass per Hydra config group, registered with the ConfigStore.

Every key has a type, so Hydra rejects a misspelt key by name and OmegaConf rejects an ill-typed
value. The YAML files under ``conf/`` pick values; these classes say which keys exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .paths import shared_data


@dataclass
class ModelConfig:
    name: str = "gpt-nano"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: Optional[int] = None  # null: 4 * d_model
    block_size: int = 64  # context length of a training sequence
    vocab_size: Optional[int] = None  # null: taken from the data
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class DataConfig:
    name: str = "synthetic"
    # synthetic: a sparse random Markov source of the given order over vocab_size tokens
    vocab_size: int = 256
    order: int = 1
    branching: int = 4
    concentration: float = 0.5
    source_seed: int = 1234
    # text, tinyshakespeare, wikitext2, wikitext103
    train: Optional[str] = None
    valid: Optional[str] = None
    valid_fraction: float = 0.1
    path: Optional[str] = None
    hf_path: Optional[str] = None
    hf_name: Optional[str] = None
    cache_dir: Optional[str] = None
    # validation tokens evaluated at each evaluation
    eval_tokens: int = 8192


@dataclass
class PipelineConfig:
    stages: int = 1
    microbatches: int = 1
    runtime: str = "local"  # local | dist | auto
    backend: str = "auto"  # auto | gloo | nccl
    devices: List[str] = field(default_factory=list)
    # auto (local: profiled, dist: wall) | profiled (pipeline time from the cost profile) | measured (local:
    # each action timed as it runs) | wall (dist: the workers' wall time)
    clock: str = "auto"
    profile: Optional[str] = None  # a saved cost profile (profile.json) to reuse
    profile_reps: int = 5  # interleaved rounds per measuring pass (two passes; the minimum is kept)
    partition: str = "flops"  # flops | params | uniform
    link_latency_s: float = 0.0
    link_bandwidth: float = 0.0  # bytes per second; 0 means infinite
    # data parallel x pipeline: R replicas of the pipeline share each step's batch; each stage
    # all-reduces its gradient with its R-1 copies at its update (an all_gather: see simulator/clock.py)
    replicas: int = 1
    dp_bandwidth: float = 0.0  # bytes per second of each replica's link in the all_gather; 0 means infinite
    dp_latency_s: float = 0.0  # seconds per message of the all_gather
    timeout_s: float = 300.0
    # torch threads per process (0: torch's default). 1: the profiled clock times each action on one
    # core, as a device of its own would run it; with several threads on a shared machine the
    # profile is mostly scheduling noise (and small matrices run slower, not faster)
    threads: int = 1
    order: str = "forward"  # local runtime interleaving of stages: forward | reverse
    # where the local runtime's stages compute: cpu | cuda | cuda:N | auto (cuda when there is one);
    # the dist runtime places its ranks itself (pipeline.backend, pipeline.devices)
    device: str = "cpu"


def _schedule_class() -> type:
    """ScheduleConfig has a key named ``async`` (schedule.async=pipedream), a Python keyword, so the
    class is built from an annotations dict; ``init``/``repr``/``eq`` are off because generated
    code would have to spell ``self.async``. OmegaConf only reads the fields and their defaults."""
    fields: dict[str, tuple[Any, Any]] = {
        "name": (str, "1f1b"),
        # async weight rule: stash | latest | vertical (pipedream); 2bw uses double buffering
        "weights": (str, "stash"),
        "mitigation": (List[str], field(default_factory=list)),
        "lr_reschedule_steps": (int, 100),  # PipeMare: steps over which the delay scaling anneals
        "predict_beta": (float, 0.0),  # EMA factor of the update velocity used by `predict`
        "nesterov_gamma": (float, 0.5),  # weight-space look-ahead coefficient of `nesterov`
        # adapipe: which sync and async schedules it alternates between (conf/schedule/adapipe.yaml
        # makes sync zbh1; 1f1b here, as every other schedule carries the key unused and a
        # checkpoint resumes only with the same resolved config)
        "sync": (str, "1f1b"),
        "async": (str, "pipedream"),
        "async_lr_scale": (float, 1.0),
        "transition_steps": (int, 0),  # damped steps after every switch into async
        "transition_lr_scale": (float, 1.0),  # lr factor at the start of a transition, ramped to 1
        "transition_momentum": (Optional[float], None),  # beta1 during a transition (null: unchanged)
        "chunks": (int, 1),  # interleaved: model chunks per device (p * chunks virtual stages)
    }
    ns: dict[str, Any] = {"__annotations__": {k: t for k, (t, _) in fields.items()}}
    ns.update({k: d for k, (_, d) in fields.items()})
    return dataclass(init=False, repr=False, eq=False)(type("ScheduleConfig", (), ns))


ScheduleConfig = _schedule_class()


# keys that no longer exist, and what replaced them: a run that names one is refused with this
# line, and a checkpoint that holds one resumes (with the code it resumes on)
RETIRED_KEYS = {
    "heuristic.prior_spread": "heuristic.prior_logit_sd, gain's prior spread in logit E since 2026-12-03 "
                              "(the sd of E is prior_logit_sd x E_d (1 - E_d); default 1.0)",
    "heuristic.drift": "heuristic.delay_drift, gain's drift per doubling of the step per unit of the delay's k d since "
                       "2026-12-03 (the drift is delay_drift x k d; default 0.37, which is 0.25 at d = 1.5)",
}
# a retired key's default when it was retired: a checkpoint that holds it at this value resumes under
# its replacement's default; one that holds another value (a choice the run made) cannot be resumed
RETIRED_DEFAULTS = {"heuristic.drift": 0.25}


@dataclass
class HeuristicConfig:
    name: str = "fixed"
    # fixed: [[phase, steps], ...]; steps null means until the end
    plan: List[Any] = field(default_factory=lambda: [["sync", None]])
    window: int = 30  # steps of the current phase compared with a probe (and the warm-up)
    probe_every: int = 100  # steps between probes of the other phase
    probe_steps: int = 20  # observed steps of a probe
    backoff: int = 8  # a clear verdict doubles the interval to the next probe, up to backoff x probe_every
    margin: float = 0.05  # relative gain a switch must promise beyond its cost
    confidence: float = 2.0  # standard errors a difference must exceed to count
    smoothing: float = 0.5  # goodput: weight of the old E in the running estimate
    # gain: relative sd of the unseen drift of async's goodput per doubling of the step, per unit of the
    # delay's k d (= 1 / E_d - 1): 0.37 x k d, 0.25 at the observation streams' d = 1.5 (the drift before),
    # 0.50 at AdamW's d = 3 and 0.06 at d = 3/8, as measured (scripts/calibrate_drift.py)
    delay_drift: float = 0.37
    # gain: async's efficiency E expected to rise per doubling of the step, relative, per unit of k d
    # (the drift's direction, up to E = 1; 0: none); after two probes, the prior mean of their trend: the median over 8
    # cells of E's signed slope over k d, seeds 9-11 and dev seed 3 (scripts/calibrate_drift.py: E
    # rose in 22 of 25 runs)
    delay_trend: float = 0.24
    # gain: the k d where the drift and the rise stop growing with the delay and where they are gone
    # (linear in k d between; null: they grow without end). Measured (scripts/calibrate_drift.py): with
    # AdamW they grow up to d = 3 (k d = 1.35: 0.42-0.48 relative per doubling on synthetic data), and at d = 7
    # (k d = 3.15), where async's efficiency stays low, they are 0.002-0.17, median 0.02 (the AdamW grid's
    # depth 8, seeds 3-5, and synthetic 8/1, seeds 9-11: docs/results/drift_long)
    drift_taper_kd: Optional[List[float]] = field(default_factory=lambda: [1.35, 3.15])
    # gain: sd of the prior's logit efficiency, logit E = log(E / (1 - E)): E's sd is prior_logit_sd x
    # E_d (1 - E_d), E_d the delay's prior (wide where the delay is long, narrow where it is short);
    # the root mean square of its errors on 20 rows of the method comparison's seeds 0-5 (scripts/calibrate_prior.py)
    prior_logit_sd: float = 1.0
    # gain: the standard error of E that a probe is expected to have before one has measured anything;
    # null: the median of the estimator's A/A test on the run's signal (scripts/probe_estimator.py, dev
    # seed 3; a window without measurable sync progress counted as infinitely noisy): 0.5 on the
    # held-out signal (0.497, 64 windows), 0.9 on the training loss (0.904, 102 windows; until
    # 2026-12-05 the held-out signal's 0.5 applied to both)
    probe_se: Optional[float] = None
    start: str = "auto"  # sync | async | auto (by the predicted throughput ratio and prior_efficiency)
    prior_efficiency: Optional[float] = None  # start=auto: async first if R x E > 1 (null: from the optimizer and the gradient delay)
    # steps in sync before async is run or probed (an async stretch early in training does lasting
    # damage under AdamW); null: 100 max(3, (stages - 1) / microbatches) with the Adam family, 0
    # with Muon or with undo_probes
    sync_warmup: Optional[int] = None
    # a probe of async from sync is tentative: at the end of its leg it is kept (and async adopted)
    # if async won it clearly, else the run goes back to its state before the probe (its time
    # stays on the clock), so a probe leaves no lasting damage
    undo_probes: bool = False
    # the progress a heuristic measures: the training loss (train: free), or the loss on a fixed
    # held-out set of signal_tokens tokens after every step (heldout: on the clock, each stage's
    # share of its forward after the stage's update; on dist each worker runs it after its
    # update). Default train since 2026-12-04: charged, 512 tokens cost gain 1.17-1.75x the best
    # fixed method, and the training loss beat 64 tokens in 7 of 8 comparisons (docs/results/
    # history.md, "The held-out signal on the clock")
    signal: str = "train"
    signal_tokens: int = 512
    # divergence guard
    guard: bool = True
    guard_factor: float = 2.0
    guard_every: int = 10
    guard_cooldown: int = 50
    options: Dict[str, Any] = field(default_factory=dict)  # keys of user-written heuristics


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | constant
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # muon (hidden matrices); AdamW with the settings above for the rest
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    # dtype of Muon's Newton-Schulz iteration: auto (bf16 on CUDA and bf16-fast CPUs, else fp32) | float32 | bfloat16
    muon_ns_dtype: str = "auto"


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "adapipe"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    mode: Optional[str] = None  # null: honour WANDB_MODE


@dataclass
class TrainConfig:
    batch_size: int = 8
    max_steps: int = 200
    max_time_s: float = 0.0  # 0: no limit (on the run's clock, time_s)
    eval_every: int = 20
    target_ppl: Optional[float] = None
    stop_at_target: bool = False
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    save_final: bool = False
    resume: Optional[str] = None
    progress: str = "auto"  # auto | on | off
    # fp32 | bf16: bf16 autocast of the forwards, fp32 master weights and optimizer state
    precision: str = "fp32"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig)  # type: ignore[valid-type]
    heuristic: HeuristicConfig = field(default_factory=HeuristicConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0


GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "pipeline": PipelineConfig,
    "schedule": ScheduleConfig,
    "heuristic": HeuristicConfig,
    "optim": OptimConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Register the schema as ``base_config`` and each group's schema as ``<group>/base``."""
    if not OmegaConf.has_resolver("adapipe.shared_data"):  # the grids' data path, in any config or override
        OmegaConf.register_new_resolver("adapipe.shared_data", shared_data)
    cs = ConfigStore.instance()
    if "base_config.yaml" in cs.repo:  # once per process: every compose calls this, and storing costs ~40 ms
        return
    cs.store(name="base_config", node=Config)
    for group, cls in GROUPS.items():
        cs.store(group=group, name="base", node=cls)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@dataclass
class SimulateConfig(Config):
    """``adapipe simulate``: the training schema (same groups and overrides) plus the simulator's
    own keys. Costs are per microbatch and stage, in seconds, used for every stage unless
    ``pipeline.profile`` gives a measured profile.json."""

    steps: int = 8  # optimizer steps to simulate
    print: bool = False  # also print every stage's action list
    forward: float = 1.0
    backward: float = 2.0
    update: float = 0.0
    act_bytes: float = 0.0  # bytes of one microbatch's activation between stages (link model)
    # bytes of each stage's gradient, all-reduced across pipeline.replicas (0: the profile's
    # parameter bytes where pipeline.profile gives them)
    grad_bytes: float = 0.0


def register_simulate_config() -> None:
    """Register :class:`SimulateConfig` as ``base_simulate``, the schema of ``conf/simulate.yaml``."""
    register_configs()
    if "base_simulate.yaml" not in ConfigStore.instance().repo:  # (once per process, as register_configs)
        ConfigStore.instance().store(name="base_simulate", node=SimulateConfig)


@dataclass
class SweepTarget:
    """The perplexity whose time-to-reach a sweep compares, decided before the methods run."""

    rule: str = "sync_fraction"  # fixed | sync_fraction | sync_best (| none: sweep.late_target only)
    ppl: Optional[float] = None  # fixed: the target
    # sync_fraction: the median over seeds of the validation perplexity the baseline method has
    # reached at this fraction of a step budget, per (depth, batch size); budget null: its train.max_steps
    fraction: float = 0.5
    budget: Optional[int] = None
    # sync_best: the median over seeds of the best validation perplexity the baseline reaches in its
    # whole step budget (a late target: give the baseline steps enough for its curve to flatten)
    baseline: str = "sync"


@dataclass
class SweepConfig:
    """``adapipe sweep``: a grid of runs (``conf/sweep/NAME.yaml``). A cell is one run: a depth, a
    batch size of ``m`` microbatches of ``microbatch_size`` sequences, a method and a seed."""

    name: str = "smoke"
    dir: Optional[str] = None  # null: outputs/sweeps/<name>
    stages: List[int] = field(default_factory=lambda: [2])
    microbatch_size: int = 2  # sequences per microbatch; train.batch_size = microbatch_size x m
    microbatches: List[int] = field(default_factory=lambda: [1])
    methods: Dict[str, List[str]] = field(default_factory=dict)  # name -> overrides, e.g. [schedule=1f1b]
    seeds: List[int] = field(default_factory=lambda: [0])
    fixed: List[str] = field(default_factory=list)  # overrides every cell gets (model, data, steps...)
    target: SweepTarget = field(default_factory=SweepTarget)  # the early target
    # a second, late target reported beside the first, e.g. sweep.late_target.rule=sync_best (none: no late target)
    late_target: SweepTarget = field(default_factory=lambda: SweepTarget(rule="none"))
    jobs: Optional[int] = None  # cells run at once, each in its own process (null: the number of cores)
    compare: str = "adapipe"  # the method whose speedups over the others the report gives
    profile: bool = True  # measure one cost profile per depth and give it to every cell (local runtime)
    curves: Optional[str] = None  # the (depth, batch size) whose curves the report draws, e.g. p8_b4
    # run only these methods' cells (null: all), e.g. [adapipe] to rerun one method after changing
    # it (delete its cell directories first); a missing target still runs its baseline's cells
    only: Optional[List[str]] = None


def register_sweep_config() -> None:
    """Register :class:`SweepConfig` as ``sweep/base``, the schema of ``conf/sweep/*.yaml``."""
    ConfigStore.instance().store(group="sweep", name="base", node=SweepConfig)
