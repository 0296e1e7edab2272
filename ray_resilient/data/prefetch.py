"""Prefetching upcoming files into the cache on a thread pool, in plan order, bounded in files and bytes."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ray_resilient.data.cache import FileCache
from ray_resilient.data.volume import Volume


@dataclass
class _Slot:
    sample: int
    future: Future[str]
    pin: int


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
                slot.future.cancel()
                self.cache.unpin(slot.pin)

    def next_path(self, sample: int) -> tuple[str, int]:
        """The cached path of ``sample`` (the stream's next one) and its pin, to :meth:`release`."""
        slot = self._window.popleft()
        if slot.sample != sample:
            raise RuntimeError(f"prefetch stream out of order: expected sample {slot.sample}, asked for {sample}")
        self._window_bytes -= self.volume.files[sample].size
        try:
            return slot.future.result(), slot.pin
        finally:
            self._fill({})

    def release(self, pin: int) -> None:
        self.cache.unpin(pin)

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
        if cached is None:
            future = self._pool.submit(self.cache.fetch, file.path, file.size,
                                       lambda dest, path=file.path: self.volume.download(path, dest))
        else:  # a hit is one stat: handing it to a thread would cost more than it
            future = Future()
            future.set_result(cached)
        return _Slot(sample, future, pin)

    def close(self) -> None:
        for slot in self._window:
            slot.future.cancel()
            self.cache.unpin(slot.pin)
        self._window.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
