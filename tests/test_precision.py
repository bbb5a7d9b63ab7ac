"""train.precision=bf16 on the CPU: autocast forwards, fp32 master weights, exact resume; and
pipeline.device errors. (CUDA itself: tests/test_cuda.py, skipped without a GPU.)"""

from __future__ import annotations

import json

import pytest
import torch

from adapipe_cli.cli.main import main
from adapipe_cli.model import build_full_model, build_stages, lm_loss, partition
from adapipe_cli.runtime.profile import stage_memory
from adapipe_cli.schedules import ASYNC, SYNC
from adapipe_cli.optim import StageOptimizer, lr_factor
from conftest import TINY, fixed_clock
from procs import cut_at
from helpers import GCFG, B, local_runtime, make_data, optim_cfg, run_losses, sched_cfg

# bf16 matrix products are ~35x slower than fp32 on CPUs without bf16 units: few, tiny steps
PIPE = ["pipeline.stages=2", "pipeline.microbatches=2"]
# bf16 keeps 8 bits of mantissa: over 20 steps of the tiny model its training losses stay within
# 1% of fp32's (measured: within 0.01%)
BF16_REL_TOL = 0.01


def records(run_dir, kind="step"):
    return [{k: v for k, v in json.loads(x).items() if k != "wall_s"}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines() if json.loads(x)["kind"] == kind]


def run(run_dir, *overrides):
    return main(["train", *TINY, *overrides, f"hydra.run.dir={run_dir}"])


# (evaluated at the start and the end only: the tests below compare the training steps)
FP32 = [*PIPE, "schedule=1f1b", "train.max_steps=20", "train.eval_every=20", "train.save_final=true"]
_fp32_run = {}


def fp32_run(tmp_path_factory):
    """The fp32 run (FP32) that bf16's is compared with, trained once for this module's tests (inside
    the first test that asks, as any run here: the tests' cache folder, plots not drawn): its folder,
    its final checkpoint kept, and its step records, read before any test resumes it."""
    if not _fp32_run:
        d = tmp_path_factory.mktemp("precision") / "fp32"
        assert run(d, *FP32, "train.precision=fp32", fixed_clock(d.parent, 2)) == 0  # (its profile.json: that clock)
        _fp32_run.update(dir=d, steps=records(d))
    return _fp32_run["dir"], _fp32_run["steps"]


def reference_bf16(data, m, steps, clip=1.0):
    """Single-process gradient accumulation with the forward under bf16 autocast, fp32 weights."""
    model = build_full_model(GCFG, seed=0)
    named = list(model.named_parameters())
    opt = StageOptimizer(named, optim_cfg(grad_clip=clip))
    losses, mb = [], B // m
    for t in range(steps):
        x, y = data[t]
        total = 0.0
        for i in range(m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x[i * mb:(i + 1) * mb])
            loss = lm_loss(out.float(), y[i * mb:(i + 1) * mb])
            (loss / m).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        opt.step(lr_factor(t, 2, steps, 0.1))
        losses.append(total / m)
    return losses


def test_bf16_pipeline_equals_single_process_bf16_autocast():
    data = make_data(4)
    ref = reference_bf16(data, 2, 4)
    got = run_losses(local_runtime(2, 2, [SYNC] * 4, data, precision="bf16"), 4)
    assert got == pytest.approx(ref, rel=1e-6)
    fp32 = run_losses(local_runtime(2, 2, [SYNC] * 4, data), 4)
    assert got != fp32  # bf16 did compute in bf16


def test_bf16_losses_stay_within_tolerance_of_fp32_over_20_steps(tmp_path, tmp_path_factory):
    assert run(tmp_path / "bf16", *FP32, "train.precision=bf16", fixed_clock(tmp_path, 2)) == 0
    f = [r["loss"] for r in fp32_run(tmp_path_factory)[1]]
    b = [r["loss"] for r in records(tmp_path / "bf16")]
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert (summary["precision"], summary["device"]) == ("bf16", "cpu")
    assert len(f) == len(b) == 20
    assert f[-1] < f[0] - 0.2  # it trained
    assert b != f
    assert all(abs(x - y) <= BF16_REL_TOL * y for x, y in zip(b, f)), (b, f)


