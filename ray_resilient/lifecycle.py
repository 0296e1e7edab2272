"""The points of an attempt the checkpoint loop announces, the features that plug into them, and
what the loop asks of the objects around it (typing protocols).

The loop (:mod:`~ray_resilient.checkpoint.loop`) fires them in both modes: the attempt started (its
ranks, group and identity), the training thread entered a phase (the restore, training, a save's
staging, waiting for saves), a step finished, the attempt ended. A feature that acts at those points
(the hang watchdog, spare workers) is a :class:`LifecycleHook`: it overrides the points it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the lifecycle imports neither torch nor the storage
    import torch
    import torch.distributed as dist

    from ray_resilient.storage.run import RunStorage


@runtime_checkable
class DataWaitSource(Protocol):
    """A data position that also says how long the loop waited for data (a
    :class:`~ray_resilient.data.VolumeDataLoader`): the goodput ledger counts that wait apart
    from productive step time."""

    @property
    def fetch_seconds(self) -> float:
        """Seconds the training loop has waited for batches so far (monotonic)."""
        ...


@runtime_checkable
class DataProgressSource(Protocol):
    """A data position whose loading shows progress while the loop waits for it (a
    :class:`~ray_resilient.data.VolumeDataLoader`): the hang watchdog counts each sample its
    worker processes read, and each failed read they retry, as progress, so a slow or flaky volume
    that is getting on is not a hang."""

    @property
    def loading_progress(self) -> int:
        """Samples read plus failed reads retried so far, in every worker process (monotonic)."""
        ...


STARTUP = "startup"  # a phase's allowance: the hook's allowance for startup work (restore, compile, final save)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """An attempt of the run as it starts on this rank.

    Args:
        rank, world_size: this rank's place in the attempt's group.
        group: a gloo group of the attempt's ranks for the hooks' own exchanges at
            :meth:`LifecycleHook.attempt_started` (None for a one-rank attempt).
        identities: every rank's identity, in rank order: ``rank``, ``pid``, ``host``, ``node_id``
            and ``token`` (unique to the process).
        storage: the run's storage.
        model: the model the loop checkpoints.
        data: the data position it checkpoints (None: none).
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    identities: tuple[dict[str, Any], ...]
    storage: RunStorage
    model: torch.nn.Module
    data: Any = None


class LifecycleHook:
    """A feature plugged into the loop's lifecycle; each point does nothing unless overridden."""

    def attempt_started(self, attempt: Attempt) -> None:
        """The attempt started: every rank calls it at the same point (the hooks may exchange on its group)."""

    def phase(self, name: str, allowance: float | str | None = None) -> None:
        """The training thread began ``name``: bounded by ``allowance`` seconds, :data:`STARTUP`
        (startup work) or None (what the hook has learned of steps)."""

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        """The training thread began staging a save (``previous_stall_s``: the last one's, None for the first)."""

    def hold(self, name: str, allowance_s: float) -> None:
        """The training thread waits, at most ``allowance_s``, for something bounded elsewhere (the saves in flight)."""

    def release(self) -> None:
        """The wait of :meth:`hold` ended."""

    def tick(self) -> None:
        """Progress inside a phase (each tensor a save stages)."""

    def step_finished(self, step: int) -> None:
        """The run's step ``step`` finished on this rank."""

    def attempt_ended(self, failed: bool) -> None:
        """The attempt ended on this rank (``failed``: with an error)."""


class Lifecycle:
    """The hooks of one loop, called in order at each point."""

    def __init__(self, hooks: Sequence[LifecycleHook] = ()):
        for hook in hooks:
            if not isinstance(hook, LifecycleHook):
                raise TypeError(f"hooks must be LifecycleHook instances, got {type(hook).__name__}")
        self.hooks = tuple(hooks)
        self._ticking = [hook.tick for hook in self.hooks if type(hook).tick is not LifecycleHook.tick]

    def attempt_started(self, attempt: Attempt) -> None:
        for hook in self.hooks:
            hook.attempt_started(attempt)

    def phase(self, name: str, allowance: float | str | None = None) -> None:
        for hook in self.hooks:
            hook.phase(name, allowance)

    def saving(self, name: str, previous_stall_s: float | None) -> None:
        for hook in self.hooks:
            hook.saving(name, previous_stall_s)

    @contextmanager
    def holding(self, name: str, allowance_s: float) -> Iterator[None]:
        """:meth:`LifecycleHook.hold` for the ``with`` block."""
        for hook in self.hooks:
            hook.hold(name, allowance_s)
        try:
            yield
        finally:
            for hook in self.hooks:
                hook.release()

    @property
    def tick(self) -> Callable[[], None] | None:
        """What a save calls per tensor staged; None when no hook counts ticks."""
        if not self._ticking:
            return None
        if len(self._ticking) == 1:
            return self._ticking[0]
        ticking = self._ticking

        def tick() -> None:
            for each in ticking:
                each()

        return tick

    def step_finished(self, step: int) -> None:
        for hook in self.hooks:
            hook.step_finished(step)

    def attempt_ended(self, failed: bool) -> None:
        """Every hook's, even after one raised (the first error is raised after)."""
        error: BaseException | None = None
        for hook in self.hooks:
            try:
                hook.attempt_ended(failed)
            except BaseException as err:  # noqa: BLE001 - the other hooks still end
                error = error or err
        if error is not None:
            raise error
