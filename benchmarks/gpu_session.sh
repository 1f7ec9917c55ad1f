#!/usr/bin/env bash
# The prepared GPU session of issue 44: one call of under 9 minutes on one H100 or H200 that
# measures jaxscale's llama_1b against the PyTorch peer at 4 and 8 sequences of 2048 per device
# (the device's own step settings, then the lean ones the device would fall back to), and
# appends the rows and each `ratio:` to benchmarks/RESULTS.md (device, versions, commit).
#
#   benchmarks/gpu_session.sh [--steps=30]
#
# On the lent machines grain, array_record, ml_collections, tensorboardX and portpicker are not
# installed: fetch their wheels here first (docs: the device tool's README), into .whl/ (ignored
# by git), carry .whl and install them before this script:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && benchmarks/gpu_session.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=30
for arg in "$@"; do
  case "$arg" in
    --steps=*) STEPS="${arg#*=}" ;;
    *) echo "error: unknown flag $arg; use --steps=N" >&2; exit 2 ;;
  esac
done
LEAN=(--set=model.scan_unroll=1 --set=model.loss_chunk_len=1024 --set=model.loss_vocab_tile=16384)
export PYTHONUNBUFFERED=1
for per_device in 4 8; do
  benchmarks/accelerator.sh --models=llama_1b --steps="$STEPS" --per_device_batch="$per_device" \
    --peer --workdir="runs/gpu_session/$per_device"
done
benchmarks/accelerator.sh --models=llama_1b --steps="$STEPS" --per_device_batch=4 \
  --workdir=runs/gpu_session/lean "${LEAN[@]}"
