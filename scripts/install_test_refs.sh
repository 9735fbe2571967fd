#!/usr/bin/env bash
# The outside references the tests compare against, imported at test time and never copied:
# SGLang 0.5.23's own weight-group function, bucket class and request classes (tests/sglang_ref.py);
# AReaL 1.0.4's PPO actor loss and rejection sampling (tests/test_offpolicy.py).
# --no-deps: SGLang pins a CUDA torch and GPU kernels, AReaL a GPU training stack; the modules the tests load need only the
# small pure-Python packages listed on the second line.
set -euo pipefail
PIP="python3 -m pip install --quiet --disable-pip-version-check"
$PIP --no-deps sglang==0.5.23
$PIP --no-deps areal==1.0.4
$PIP msgspec pydantic
