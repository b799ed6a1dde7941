#!/usr/bin/env bash
# Saves into .whl/ the wheels a device machine lacks for scripts/gpu_check.sh (its image has
# PyTorch, transformers, peft, accelerate, numpy, pandas, pyarrow, httpx, prometheus-client
# ... but not these), for its Python 3.12, at the versions .venv has (trl: the frameworks
# benchmark's pin; liger-kernel: the `liger` extra's, not in .venv). Run once here: `bash scripts/gpu_wheels.sh` (about 15 MB; .whl/ is
# ignored by git and travels with `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
names="datasets dill multiprocess plotly fastapi starlette uvicorn pydantic pydantic_core
annotated_types typing_inspection gguf h11 click"
pins=$(.venv/bin/python - $names <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name.replace('_', '-')}=={version(name)}" for name in sys.argv[1:]))
PY
)
trl=$(grep -h '^trl==' benchmarks/frameworks/requirements/trl.txt)
# --use_liger_kernel's GPU tests (Triton comes with the machine's CUDA PyTorch)
liger="liger-kernel==0.8.5"
rm -rf .whl && mkdir .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins ${trl:-trl} $liger 2>&1 | grep -v '^WARNING: Location' || true
ls .whl && du -sh .whl
