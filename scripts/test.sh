#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow multi-process tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -v -p no:cacheprovider "$@"
