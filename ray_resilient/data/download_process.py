"""A worker's downloads into the cache, run in a process of their own.

Downloading a small file costs the client CPU in Python (signing, the HTTP exchange, parsing
headers). On threads beside the decoding in a DataLoader worker, every download contends with
decoding and augmentation for the GIL, and each torch op's release of the GIL hands it to a
download thread: on 2 cores, a batch of 64 small JPEGs decoded 3-4x slower with 16 download
threads in its process than with them in another process (benchmarks/data_throughput.py).

So each :class:`~ray_resilient.data.prefetch.Prefetcher` hands its downloads to a child
process, a fresh interpreter that imports only what downloading needs (pyarrow, botocore,
urllib3: not torch or Ray), runs ``threads`` downloads at a time, and runs at a lower CPU
priority (:data:`NICENESS`) than the worker. They talk over a socket pair (a ``multiprocessing``
connection each end): ``("fetch", ticket, path, size)`` and ``("cancel", ticket)`` one way, a
:class:`Fetched` per ticket the other, and a :class:`Retrying` each time a failed read of a ticket
is retried (the parent counts it as progress, for the hang watchdog). The child exits once its
parent closes the socket or dies (it reads end of file), after finishing the downloads it
started: a file is complete in the cache or not there (see :mod:`ray_resilient.data.cache`).
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import NamedTuple

from ray_resilient.data.cache import FileCache
from ray_resilient.data.volume import Volume, VolumeError

_CLOSE_TIMEOUT_S = 30.0
# The child's CPU priority, below its parent's: its downloads are work ahead of need, while the
# parent's decoding is what the training loop waits for. When the parent waits for a download it
# leaves its CPU to the child; on a saturated node the child gets about a tenth of a core's
# share against each busy decoder (Linux CFS weights 110 against 1024).
NICENESS = 10


class Fetched(NamedTuple):
    """The outcome of one ticket: an error message, or whether it was downloaded and how."""

    ticket: int
    error: str | None
    downloaded: bool  # False: another process had cached the file meanwhile
    size: int
    seconds: float


class Retrying(NamedTuple):
    """A failed read of ``ticket``'s file is being retried."""

    ticket: int


class DownloadProcess:
    """The parent's end: submit files, receive their outcomes, cancel the ones no longer wanted.

    Every outcome received goes to ``on_fetched`` (cache statistics), and every retry to
    ``on_retry``, whether received by :meth:`wait` or by :meth:`poll`. Not thread-safe: one
    consumer (a worker's iteration) drives it.
    """

    def __init__(self, volume: Volume, cache: FileCache, threads: int, on_fetched: Callable[[Fetched], None],
                 on_retry: Callable[[], None] = lambda: None):
        self.volume, self.on_fetched, self.on_retry = volume, on_fetched, on_retry
        parent, child = socket.socketpair()
        with child:
            self._proc = subprocess.Popen(_child_command(child.fileno()), pass_fds=(child.fileno(),),
                                          stdin=subprocess.DEVNULL)
        self._conn = Connection(parent.detach())
        self._tickets = itertools.count()
        self._pending: set[int] = set()
        self._done: dict[int, Fetched] = {}
        # the child sets sys.path before unpickling, so the volume's filesystem classes import there too
        self._conn.send((list(sys.path), pickle.dumps((volume, cache.directory, cache.limit_bytes, threads))))

    def submit(self, path: str, size: int) -> int:
        """Start fetching ``path`` (``size`` bytes) into the cache; returns its ticket."""
        ticket = next(self._tickets)
        self._pending.add(ticket)
        self._conn.send(("fetch", ticket, path, size))
        return ticket

    def cancel(self, ticket: int) -> None:
        """Forget ``ticket``; the child skips it unless its download has started."""
        if ticket in self._pending:
            self._pending.discard(ticket)
            self._conn.send(("cancel", ticket))
        self._done.pop(ticket, None)

    def poll(self) -> None:
        """Receive the outcomes that have arrived, without blocking."""
        while self._pending and self._conn.poll():
            self._receive()

    def wait(self, ticket: int) -> Fetched:
        """Block until ``ticket`` is fetched; its outcome."""
        while ticket not in self._done:
            self._receive()
        return self._done.pop(ticket)

    def _receive(self) -> None:
        try:
            fetched: Fetched | Retrying = self._conn.recv()
        except (EOFError, OSError) as err:
            code = self._proc.poll()
            raise VolumeError(f"the download process for {self.volume.uri} exited (code {code}; its errors "
                              f"are on this worker's stderr): {err!r}") from err
        if isinstance(fetched, Retrying):
            self.on_retry()
        elif fetched.ticket in self._pending:  # else: cancelled meanwhile
            self._pending.discard(fetched.ticket)
            self._done[fetched.ticket] = fetched
            self.on_fetched(fetched)

    def close(self) -> None:
        """Let the child finish the downloads it started, then exit."""
        self._conn.close()
        try:
            self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _child_command(fd: int) -> list[str]:
    """The child's command line: a fresh interpreter importing only this module's dependencies
    (the package's lazy ``__init__`` imports neither torch nor Ray)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ray_resilient/
    code = f"import sys; sys.path.insert(0, {root!r}); from ray_resilient.data.download_process import serve; serve({fd})"
    return [sys.executable, "-c", code]


def serve(fd: int) -> None:
    """The child: fetch what the parent asks for on ``threads`` threads until it hangs up."""
    conn = Connection(fd)
    os.nice(NICENESS)
    sys_path, setup = conn.recv()
    sys.path[:] = sys_path
    volume, directory, limit_bytes, threads = pickle.loads(setup)
    cache = FileCache(directory, limit_bytes)
    send_lock, futures_lock = threading.Lock(), threading.Lock()
    futures: dict[int, Future[None]] = {}  # submitted and not finished

    def send(message: Fetched | Retrying) -> None:
        with send_lock:
            try:
                conn.send(message)
            except OSError:
                pass  # the parent is gone; the file is cached (or not) all the same

    def fetch(ticket: int, path: str, size: int) -> None:
        started = time.monotonic()
        error, downloaded = None, False
        try:
            if cache.lookup(path, size) is None:
                cache.fetch(path, size, lambda dest: volume.download(path, dest, lambda: send(Retrying(ticket))))
                downloaded = True
        except Exception as err:  # noqa: BLE001 - every failure goes back to the parent, named
            error = str(err) if isinstance(err, VolumeError) else f"caching {volume.uri}/{path} failed: {err!r}"
        with futures_lock:
            futures.pop(ticket, None)
        send(Fetched(ticket, error, downloaded, size, time.monotonic() - started))

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ray_resilient_download") as pool:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            with futures_lock:
                if message[0] == "fetch":
                    _, ticket, path, size = message
                    futures[ticket] = pool.submit(fetch, ticket, path, size)
                elif (future := futures.pop(message[1], None)) is not None:
                    future.cancel()
        with futures_lock:
            for future in futures.values():
                future.cancel()
