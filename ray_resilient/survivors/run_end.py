"""The end of a survivor run: what the lead reports once it trained the last step, which the
membership coordinator passes on to every other process of the run (a member past the last step,
a replacement that joins after it)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """The lead's report: the last step; ``error``, why its final checkpoint could not be made
    durable (None: it is); the steps of the checkpoints every replica registers with Ray, the final
    one last, reported with ``metrics``."""

    step: int
    error: str | None = None
    registrations: tuple[int, ...] = ()
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

