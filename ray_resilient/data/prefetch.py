"""Prefetching upcoming files into the cache on a thread pool, in plan order, bounded in files and bytes."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ray_resilient.data.cache import FileCache
from ray_resilient.data.volume import Volume

T = TypeVar("T")


@dataclass
class _Slot:
    sample: int
    cached: str | Future[str]  # the cached path, or its download in flight
    pin: int | None

    def path(self) -> str:
        return self.cached if isinstance(self.cached, str) else self.cached.result()

    def cancel(self) -> None:
        if not isinstance(self.cached, str):
            self.cached.cancel()


class Prefetcher:
    """Keeps the next files of a worker's sample stream downloading while the current ones decode.

    The window holds at most ``max_files`` files and ``max_bytes`` bytes (at least one file). Files
    in the window are pinned in the cache until consumed. :meth:`restart` switches to a new stream
    (the next epoch) and keeps whatever of the old window the new one starts with.
    """

    def __init__(self, volume: Volume, cache: FileCache, threads: int, max_files: int, max_bytes: int):
        self.volume, self.cache = volume, cache
        self.max_files, self.max_bytes = max_files, max_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ray_resilient_prefetch")
        self._window: deque[_Slot] = deque()
        self._window_bytes = 0
        self._stream: Iterator[int] = iter(())

    def restart(self, stream: Iterator[int]) -> None:
        """Prefetch ``stream`` from now on, reusing in-flight downloads of its first samples."""
        old = self._window
        self._window, self._window_bytes, self._stream = deque(), 0, stream
        reusable: dict[int, list[_Slot]] = {}
        for slot in old:
            reusable.setdefault(slot.sample, []).append(slot)
        self._fill(reusable)
        for slots in reusable.values():
            for slot in slots:
                slot.cancel()
                self.cache.unpin(slot.pin)

    def read(self, sample: int, reader: Callable[[str], T]) -> T:
        """``reader(cached path)`` of ``sample``, the stream's next one, then unpins it.

        A cache without a limit takes no pins, so another process sharing its directory with a
        limit may evict a file of this window: such a file is downloaded again.
        """
        slot = self._window.popleft()
        if slot.sample != sample:
            raise RuntimeError(f"prefetch stream out of order: expected sample {slot.sample}, asked for {sample}")
        self._window_bytes -= self.volume.files[sample].size
        self._fill({})
        try:
            path = slot.path()
            try:
                return reader(path)
            except Exception:
                if os.path.exists(path):
                    raise
                return reader(self._fetch(sample))
        finally:
            self.cache.unpin(slot.pin)

    def _fill(self, reusable: dict[int, list[_Slot]]) -> None:
        while len(self._window) < self.max_files:
            if self._window and self._window_bytes >= self.max_bytes:
                return
            sample = next(self._stream, None)
            if sample is None:
                return
            reused = reusable.get(sample)
            self._window.append(reused.pop(0) if reused else self._submit(sample))
            self._window_bytes += self.volume.files[sample].size

    def _submit(self, sample: int) -> _Slot:
        file = self.volume.files[sample]
        pin = self.cache.pin(file.path)
        cached = self.cache.lookup(file.path, file.size)
        # a hit is one stat: handing it to a thread would cost more than it
        return _Slot(sample, self._pool.submit(self._fetch, sample) if cached is None else cached, pin)

    def _fetch(self, sample: int) -> str:
        file = self.volume.files[sample]
        return self.cache.fetch(file.path, file.size, lambda dest: self.volume.download(file.path, dest))

    def close(self) -> None:
        for slot in self._window:
            slot.cancel()
            self.cache.unpin(slot.pin)
        self._window.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
