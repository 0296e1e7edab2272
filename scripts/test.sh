#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow multi-process tests included; then
# the checkpoint and data tests again on the lowest supported torch (scripts/setup.sh --lowest).
# With arguments, only the first part runs, with them passed to pytest (e.g. -m "not slow", -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -v -p no:cacheprovider --durations=25 "$@"
fi
status=0  # both parts run; the script fails if either did
.venv/bin/python -m pytest -v -p no:cacheprovider --durations=25 || status=$?
scripts/setup.sh --lowest
.venv-lowest/bin/python -m pytest -v -p no:cacheprovider --durations=10 \
  tests/test_checkpoint_unit.py tests/test_staging.py tests/test_fsdp_checkpoint.py tests/test_buffers.py tests/test_restore.py tests/test_remote_restore.py tests/test_data.py tests/test_parquet.py tests/test_torch_internals.py \
  || status=$?
exit "$status"
