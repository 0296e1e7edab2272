#!/usr/bin/env bash
# Create .venv (if needed) and install ray_resilient with its test extra, at the versions the
# README's figures were measured with (scripts/constraints.txt). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ".[test]"
