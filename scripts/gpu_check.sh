#!/usr/bin/env bash
# The prepared GPU check: the local runtime on CUDA (p=4, sync and async, fp32 and bf16; fp32 losses
# against the CPU's), gpt2-small tokens/s, and with two or more GPUs the NCCL dist runtime against
# the local one. One table; exit 1 on a failed comparison; exit 0 with "no CUDA device: nothing
# checked" on a machine without one. Under 8 minutes on one modern GPU. Usage: scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
exec "$PY" scripts/gpu_check.py "$@"
