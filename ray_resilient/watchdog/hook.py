"""The hang watchdog as a feature of the checkpoint loop's lifecycle
(:class:`~ray_resilient.lifecycle.LifecycleHook`).

At the attempt's start rank 0, given every rank's identity (rank, pid, host, node), starts the
attempt's :class:`~ray_resilient.watchdog.monitor.HangWatchdog` actor (and owns it); every rank then
reports its progress to it (:class:`~ray_resilient.watchdog.progress.ProgressReporter`), counting the model's forward and backward (module hooks), each tensor a save stages, each sample
the data loader reads, and holding during ``torch.compile``'s compilations. The loop's phases set
what a rank is allowed without progress. At the attempt's end the reporter says goodbye and rank
0 kills the actor.
"""

from __future__ import annotations

from typing import Any

import ray

from ray_resilient.lifecycle import STARTUP, Attempt, DataProgressSource, LifecycleHook
from ray_resilient.spare_workers import helper_runtime_env
from ray_resilient.watchdog.monitor import HangWatchdog, watchdog_address
from ray_resilient.watchdog.progress import HangWatchdogConfig, ProgressReporter
from ray_resilient.watchdog.step_hooks import hold_during_compilations, tick_inside_steps


class HangWatchdogHook(LifecycleHook):
    """This rank's part of the attempt's hang watchdog (see the module docstring)."""

    def __init__(self, config: HangWatchdogConfig):
        self.config = config
        self._actor: Any = None
        self._reporter: ProgressReporter | None = None
        self._module_hooks: list[Any] = []
        self._stop_compile_holds: Any = None

    def attempt_started(self, attempt: Attempt) -> None:
        identities = [{key: value for key, value in identity.items() if key != "token"}
                      for identity in attempt.identities]
        name = f"ray_resilient_watchdog_{attempt.identities[0]['token']}"  # rank 0's process: this attempt's
        if attempt.rank == 0:
            self._actor = HangWatchdog.options(name=name, runtime_env=helper_runtime_env()).remote(
                attempt.storage, identities, silent_floor_s=self.config.silent_floor_s)
        data = attempt.data
        sources = [lambda: data.loading_progress] if isinstance(data, DataProgressSource) else []
        self._reporter = ProgressReporter(self.config, lambda: watchdog_address(name), identities[attempt.rank],
                                          sources)
        self._module_hooks = tick_inside_steps(attempt.model, self._reporter.tick)
        self._stop_compile_holds = hold_during_compilations(self._reporter)

    def phase(self, name: str, allowance: float | str | None = None) -> None:
        if self._reporter is not None:
            self._reporter.phase(name, self.config.startup_allowance_s if allowance == STARTUP else allowance)

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        if self._reporter is not None:
            self._reporter.saving(name, previous_stall_s)

    def hold(self, name: str, allowance_s: float) -> None:
        if self._reporter is not None:
            self._reporter.hold(name, allowance_s)

    def release(self) -> None:
        if self._reporter is not None:
            self._reporter.release()

    def tick(self) -> None:
        if self._reporter is not None:
            self._reporter.tick()

    def step_finished(self, step: int) -> None:
        if self._reporter is not None:
            self._reporter.step(step)

    def attempt_ended(self, failed: bool) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        if self._stop_compile_holds is not None:
            self._stop_compile_holds()
            self._stop_compile_holds = None
        if self._reporter is not None:
            self._reporter.close(failed)
            self._reporter = None
        if self._actor is not None:
            ray.kill(self._actor)
            self._actor = None
