"""scripts/probe_shared_cores.py (its model, simulator.shared, is tested in test_shared_cores.py)."""

from __future__ import annotations

import json

import pytest

from _scripts import load_script

psc = load_script("probe_shared_cores")


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


def test_a_ranks_step_is_split_into_compute_waits_and_loop():
    table = {"actions": [{"rank": 0, "kind": "F", "count": 8, "run_s": 0.010},
                         {"rank": 0, "kind": "B", "count": 8, "run_s": 0.020},
                         {"rank": 1, "kind": "F", "count": 8, "run_s": 0.012}],
             "ranks": [{"rank": 0, "steps": 2, "step_s": 0.15, "wait_peer_s": 0.02, "between_s": 0.007,
                        "report_s": 0.002, "wait_driver_s": 0.001},
                       {"rank": 1, "steps": 2, "step_s": 0.15, "wait_peer_s": 0.1, "between_s": 0.0,
                        "report_s": 0.0, "wait_driver_s": 0.002}]}
    parts = psc.step_parts(table)
    assert [p["rank"] for p in parts] == [0, 1]
    assert parts[0]["compute"] == pytest.approx((8 * 0.010 + 8 * 0.020) / 2)
    assert (parts[0]["wait"], parts[0]["loop"]) == (pytest.approx(0.02), pytest.approx(0.01))
    assert (parts[1]["compute"], parts[1]["loop"]) == (pytest.approx(8 * 0.012 / 2), pytest.approx(0.002))
