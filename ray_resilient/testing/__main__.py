"""``python -m ray_resilient.testing``: the rig's pieces for shell scripts (``cluster/local.sh``).

    s3-server DIR --bucket B [--port P] [--timeout S]
                                          SeaweedFS in the foreground until SIGTERM; credentials from
                                          AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY
    wait [--pid PID] [--timeout S] KIND   until a service answers (exit 1 if PID exits first):
        http URL [BEARER_TOKEN_FILE]      answers 200
        s3 ENDPOINT BUCKET                the bucket can be listed (credentials from AWS_*)
        ray-nodes GCS_ADDRESS N           at least N nodes alive
    fast-node-failure-env                 NAME=value lines of the head's fast node-failure detection
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ray_resilient.testing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    s3 = commands.add_parser("s3-server", help="SeaweedFS serving S3 on loopback, in the foreground")
    s3.add_argument("directory", type=Path)
    s3.add_argument("--bucket", required=True)
    s3.add_argument("--port", type=int, help="the S3 port (default: a free one)")
    s3.add_argument("--timeout", type=float, default=60, help="fail unless the bucket answers within S seconds")
    s3.set_defaults(run=_s3_server)
    wait = commands.add_parser("wait", help="wait until a service answers")
    wait.add_argument("--pid", type=int, help="fail at once when this process exits")
    wait.add_argument("--timeout", type=float, default=60)
    wait.add_argument("kind", choices=("http", "s3", "ray-nodes"))
    wait.add_argument("args", nargs="+")
    wait.set_defaults(run=_wait)
    commands.add_parser("fast-node-failure-env").set_defaults(run=_fast_node_failure_env)
    args = parser.parse_args(argv)
    return args.run(args)


def _s3_server(args: argparse.Namespace) -> int:
    from ray_resilient.testing.s3_server import serve

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exits through serve(), which stops SeaweedFS
    access_key, secret_key = _s3_credentials()
    return serve(args.directory, bucket=args.bucket, port=args.port, timeout=args.timeout, access_key=access_key,
                 secret_key=secret_key)


def _s3_credentials() -> tuple[str, str]:
    try:
        return os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    except KeyError:
        sys.exit("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: the S3 server's credentials")


def _wait(args: argparse.Namespace) -> int:
    from ray_resilient.testing.waiting import wait_until

    answers = _readiness(args.kind, args.args)

    def ready() -> bool:
        if args.pid is not None and not _running(args.pid):
            raise ProcessLookupError(f"process {args.pid} exited")
        return answers()

    try:
        wait_until(ready, args.timeout, f"{args.kind} {' '.join(args.args)}", poll_s=0.5)
    except (TimeoutError, ProcessLookupError) as err:
        print(err, file=sys.stderr)
        return 1
    return 0


def _readiness(kind: str, args: list[str]) -> Callable[[], bool]:
    if kind == "http":
        from ray_resilient.testing.waiting import http_ok

        return lambda: http_ok(*args)
    if kind == "s3":
        from ray_resilient.testing.s3_server import S3Server

        endpoint, bucket = args
        return S3Server(endpoint, *_s3_credentials(), bucket).answers
    from ray_resilient.testing.local_cluster import gcs_alive_node_ids

    gcs_address, count = args
    return lambda: len(gcs_alive_node_ids(gcs_address)) >= int(count)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fast_node_failure_env(args: argparse.Namespace) -> int:
    from ray_resilient._ray_internals import FAST_NODE_FAILURE_DETECTION

    for name, value in FAST_NODE_FAILURE_DETECTION.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
