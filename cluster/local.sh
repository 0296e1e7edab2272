#!/usr/bin/env bash
# Bring a local Ray cluster up or down on this machine (head node on loopback).
#
#   cluster/local.sh up [NUM_CPUS]   start the head node (default: all CPUs) and print the env to export
#   cluster/local.sh down            stop every Ray process started on this machine
#
# The cluster uses Ray's token authentication; the job CLI then needs RAY_AUTH_MODE=token (the
# token is in ~/.ray/auth_token), which the printed environment sets.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ray processes (and so `python` in job entrypoints) use the project environment.
export PATH="$PWD/.venv/bin:$PATH"
RAY=ray
case "${1:-}" in
  up)
    cpus=${2:-$(nproc)}
    "$RAY" start --head --node-ip-address=127.0.0.1 --num-cpus="$cpus" \
      --dashboard-host=127.0.0.1 --dashboard-port=8265 --disable-usage-stats >/dev/null
    echo "Ray head up on 127.0.0.1 with $cpus CPUs. For the job CLI:"
    echo "  export RAY_ADDRESS=http://127.0.0.1:8265 RAY_AUTH_MODE=token"
    echo "  ray job submit --working-dir . -- python jobs/train_ddp.py --storage-path $PWD/runs"
    ;;
  down)
    "$RAY" stop --force >/dev/null
    echo "Ray stopped."
    ;;
  *)
    echo "usage: $0 up [NUM_CPUS] | down" >&2
    exit 2
    ;;
esac
