"""The prepared GPU check (run by scripts/gpu_check.sh): the CUDA paths of the local runtime and,
with two or more GPUs, the NCCL distributed runtime, against references, in one table.

Checks (each a real `adapipe train` run in its own process, synthetic data, under 8 minutes on one
modern GPU):
- local runtime on cuda at p=4, sync (1f1b) and async (pipedream), fp32 and bf16;
- fp32 cuda losses against cpu losses of the same run: every step within FP32_REL_TOL;
- bf16 cuda losses against fp32 cuda losses: every step within BF16_REL_TOL;
- the other schedules (gpipe, 2bw, adapipe) on cuda at p=4 in bf16: they run, with finite losses;
- tokens/s of gpt2-small (GPT-2 vocabulary, 1024 tokens of context) at p=4, fp32 and bf16;
- with two or more GPUs: the dist runtime (NCCL, one GPU per stage) at p=2 against the local
  runtime on one GPU, fp32, every step within FP32_REL_TOL.
Exits 1 when a comparison fails or a run does, 0 when all pass or when there is no CUDA device.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FP32_REL_TOL = 1e-3  # GPU kernels round differently from CPU ones; 30 steps keep the drift far below this
BF16_REL_TOL = 0.02  # bf16 keeps 8 mantissa bits; its losses follow fp32's to about 1%
STEPS = 30
SMALL = ["model=gpt-nano", "data=synthetic", "train.batch_size=8", f"train.max_steps={STEPS}",
         "train.eval_every=1000", "train.progress=off", "pipeline.profile_reps=2"]
GPT2 = ["model=gpt2-small", "model.vocab_size=50304", "data=synthetic", "train.batch_size=8",
        "train.max_steps=20", "train.eval_every=1000", "train.progress=off", "pipeline.profile_reps=2",
        "pipeline.stages=4", "pipeline.microbatches=4", "schedule=1f1b", "pipeline.device=cuda"]
RUN = "import sys; from adapipe_cli.cli.main import main; sys.exit(main(sys.argv[1:]))"


def train(out: Path, name: str, overrides: list[str], timeout: float = 240) -> tuple[list[dict] | None, str]:
    """The step records of one run, or None and the last line of its error output."""
    run_dir = out / name
    cmd = [sys.executable, "-c", RUN, "train", *overrides, f"hydra.run.dir={run_dir}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        last = lines[-1].replace("adapipe: error: ", "") if lines else ""
        return None, f"exit {proc.returncode}: {last[:100]}"
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "step"], ""


def worst(got: list[dict], ref: list[dict]) -> float:
    """The largest relative difference of the step losses, max_t |got_t - ref_t| / |ref_t|."""
    if len(got) != len(ref):
        return float("inf")
    return max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, ref))


def tokens_per_s(recs: list[dict], tokens_per_step: int) -> float:
    """Tokens per wall second over the second half of the run (the first steps warm up)."""
    half = recs[len(recs) // 2:]
    span = half[-1]["wall_s"] - recs[len(recs) // 2 - 1]["wall_s"]
    return tokens_per_step * len(half) / span if span > 0 else float("nan")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 0
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    rows: list[tuple[str, str, str, str]] = []  # check, result, tolerance, PASS/FAIL/info
    failed = False

    def row(check: str, result: str, tol: str, ok: bool | None) -> None:
        nonlocal failed
        failed |= ok is False
        rows.append((check, result, tol, "-" if ok is None else ("PASS" if ok else "FAIL")))

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="adapipe-gpu-check-") as tmp:
        out = Path(tmp)
        p4 = ["pipeline.stages=4", "pipeline.microbatches=4"]
        for sched in ("1f1b", "pipedream"):
            base = [*SMALL, *p4, f"schedule={sched}"]
            cpu, e_cpu = train(out, f"cpu-{sched}", [*base, "pipeline.device=cpu"])
            runs = {}
            for prec in ("fp32", "bf16"):
                recs, err = train(out, f"cuda-{sched}-{prec}", [*base, "pipeline.device=cuda", f"train.precision={prec}"])
                runs[prec] = recs
                label = f"local cuda p=4 {sched} {prec}: runs {STEPS} steps"
                row(label, f"final loss {recs[-1]['loss']:.4f}" if recs else err, "finite",
                    bool(recs) and all(math.isfinite(r["loss"]) for r in recs))
            if cpu and runs["fp32"]:
                w = worst(runs["fp32"], cpu)
                row(f"{sched} fp32: cuda losses vs cpu", f"max rel diff {w:.2e}", f"<= {FP32_REL_TOL:g}", w <= FP32_REL_TOL)
            else:
                row(f"{sched} fp32: cuda losses vs cpu", e_cpu or "cuda run failed", f"<= {FP32_REL_TOL:g}", False)
            if runs["fp32"] and runs["bf16"]:
                w = worst(runs["bf16"], runs["fp32"])
                row(f"{sched} bf16 vs fp32 (cuda)", f"max rel diff {w:.2e}", f"<= {BF16_REL_TOL:g}", w <= BF16_REL_TOL)
        for sched in ("gpipe", "2bw", "adapipe"):
            recs, err = train(out, f"cuda-{sched}-bf16", [*SMALL, *p4, f"schedule={sched}", "pipeline.device=cuda",
                                                          "train.precision=bf16"])
            row(f"local cuda p=4 {sched} bf16: runs {STEPS} steps", f"final loss {recs[-1]['loss']:.4f}" if recs else err,
                "finite", bool(recs) and all(math.isfinite(r["loss"]) for r in recs))
        for prec in ("fp32", "bf16"):
            recs, err = train(out, f"gpt2-{prec}", [*GPT2, f"train.precision={prec}"], timeout=300)
            tps = tokens_per_s(recs, 8 * 1024) if recs else float("nan")
            row(f"gpt2-small local cuda p=4 m=4 1f1b {prec}: tokens/s", f"{tps:,.0f}" if recs else err, "", None if recs else False)
        if gpus >= 2:
            base = [*SMALL, "pipeline.stages=2", "pipeline.microbatches=4"]
            for sched in ("1f1b", "pipedream"):
                local, e1 = train(out, f"local2-{sched}", [*base, f"schedule={sched}", "pipeline.device=cuda"])
                dist, e2 = train(out, f"dist2-{sched}", [*base, f"schedule={sched}", "pipeline.runtime=dist",
                                                        "pipeline.backend=nccl"])
                w = worst(dist, local) if local and dist else float("inf")
                row(f"{sched} fp32: dist nccl p=2 vs local cuda", f"max rel diff {w:.2e}" if local and dist else (e1 or e2),
                    f"<= {FP32_REL_TOL:g}", w <= FP32_REL_TOL)
        else:
            row("dist nccl vs local", f"skipped: {gpus} GPU (needs 2)", "", None)
    widths = [max(len(r[i]) for r in rows + [("check", "result", "tolerance", "status")]) for i in range(4)]
    print(f"adapipe GPU check, {time.strftime('%Y-%m-%d')}, {gpus} x {name}, torch {torch.__version__}, "
          f"{time.time() - t0:.0f} s")
    for r in [("check", "result", "tolerance", "status"), tuple("-" * w for w in widths), *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
