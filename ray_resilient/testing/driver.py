"""Ray drivers in processes of their own: a function of an importable module, its log, its result.

A chaos test or benchmark runs its driver apart from itself so that the driver can be killed like
a real one, and so that the driver's Ray connection, environment and crashes stay out of the
process that measures. The function runs as ``function(config)`` in a new Python with the given
environment (e.g. ``LocalRayCluster.env``); its return value comes back as JSON. Because the
module is imported by name, the train functions it hands to Ray are pickled by reference: Ray's
workers import them from the same module (put its folder on the ``PYTHONPATH`` of ``env``).

    python -m ray_resilient.testing.driver MODULE:FUNCTION CONFIG_JSON RESULT_JSON
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LOG_TAIL_CHARS = 4000


class DriverError(RuntimeError):
    """A driver process failed, ran too long, or returned nothing; the message names its log."""


@dataclass
class Driver:
    """A running driver process: its output goes to ``log``, its return value to ``result_file``."""

    name: str
    process: subprocess.Popen
    log: Path
    result_file: Path

    @classmethod
    def start(cls, function: str, config: Mapping[str, Any], *, env: Mapping[str, str], workdir: Path,
              name: str = "driver") -> "Driver":
        """Start ``function`` (``"module:name"``) on ``config`` (JSON-serialisable) in ``workdir``, where
        ``<name>.log``, ``<name>.config.json`` and ``<name>.result.json`` go."""
        workdir = Path(workdir)
        config_file, result_file = workdir / f"{name}.config.json", workdir / f"{name}.result.json"
        config_file.write_text(json.dumps(config))
        result_file.unlink(missing_ok=True)
        log = workdir / f"{name}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, function, str(config_file), str(result_file)],
                env=dict(env), cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
        return cls(name, process, log, result_file)

    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        """What the driver printed so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the driver, as a crashed driver machine would; Ray then stops its actors."""
        self.process.kill()
        self.process.wait()

    def wait(self, timeout: float) -> Any:
        """The function's return value once the driver exits; DriverError naming the log when it failed or
        ran longer than ``timeout`` seconds (then it is killed)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DriverError(f"driver {self.name} still ran after {timeout}s and was killed; see {self.log}") from None
        if self.process.returncode != 0 or not self.result_file.exists():
            raise DriverError(f"driver {self.name} exited with status {self.process.returncode} and no result; "
                              f"see {self.log}, which ends:\n{self.output()[-_LOG_TAIL_CHARS:]}")
        return json.loads(self.result_file.read_text())


def run_driver(function: str, config: Mapping[str, Any], *, env: Mapping[str, str], workdir: Path,
               timeout: float, name: str = "driver") -> Any:
    """Run ``function`` on ``config`` in a driver process (:meth:`Driver.start`) and return its result."""
    return Driver.start(function, config, env=env, workdir=workdir, name=name).wait(timeout)


def _main(function: str, config_file: str, result_file: str) -> None:
    module, _, name = function.partition(":")
    result = getattr(importlib.import_module(module), name)(json.loads(Path(config_file).read_text()))
    Path(result_file).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    _main(*sys.argv[1:])
