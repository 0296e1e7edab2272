"""The hang watchdog: an actor outside every rank that declares a rank hung and kills it.

Each rank keeps one TCP connection to it
(:class:`~ray_resilient.watchdog.progress.ProgressReporter`). Once no rank's progress counter has
moved for longer than the attempt's allowance, the attempt is hung: a stuck collective, a hung
filesystem, a process stopped by its host or a lost node (in data-parallel training the others soon
stall too, waiting for it in their collectives; while one rank still progresses, e.g. rank 0
evaluating while the others wait for it, nothing is hung). The attempt's allowance is the smallest
of the ranks' step allowances (a stretch in which no rank progressed is one every rank saw among its
own steps' stretches: a rank that waited for rank 0's evaluations has a larger allowance, which says
nothing of how long the attempt may stand still), or a rank's own phase allowance (a restore, its
first steps, a save) if that is larger: the others may be waiting for it. The watchdog then names
one culprit: a rank that went silent (its heartbeats stopped: stopped, or its node lost) before one
that still answers, and among those the one whose progress stopped first. It knows every rank of the
attempt from its creation (rank 0 passes their identities), so the ranks train on while its process
starts, off the recovery's critical path: a rank that never reached it (stopped, or its node lost,
meanwhile) counts as silent, without progress, since the watchdog started. It asks for the culprit's
Python stack (not a silent one's: it would not answer), logs an error naming the rank, its host, its
phase and the stack, records a ``hang`` event in the run's goodput ledger (from the last progress to
now), and SIGKILLs the process and its DataLoader workers (itself on its own node, else through a
task on the rank's node); the others' broken collectives end the attempt. Ray Train then restarts
the worker group as for a crash, seconds after the hang instead of after its worker health-check
timeout (600 s by default).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_resilient.goodput.events import EventKind
from ray_resilient.goodput.ledger import LedgerWriter
from ray_resilient.storage.run import RunStorage

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.25
SILENT_S = 1.5  # a rank that sent nothing for this long has stopped (6 heartbeats missed)
FIND_TIMEOUT_S = 60.0  # how long a rank looks for the watchdog rank 0 just created
STACK_WAIT_S = 1.0  # how long a hung rank's own thread may take to send its stack
WATCHDOG_RANK = -2  # the ledger's rank of the watchdog's events


@dataclass
class _Rank:
    identity: dict[str, Any]  # rank, pid, node_id, host
    writer: asyncio.StreamWriter | None  # None: never reached the watchdog
    progress: int = -1
    allowance: float = math.inf  # until it reports one
    own_phase: bool = False  # the allowance is its phase's (restore, warm-up, save), not its steps'
    phase: str = "start"
    changed: float = field(default_factory=time.monotonic)  # when its progress last moved
    heard: float = field(default_factory=time.monotonic)  # when it last sent anything
    stack: asyncio.Future | None = None


def watchdog_address(name: str) -> tuple[str, int]:
    """Where the watchdog actor ``name`` listens (waits for rank 0 to have created it)."""
    deadline = time.monotonic() + FIND_TIMEOUT_S
    while True:
        try:
            return ray.get(ray.get_actor(name).start.remote(), timeout=FIND_TIMEOUT_S)
        except ValueError:  # not registered yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _kill_rank(pid: int) -> None:
    """SIGKILL the rank ``pid`` and, when it leads its own process group (a Ray worker does), the
    group: its DataLoader workers hold copies of its sockets, so the other ranks would see its
    collectives' connections close only when those workers noticed their parent gone (5 s later)."""
    if os.getpgid(pid) == pid:
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)


_kill_rank_on_its_node = ray.remote(num_cpus=0)(_kill_rank)


