"""Progress inside a training step, from hooks on the forward and backward of the model's modules.

So that a long step that is getting on is never taken for a hang, and a rank hung inside one is
found nearly as soon as in a short one (:mod:`.progress`). Up to :data:`TICKING_MODULES` leaf
modules, evenly spread over the model, tick after their forward and when their output's gradient is
computed in the backward pass (a hook on the output tensor: module backward hooks break on in-place
ops such as ResNet's ``ReLU(inplace=True)``). A hook costs about 2 microseconds a call, so a step
pays for about 32 ticks however large the model (a module it calls twice ticks twice), and its
longest stretch without progress stays a small share of it (the optimizer step and the data wait
fall between two ticks; the data loader's own progress is counted apart). This works the same on a
plain module, under ``DistributedDataParallel`` and under FSDP2 (``fully_shard``). Inside a
``torch.compile``'d graph the hooks do nothing (no graph break): a compiled model's forward and
backward count as one stretch. A compilation itself (the first step, and a recompile wherever a
guard fails: an epoch's last partial batch, the first batch in ``eval()``) is allowed
``startup_allowance_s`` (:func:`hold_during_compilations`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from ray_resilient._torch_internals import on_compilations
from ray_resilient.watchdog.progress import ProgressReporter

TICKING_MODULES = 16


def tick_inside_steps(model: torch.nn.Module, tick: Callable[[], None]) -> list[RemovableHandle]:
    """Register hooks that call ``tick`` as ``model``'s forward and backward passes progress;
    their handles (``remove()`` each to stop)."""

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        tick()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: tick())

    leaves = [module for module in model.modules() if next(module.children(), None) is None]
    spread = sorted({len(leaves) * i // TICKING_MODULES for i in range(TICKING_MODULES)}) if leaves else []
    return [leaves[i].register_forward_hook(after_forward) for i in spread]


def hold_during_compilations(reporter: ProgressReporter) -> Callable[[], None]:
    """Allow each ``torch.compile`` compilation in this process the reporter's
    ``startup_allowance_s`` without progress; a function that stops it."""
    return on_compilations(lambda: reporter.hold("compiling", reporter.config.startup_allowance_s),
                           reporter.release)
