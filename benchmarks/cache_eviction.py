"""Cache misses per second in a full, limited cache of many files: walking the cache at every miss
against ray_resilient's shared byte counter with eviction headroom.

Setup
    One cache directory holding ``--files`` (100,000) files of 1 KiB in 100 subdirectories, its
    ``limit_bytes`` exactly that much, so every miss must evict. The "download" of a miss writes
    1 KiB locally: what is measured is the cache's own cost per miss, not the network's.

Methods (the same cache directory, one after the other)
    walk_every_miss   ``FileCache(evict_headroom=0)``: each miss walks and stats the whole cache
                      under the node-wide lock to find what to evict (what every miss cost before
                      the counter); ``--walk-misses`` (20) misses.
    counter+headroom  ``FileCache()`` (10% headroom): each miss updates the node's byte counter;
                      one miss in about 10,000 walks the cache and evicts 10% of the limit;
                      ``--misses`` (20,000) misses, so that the walks are included.

Prints misses per second of each and their ratio:
``misses_per_second=... walk_misses_per_second=... speedup=...``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from ray_resilient.data import FileCache

KIB = 1024


def fill(directory: str, files: int) -> None:
    for i in range(files):
        path = os.path.join(directory, f"d{i % 100:02d}", f"f{i:06d}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(b"x" * KIB)


def misses_per_second(cache: FileCache, misses: int, first: int) -> float:
    def write(dest: str) -> int:
        with open(dest, "wb") as out:
            out.write(b"y" * KIB)
        return KIB

    started = time.perf_counter()
    for i in range(first, first + misses):
        cache.fetch(f"new/{i:07d}.bin", KIB, write)
    return misses / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--misses", type=int, default=20_000)
    parser.add_argument("--walk-misses", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cache-eviction-") as directory:
        fill(directory, args.files)
        limit = args.files * KIB
        walking = FileCache(directory, limit_bytes=limit, evict_headroom=0.0)
        walk_rate = misses_per_second(walking, args.walk_misses, 0)
        counted = FileCache(directory, limit_bytes=limit)
        rate = misses_per_second(counted, args.misses, args.walk_misses)
        cached = sum(e.stat().st_size for d in os.scandir(directory) if d.is_dir() and not d.name.startswith(".")
                     for e in os.scandir(d.path))
        print(f"{args.files} cached files; walk_every_miss: {walk_rate:.1f} misses/s "
              f"({walking.stats.eviction_walks} walks for {args.walk_misses} misses); counter+headroom: "
              f"{rate:.0f} misses/s ({counted.stats.eviction_walks} walks for {args.misses} misses); "
              f"cached {cached} of {limit} bytes")
        print(f"misses_per_second={rate:.0f} walk_misses_per_second={walk_rate:.1f} speedup={rate / walk_rate:.0f}")


if __name__ == "__main__":
    main()
