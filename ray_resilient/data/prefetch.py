"""Prefetching upcoming files into the cache, in plan order, bounded in files and bytes."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ray_resilient.data.cache import FileCache
from ray_resilient.data.download_process import DownloadProcess, Fetched
from ray_resilient.data.volume import Volume, VolumeError

T = TypeVar("T")


@dataclass
class _Slot:
    sample: int
    cached: str | int  # the cached path, or the ticket of its download in flight
    pin: int | None


class Prefetcher:
    """Keeps the next files of a worker's sample stream downloading while the current ones decode.

    The window holds at most ``max_files`` files and ``max_bytes`` bytes (at least one file). Files
    in the window are pinned in the cache until consumed. :meth:`restart` switches to a new stream
    (the next epoch) and keeps whatever of the old window the new one starts with. Downloads run
    ``threads`` at a time in a :class:`DownloadProcess`, started at the first cache miss;
    ``on_retry`` is called for each failed read it retries.
    """

    def __init__(self, volume: Volume, cache: FileCache, threads: int, max_files: int, max_bytes: int,
                 on_retry: Callable[[], None] = lambda: None):
        self.volume, self.cache, self.threads, self.on_retry = volume, cache, threads, on_retry
        self.max_files, self.max_bytes = max_files, max_bytes
        self._downloads: DownloadProcess | None = None
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
                self._cancel(slot)

    def read(self, sample: int, reader: Callable[[str], T]) -> T:
        """``reader(cached path)`` of ``sample``, the stream's next one, then unpins it.

        A cache without a limit takes no pins, so another process sharing its directory with a
        limit may evict a file of this window: such a file is downloaded again.
        """
        slot = self._window.popleft()
        if slot.sample != sample:
            raise RuntimeError(f"prefetch stream out of order: expected sample {slot.sample}, asked for {sample}")
        self._window_bytes -= self.volume.files[sample].size
        if self._downloads is not None:
            self._downloads.poll()  # count finished downloads as they finish, not as they are read
        self._fill({})
        try:
            path = self._path(slot)
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
        # a hit is one stat: handing it to the download process would cost more than it
        return _Slot(sample, self._download(file.path, file.size) if cached is None else cached, pin)

    def _download(self, path: str, size: int) -> int:
        if self._downloads is None:
            self._downloads = DownloadProcess(self.volume, self.cache, self.threads, self._count, self.on_retry)
        return self._downloads.submit(path, size)

    def _path(self, slot: _Slot) -> str:
        """The slot's cached path, once its download (if any) is done."""
        if isinstance(slot.cached, str):
            return slot.cached
        assert self._downloads is not None
        fetched = self._downloads.wait(slot.cached)
        if fetched.error is not None:
            raise VolumeError(fetched.error)
        slot.cached = self.cache.path(self.volume.files[slot.sample].path)
        return slot.cached

    def _count(self, fetched: Fetched) -> None:
        stats = self.cache.stats
        if fetched.downloaded:
            stats.misses += 1
            stats.bytes_downloaded += fetched.size
            stats.download_seconds += fetched.seconds
        else:
            stats.hits += 1

    def _fetch(self, sample: int) -> str:
        """Download ``sample`` again now (another process evicted it from an unpinned window)."""
        file = self.volume.files[sample]
        return self._path(_Slot(sample, self._download(file.path, file.size), None))

    def _cancel(self, slot: _Slot) -> None:
        if not isinstance(slot.cached, str) and self._downloads is not None:
            self._downloads.cancel(slot.cached)
        self.cache.unpin(slot.pin)

    def close(self) -> None:
        for slot in self._window:
            self._cancel(slot)
        self._window.clear()
        if self._downloads is not None:
            self._downloads.close()
            self._downloads = None
