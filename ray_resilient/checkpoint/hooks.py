"""What the checkpointer asks of the objects around it, declared (typing protocols)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


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


class AttemptHook(Protocol):
    """Called by the checkpointer at points of an attempt (e.g. starting spare workers once it trains)."""

    def first_step(self) -> None:
        """The attempt completed its first step (after the restore): it is training."""
        ...
