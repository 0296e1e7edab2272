#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default: a DDP job on a local
# Ray cluster (2 CPU workers) that checkpoints to ./runs and survives an injected worker kill.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python jobs/train_ddp.py --faults "kill:step=70:rank=1" "$@"
