#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default: image classification on a
# generated JPEG dataset, on a local Ray cluster (CPU workers), checkpointing to ./runs, MLflow in
# ~/.ray_resilient, with one worker SIGKILLed at step 30 and recovered from.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python jobs/train_images.py --faults "kill:step=30:rank=1" "$@"
