"""scripts/probe_shared_cores.py: the processor-sharing model against closed forms."""

from __future__ import annotations

import json
import math

import pytest

from adapipe_cli.simulator.clock import CostProfile

from _scripts import load_script

psc = load_script("probe_shared_cores")


def test_concurrency_is_the_mean_number_computing_over_a_stage_busy_time():
    # stage 0 computes over [0, 2], stage 1 over [1, 3]: each is alone half its time, paired half
    assert psc.concurrency([[(0.0, 2.0)], [(1.0, 3.0)]]) == pytest.approx([1.5, 1.5])
    assert psc.concurrency([[(0.0, 2.0)], [(1.0, 3.0)]], background=0.5) == pytest.approx([2.0, 2.0])
    # two actions back to back at one stage, a stage never busy, and a third stage inside the first's
    assert psc.concurrency([[(0.0, 1.0), (1.0, 2.0)], [], [(0.5, 1.5)]]) == pytest.approx([1.5, 1.0, 2.0])
    # a stage's own overlapping intervals count it once
    assert psc.concurrency([[(0.0, 2.0), (1.0, 3.0)], []]) == pytest.approx([1.0, 1.0])


def fully_busy(stages: int):
    """A stand-in for the simulator: every stage computes for the whole step, which is its cost."""
    def simulate_step(profile: CostProfile):
        step = profile.forward[0]
        return step, [[(0.0, step)] for _ in range(stages)]
    return simulate_step


def test_stages_always_computing_share_the_cores():
    prof = CostProfile.uniform(4, forward=1.0)
    step, factors = psc.shared_step(fully_busy(4), prof, cores=2)
    assert step == pytest.approx(2.0, rel=1e-6) and factors == pytest.approx([2.0] * 4, rel=1e-6)
    step, factors = psc.shared_step(fully_busy(4), prof, cores=4)  # a core each: as the simulator
    assert step == pytest.approx(1.0) and factors == [1.0] * 4
    # with other threads' CPU of 0.4 a step: f = (4 + 0.4 / f) / 2, so f^2 - 2 f - 0.2 = 0
    step, _ = psc.shared_step(fully_busy(4), prof, cores=2, other_cpu_per_step=0.4)
    assert step == pytest.approx(1 + math.sqrt(1.2), rel=1e-6)
    # scaled multiplies every cost of a stage, the held-out signal's forward too
    prof = CostProfile.uniform(2, forward=1.0, backward=2.0, update=0.5, copy=0.1)
    prof.signal = [0.2, 0.4]
    s = psc.scaled(prof, [1.0, 3.0])
    assert (s.forward, s.backward, s.update, s.input) == ([1.0, 3.0], [2.0, 6.0], [0.5, 1.5], [1.0, 3.0])
    assert s.copy == pytest.approx([0.1, 0.3]) and s.signal == pytest.approx([0.2, 1.2])


def test_runs_it_cannot_model_are_refused_in_one_line(make_cfg, tmp_path):
    from omegaconf import OmegaConf

    for name, overrides, summary, said in (
            ("replicas", ["pipeline.replicas=2"], {}, "pipeline.replicas > 1"),
            ("untimed", [], {"final_val_loss": 1.0}, "no action_times")):
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        OmegaConf.save(make_cfg(*overrides), run / ".hydra" / "config.yaml")
        (run / "summary.json").write_text(json.dumps(summary))
        with pytest.raises(SystemExit, match=said):
            psc.predict(run, cores=2)


@pytest.mark.slow  # a dist run of about 10 s
def test_a_dist_run_is_predicted_three_ways(make_cfg, tmp_path):
    """End to end on a tiny 2-stage dist run, its config where Hydra writes it: every prediction is
    a positive step near the measured one, and one core for both stages makes the shared prediction
    slower than each stage on a core of its own (they compute at the same time part of each step)."""
    from omegaconf import OmegaConf

    from adapipe_cli.train.loop import train

    cfg = make_cfg("schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=2", "pipeline.runtime=dist",
                   "pipeline.timeout_s=60", "train.max_steps=16")
    run = tmp_path / "run"
    train(cfg, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    one, two = psc.predict(run, cores=1), psc.predict(run, cores=2)
    assert two["measured_s"] > 0
    for key in ("own_device_wall_s", "own_core_cpu_s", "shared_s"):
        assert 0.2 < two[key] / two["measured_s"] < 5
    assert len(one["factors"]) == 2 and all(f >= 1.0 for f in one["factors"] + two["factors"])
    assert one["shared_s"] > two["own_core_cpu_s"] and max(one["factors"]) > 1.2
