#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a GPU machine that has PyTorch but none of
# swiftlm's other dependencies and no network (this workplace's device machines): the wheels
# that `bash scripts/gpu_wheels.sh` saved into .whl/ here are installed into /tmp/site, and
# swiftlm runs from src/. Through the device tool, in one call:
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
#
# The JSON and the logs land in $OUT (or ./gpu_check_out where OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia_smi.txt" 2>&1
python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" --work /tmp/gpu_check_work 2>&1 \
    | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
# the logs of the parts, small enough to come back
tar -czf "$OUT/part_logs.tgz" -C /tmp/gpu_check_work --exclude model --exclude '*.safetensors' \
    --exclude out . 2>/dev/null
exit "$status"
