#!/usr/bin/env bash
# Create .venv (if needed) and install ray_resilient with its test extra. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# This pair is the one that works together on these machines (a CUDA build that also runs on CPU);
# pyproject.toml admits any torch >= 2.6 elsewhere.
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet -e ".[test]"
