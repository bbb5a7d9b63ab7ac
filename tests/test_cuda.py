"""The local runtime on a CUDA device (skipped without one: these have not run in this project's
sessions, which had no GPU). scripts/gpu_check.sh runs the larger checks."""

from __future__ import annotations

import json

import pytest
import torch

from adapipe_cli.cli.main import main
from conftest import TINY
from procs import cut_at

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PIPE = ["pipeline.stages=4", "pipeline.microbatches=2", "schedule=1f1b"]
# fp32 on a GPU rounds differently from the CPU (other kernels, TF32 off by default for matmuls)
CUDA_REL_TOL = 1e-3


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "step"]


def run(run_dir, *overrides):
    return main(["train", *TINY, *overrides, f"hydra.run.dir={run_dir}"])


def test_fp32_cuda_losses_match_the_cpu(tmp_path):
    assert run(tmp_path / "cpu", *PIPE) == 0
    assert run(tmp_path / "gpu", *PIPE, "pipeline.device=cuda") == 0
    c, g = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert len(c) == len(g) and all(abs(x - y) <= CUDA_REL_TOL * y for x, y in zip(g, c)), (g, c)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_bf16_on_cuda_trains(tmp_path, schedule):
    assert run(tmp_path / "r", "pipeline.stages=4", "pipeline.microbatches=2", f"schedule={schedule}",
               "pipeline.device=cuda", "train.precision=bf16") == 0
    ls = losses(tmp_path / "r")
    assert ls[-1] < ls[0]


@pytest.mark.parametrize("there, back", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(tmp_path, there, back):
    mixed = ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,3],[async,null]]",
             "pipeline.stages=2", "pipeline.microbatches=2"]
    whole = tmp_path / "whole"
    assert run(whole, *mixed, f"pipeline.device={there}", "train.checkpoint_every=4", "train.keep_checkpoints=4") == 0
    cut = cut_at(whole, tmp_path / "cut", 4)  # as if stopped right after that step
    assert main(["train", f"train.resume={cut}", f"pipeline.device={back}"]) == 0
    a, b = losses(whole), losses(cut)
    assert len(a) == len(b) and all(abs(x - y) <= CUDA_REL_TOL * y for x, y in zip(a, b)), (a, b)
