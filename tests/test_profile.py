"""Cost profiles: refused when measured for another run, measured so that a busy machine cannot
inflate one kind of work unseen, and written by ``adapipe profile`` for runs and sweeps to share."""

from __future__ import annotations

import json

import pytest

from adapipe_cli.cli.main import main
from conftest import TINY

# what the tiny run of TINY with 2 stages is: gpt-nano reshaped, 2 microbatches of 4 sequences of 16 tokens
FITS = {"model": "gpt-nano", "stages": 2, "microbatch_size": 4, "seq_len": 16, "optimizer": "adamw",
        "model_shape": {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ff": None}, "partition": "flops", "threads": 3}


def _profile_file(path, **meta):
    path.write_text(json.dumps({"forward": [1e-3, 1e-3], "backward": [2e-3, 2e-3], "update": [1e-4, 1e-4],
                                "act_bytes": 0.0, "meta": {**FITS, **meta}}))
    return path


@pytest.mark.parametrize("meta,named", [
    ({"model": "gpt-micro"}, "model: gpt-micro in the profile, gpt-nano in this run"),
    ({"microbatch_size": 8}, "microbatch_size: 8 in the profile, 4 in this run"),
    ({"seq_len": 64}, "seq_len: 64 in the profile, 16 in this run"),
    ({"optimizer": "muon"}, "optimizer: muon in the profile, adamw in this run"),
    ({"model_shape": dict(FITS["model_shape"], d_model=128)}, "model.d_model: 128 in the profile, 32 in this run"),
])
def test_a_profile_measured_for_another_run_is_refused(meta, named, tmp_path, capsys):
    prof = _profile_file(tmp_path / "p.json", **meta)
    assert main(["train", *TINY, "pipeline.stages=2", f"pipeline.profile={prof}", f"hydra.run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "was measured for another run" in err[0], err


def test_a_fitting_profile_is_used_and_threads_do_not_matter(tmp_path):
    prof = _profile_file(tmp_path / "p.json")  # measured with 3 threads, run with 1
    old = _profile_file(tmp_path / "old.json")  # a profile of an older version: fewer meta entries
    data = json.loads(old.read_text())
    data["meta"] = {k: data["meta"][k] for k in ("model", "stages", "microbatch_size", "seq_len")}
    old.write_text(json.dumps(data))
    for p in (prof, old):
        run = tmp_path / p.stem
        assert main(["train", *TINY, "pipeline.stages=2", "train.max_steps=2", f"pipeline.profile={p}",
                     f"hydra.run.dir={run}"]) == 0
        assert json.loads((run / "profile.json").read_text())["forward"] == [1e-3, 1e-3]

