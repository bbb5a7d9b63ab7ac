"""Published names mean the published algorithms: ``schedule=pipedream`` is PipeDream with weight
stashing and ``schedule=2bw`` PipeDream-2BW, both without mitigation; a mitigated variant is named
in full wherever a run's name shows."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.cli.main import main
from adapipe_cli.train.summary import method_label
from conftest import TINY, fixed_clock


# the config groups chosen are composed (a compose each, 0.4 s on 2 busy cores; cached, so one per
# group choice), the keys then set on the composed config: the label reads the config
@pytest.mark.parametrize("groups,keys,label", [
    (["schedule=1f1b"], {}, "1f1b"),
    (["schedule=gpipe"], {}, "gpipe"),
    (["schedule=pipedream"], {}, "pipedream"),
    (["schedule=2bw"], {}, "2bw"),
    (["schedule=pipedream"], {"schedule.mitigation": ["predict"]}, "pipedream+predict"),
    (["schedule=pipedream"], {"schedule.weights": "latest", "schedule.mitigation": ["lr_reschedule"]},
     "pipedream-latest+lr_reschedule"),
    (["schedule=2bw"], {"schedule.mitigation": ["predict", "nesterov"]}, "2bw+predict+nesterov"),
    ([], {}, "adapipe-goodput(zbh1/pipedream+predict)"),  # the default run keeps prediction on, and says so
    (["heuristic=rate"], {"schedule.mitigation": []}, "adapipe-rate(zbh1/pipedream)"),
    ([], {"schedule.sync": "1f1b"}, "adapipe-goodput(1f1b/pipedream+predict)"),
    ([], {"schedule.async": "2bw", "schedule.sync": "gpipe"}, "adapipe-goodput(gpipe/2bw+predict)"),
])
def test_method_labels_name_the_variant(groups, keys, label, make_cfg):
    from omegaconf import OmegaConf

    cfg = make_cfg(*groups)
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    assert method_label(cfg) == label


def test_the_plain_schedules_have_no_mitigation(make_cfg):
    assert list(make_cfg("schedule=pipedream").schedule.mitigation) == []
    assert list(make_cfg("schedule=2bw").schedule.mitigation) == []
    assert list(make_cfg("schedule=adapipe").schedule.mitigation) == ["predict"]


def test_adapipe_syncs_with_zbh1_by_default(make_cfg):
    """ZB-H1: 1F1B's numbers and memory with a smaller bubble, the strongest sync schedule."""
    assert make_cfg("schedule=adapipe").schedule.sync == "zbh1"


def test_summary_names_the_method_and_each_phase_schedule(tmp_path):
    # (a given profile: the run measures none; the names do not depend on it)
    assert main(["train", *TINY, "pipeline.stages=2", "train.max_steps=3", fixed_clock(tmp_path, 2),
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["method"] == "adapipe-goodput(zbh1/pipedream+predict)"
    assert s["phase_schedules"] == {"sync": "zbh1", "async": "pipedream+predict"}