@ray.remote(num_cpus=0)
class HangWatchdog:
    """One attempt's watchdog (see the module docstring); ``storage``: the run's, for the ledger;
    ``ranks``: the identities of the attempt's ranks (rank, pid, host, node_id)."""

    def __init__(self, storage: RunStorage, ranks: Sequence[dict[str, Any]] = ()):
        self._storage = storage
        self._ranks: dict[int, _Rank] = {}
        # Ranks not heard yet: silent, allowed nothing, since the watchdog started.
        self._absent = {r["rank"]: _Rank(r, None, phase="start") for r in ranks}
        self._declared: list[dict[str, Any]] = []
        self._server: asyncio.base_events.Server | None = None
        self._starting = asyncio.Lock()  # every rank calls start(), at once
        self._checker: asyncio.Task | None = None

    async def start(self) -> tuple[str, int]:
        """Start listening (once); the host and port the ranks connect to."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, ray.util.get_node_ip_address(), 0)
                self._checker = asyncio.get_running_loop().create_task(self._check())
        return ray.util.get_node_ip_address(), self._server.sockets[0].getsockname()[1]

    def heard(self) -> list[int]:
        """The ranks connected now."""
        return sorted(self._ranks)

    def declared(self) -> list[dict[str, Any]]:
        """The hangs declared so far."""
        return list(self._declared)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity = json.loads(await reader.readline())
        rank = _Rank(identity, writer)
        self._absent.pop(identity["rank"], None)
        self._ranks[identity["rank"]] = rank
        try:
            while line := await reader.readline():
                message = json.loads(line)
                rank.heard = time.monotonic()
                if "stack" in message:
                    if rank.stack is not None and not rank.stack.done():
                        rank.stack.set_result(message["stack"])
                    continue
                if message["p"] != rank.progress:
                    rank.progress, rank.changed = message["p"], time.monotonic()
                rank.allowance, rank.phase, rank.own_phase = message["a"], message["ph"], message["own"]
        except (ConnectionError, ValueError):
            pass
        finally:  # the process ended (or died: Ray sees that itself)
            if self._ranks.get(identity["rank"]) is rank:
                del self._ranks[identity["rank"]]
            writer.close()

    async def _check(self) -> None:
        """Declare one culprit once no rank progressed for the attempt's allowance (see the module docstring)."""
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            now = time.monotonic()
            ranks = [*self._ranks.values(), *self._absent.values()]
            allowed = max([min((r.allowance for r in self._ranks.values() if not r.own_phase), default=0.0),
                           *(r.allowance for r in self._ranks.values() if r.own_phase)])
            if not self._ranks or not all(now - rank.changed > allowed for rank in ranks):
                continue
            culprit = min(ranks, key=lambda r: (now - r.heard <= SILENT_S, r.changed))
            others = ", ".join(
                f"rank {r.identity['rank']} {'silent' if now - r.heard > SILENT_S else 'answering'}, no progress "
                f"for {now - r.changed:.1f} s" for r in ranks if r is not culprit)
            await self._declare(culprit, now - culprit.changed, allowed, others or "no other rank connected")
            return  # its death ends the attempt

    async def _declare(self, rank: _Rank, age: float, allowed: float, others: str) -> None:
        who = rank.identity
        if rank.writer is None:
            stalled = f"never reached the watchdog, started {age:.1f} s ago"
            doing = "; it does not answer (stopped, or its node lost, before it could reach the watchdog)"
        else:
            stalled = f"made no progress for {age:.1f} s (allowed {allowed:.1f} s) in {rank.phase!r}"
            doing = "; it does not answer (stopped, or its node is lost)"
        if rank.writer is not None and time.monotonic() - rank.heard <= SILENT_S:  # it may still answer
            rank.stack = asyncio.get_running_loop().create_future()
            try:
                rank.writer.write(b"stack\n")
                await rank.writer.drain()
                doing = f"; its training thread is at:\n{await asyncio.wait_for(rank.stack, STACK_WAIT_S)}"
            except (asyncio.TimeoutError, ConnectionError):
                pass
        message = (f"rank {who['rank']} on {who['host']} (pid {who['pid']}) {stalled}: declared hung, killing it so "
                   f"that Ray restarts the worker group ({others}){doing}")
        logger.error("%s", message)
        now = time.time()
        record = {"hung_rank": who["rank"], "host": who["host"], "pid": who["pid"], "phase": rank.phase,
                  "error": message[:4000]}
        self._declared.append({**record, "t": now, "t_start": now - age})
        ledger = LedgerWriter(self._storage, WATCHDOG_RANK)
        ledger.record(EventKind.HANG, t=now, t_start=now - age, **record)
        ledger.close()
        if rank.writer is not None:
            rank.writer.close()
        try:
            if who["node_id"] == ray.get_runtime_context().get_node_id():
                _kill_rank(who["pid"])  # at once: a task may wait seconds for a worker process
            else:
                await _kill_rank_on_its_node.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(who["node_id"], soft=False)).remote(who["pid"])
        except Exception:  # noqa: BLE001 - gone already (its node too): Ray sees that itself
            logger.warning("Could not kill the hung rank %s", who["rank"], exc_info=True)
