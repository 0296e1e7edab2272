#!/usr/bin/env bash
# Create a virtual environment (if needed) and install ray_resilient with its test extra. Idempotent.
#   scripts/setup.sh            .venv at the versions the README's figures were measured with
#                               (scripts/constraints.txt)
#   scripts/setup.sh --lowest   .venv-lowest at the lowest supported stack (scripts/constraints-lowest.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
CONSTRAINTS=scripts/constraints.txt
case "${1:-}" in
  "") ;;
  --lowest) VENV=.venv-lowest; CONSTRAINTS=scripts/constraints-lowest.txt ;;
  *) echo "usage: scripts/setup.sh [--lowest]" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" -e ".[test]"
