#!/usr/bin/env bash
# On a GPU machine whose image has torch (2.11 or later), Python 3.12 and no Ray or MLflow, with the
# wheels of scripts/gpu_wheels.sh in .whl/: the CUDA tests, then benchmarks/gpu_checkpoint.py.
# With the device tool: carry ".whl", command "scripts/gpu_check.sh", timeout about 540 s.
# Logs go to $OUT (the device tool's) or /tmp/gpu_check.
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, ray; assert torch.cuda.is_available(), 'no CUDA GPU'; print('torch', torch.__version__, 'ray', ray.__version__, torch.cuda.get_device_name())" | tee "$LOGS/versions.log"
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_checkpoint_unit.py tests/test_staging.py \
  tests/test_fsdp_checkpoint.py 2>&1 | tee "$LOGS/tests.log"
timeout 420 python3 benchmarks/gpu_checkpoint.py --state-gib 4 --saves 3 2>&1 | tee "$LOGS/benchmark.log"
