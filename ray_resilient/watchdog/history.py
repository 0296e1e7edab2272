"""Where earlier attempts of a run hung: the steps at which the hang watchdog declared a rank hung.

A pause that recurs at a fixed step (an epoch's last partial batch recompiling, the first
validation) would be declared in every attempt that reaches it: a crash loop until
``max_failures``. Each declaration at a step doubles the allowances of later attempts there, so
such a pause costs one restart (two for a pause four times the allowance), not the run.
"""

from __future__ import annotations

import json
from collections import Counter

from ray_resilient.storage.run import RunStorage

MAX_DOUBLINGS = 10  # a step's allowance grows at most 1024-fold


class HangHistory:
    """The run's steps at which the watchdog declared a rank hung, and how often
    (``<run dir>/watchdog/hangs.json``): each declaration there doubles the allowances of later
    attempts at that step."""

    def __init__(self, storage: RunStorage | None):
        self._storage = storage
        self.hangs: Counter[int] = Counter()

    @property
    def _path(self) -> str:
        return f"{self._storage.experiment_path}/watchdog/hangs.json"

    def load(self) -> None:
        """Read the run's history (none yet: empty)."""
        try:
            with self._storage.filesystem.open_input_stream(self._path) as stream:
                self.hangs = Counter({int(step): int(n) for step, n in json.loads(stream.read()).items()})
        except FileNotFoundError:
            pass

    def add(self, step: int) -> None:
        """Count a declaration at ``step`` and write the history back."""
        self.hangs[step] += 1
        filesystem = self._storage.filesystem
        filesystem.create_dir(self._path.rsplit("/", 1)[0])
        with filesystem.open_output_stream(self._path) as stream:
            stream.write(json.dumps(self.hangs).encode())

    def factor(self, step: int | None) -> float:
        """How many times its allowance a rank gets at ``step`` (at most ``2 ** MAX_DOUBLINGS``)."""
        return 2.0 ** min(self.hangs.get(step, 0), MAX_DOUBLINGS) if step is not None else 1.0