def test_master_weights_copies_and_optimizer_state_stay_fp32():
    """Stashes, predictions and the optimizer's moments are fp32 copies, whatever the compute dtype."""
    data = make_data(4)
    rt = local_runtime(4, 2, [ASYNC] * 4, data, scfg=sched_cfg(mitigation=["predict"]), precision="bf16")
    run_losses(rt, 3)
    assert any(ex.copies or ex.predicted for ex in rt.executors)  # async with prediction holds copies
    for ex in rt.executors:
        held = [*ex.params, *(t for w in ex.copies.values() for t in w), *(t for w in ex.predicted.values() for t in w),
                *(t for g in ex.grads.values() for t in g)]
        held += [v for o in ex.opt.optimizers for s in o.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        assert held and all(t.dtype == torch.float32 for t in held)


def test_ledger_counts_saved_activations_in_bf16():
    stages = build_stages(GCFG, partition(GCFG, 2), 0)
    x, y = make_data(1)[0]
    make_opt = lambda named: StageOptimizer(named, optim_cfg())  # noqa: E731
    for st in stages:
        f, b = (stage_memory(st, make_opt, x, y, prec) for prec in ("fp32", "bf16"))
        n = sum(p.numel() for p in st.parameters())
        assert f["params"] == b["params"] == 4 * n  # fp32 master weights
        assert f["optimizer"] == b["optimizer"] == 2 * 4 * n  # AdamW's two fp32 moments
        assert b["activation"] < f["activation"]


def test_bf16_checkpoint_resumes_exactly(tmp_path):
    mixed = ["schedule=adapipe", "heuristic=fixed", "heuristic.plan=[[sync,3],[async,null]]", *PIPE,
             "schedule.mitigation=[predict]", "train.precision=bf16"]
    whole = tmp_path / "whole"
    # (6 steps: cut after step 4, in the async stream, with steps in flight across the cut; the resume
    # runs on the same clock: the run's profile.json)
    assert run(whole, *mixed, "train.max_steps=6", "train.checkpoint_every=4", "train.keep_checkpoints=4",
               fixed_clock(tmp_path, 2)) == 0
    cut = cut_at(whole, tmp_path / "cut", 4)  # as if stopped right after that step
    assert main(["train", f"train.resume={cut}"]) == 0
    assert records(cut, "step") == records(whole, "step") and records(cut, "eval") == records(whole, "eval")


def test_a_resume_in_another_precision_is_refused(tmp_path_factory, capsys):
    d, _ = fp32_run(tmp_path_factory)  # (its final checkpoint)
    capsys.readouterr()
    assert main(["train", f"train.resume={d}", "train.precision=bf16"]) == 2
    assert "train.precision" in capsys.readouterr().err


@pytest.mark.parametrize("device, says", [
    ("tpu", "unknown pipeline.device='tpu': use cpu, cuda, cuda:N or auto"),
    ("cuda:x", "unknown pipeline.device='cuda:x'"),
    ("cuda:7", "pipeline.device=cuda:7"),
])
def test_device_errors_are_one_line_and_exit_2(tmp_path, capsys, device, says):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert run(tmp_path / "r", f"pipeline.device={device}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "r").exists()  # a refused run leaves nothing behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is cuda on this machine")
def test_auto_without_cuda_is_the_cpu_run(tmp_path, tmp_path_factory):
    cpu, steps = fp32_run(tmp_path_factory)  # (pipeline.device=cpu)
    prof = str(cpu / "profile.json")  # the same clock, so time_s compares too
    assert run(tmp_path / "auto", *FP32, "pipeline.device=auto", f"pipeline.profile={prof}") == 0
    assert records(tmp_path / "auto") == steps


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", [["profile"], ["sweep", "sweep=gpu1"]])
def test_cuda_where_there_is_none_is_refused_by_profile_and_sweep(tmp_path, capsys, command):
    out = ["--out", str(tmp_path / "p.json")] if command == ["profile"] else [f"sweep.dir={tmp_path / 's'}"]
    assert main([*command, "pipeline.device=cuda", *out] if command == ["profile"] else [*command, *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0] and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two worker processes: more than 10 s on 2 busy cores
def test_bf16_dist_equals_bf16_local(make_cfg, tmp_path):
    """The dist runtime's fp32 messages carry bf16 runs too: gloo gives the local numbers bitwise."""
    from adapipe_cli.train.loop import train
    from procs import records as run_records

    over = ["schedule=pipedream", *PIPE, "train.max_steps=6", "train.precision=bf16"]
    train(make_cfg(*over), tmp_path / "local")
    train(make_cfg(*over, "pipeline.runtime=dist", "pipeline.timeout_s=60"), tmp_path / "dist")
    (lsteps, levals), (dsteps, devals) = run_records(tmp_path / "local"), run_records(tmp_path / "dist")
    assert dsteps == lsteps and devals == levals and len(lsteps) == 6
