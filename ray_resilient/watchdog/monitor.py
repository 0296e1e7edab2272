"""The hang watchdog: an actor outside every rank that declares a rank hung and kills it.

Each rank keeps one TCP connection to it
(:class:`~ray_resilient.watchdog.progress.ProgressReporter`), opened with the attempt's secret
(the actor makes it; a rank gets it through Ray with the address), as the process rank 0 named for
that rank: any other connection is refused. The watchdog judges two ways:

- **Silent.** A connected rank whose heartbeats stopped (the process stopped, its node lost) is
  declared once its silence exceeds the :class:`~.silence.SilenceRule` of this attempt's
  heartbeats: 2 s on a quiet machine, more where a loaded one starves live processes (a starved
  process is late, not silent). A silent rank on the watchdog's node whose process is runnable or
  used CPU since last looked at (``/proc``: starved of CPU, or its training thread holding Python's
  GIL in a long C call, so that its heartbeat thread cannot run) is alive, not stopped: it is
  judged by its progress, as below. The watchdog skips a round when its own loop ran late:
  heartbeats may be waiting unread.
- **Without progress.** Once no rank's progress counter has moved for longer than the attempt's
  allowance, the attempt is hung: a stuck collective, a hung filesystem (in data-parallel training
  the others soon stall too, waiting for it; while one rank still progresses, e.g. rank 0
  evaluating while the others wait for it, nothing is hung). The attempt's allowance is the
  smallest of the ranks' step allowances (a stretch in which no rank progressed is one every rank
  saw among its own steps' stretches), or a rank's own phase allowance (a restore, its first steps,
  a save, a compile, a wait the library bounds) if that is larger: the others may be waiting for
  it. A rank that never reached the watchdog (stopped, or its node lost, before it could) counts
  as without progress since the watchdog started. At a step where earlier attempts were declared
  hung, every allowance is doubled once for each such declaration (:mod:`.history`): a pause
  that recurs at a fixed step (an epoch's last batch, the first validation) costs one restart, not
  a crash loop.

A death is not a hang: a rank whose connection closes without a goodbye (killed, out of memory)
or that says goodbye failing means the attempt is failing, and Ray restarts it; the watchdog
stops judging (the survivors wait for the dead rank in their collectives, which is no hang of
theirs). A rank that says goodbye done is no longer judged.

Declaring names one culprit: a silent rank first, and among those without progress the one whose
progress stopped first. The watchdog asks for its Python stack (not a silent one's: it would not
answer), logs an error naming the rank, its host, its phase and the stack, SIGKILLs the process and
its DataLoader workers (itself on its own node, else through a task on the rank's node), and only
then records a ``hang`` event in the run's goodput ledger and the step in the hang history, from a
thread, bounded in time and logged if it fails: the kill never waits on the run's storage. The
others' broken collectives end the attempt, and Ray Train restarts the worker group as for a
crash, seconds after the hang instead of after its worker health-check timeout (600 s by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
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
from ray_resilient.watchdog.history import HangHistory
from ray_resilient.watchdog.progress import HangWatchdogConfig
from ray_resilient.watchdog.silence import SilenceRule

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.25  # at most; sooner when a rank's silence is about to exceed the threshold
LATE_S = 0.5  # a check this much later than due: the watchdog itself was starved, skip it
FIND_TIMEOUT_S = 60.0  # how long a rank looks for the watchdog rank 0 just created
STACK_WAIT_S = 1.0  # how long a hung rank's own thread may take to send its stack
RECORD_TIMEOUT_S = 30.0  # how long recording a declared hang may take (the kill is done by then)
WATCHDOG_RANK = -2  # the ledger's rank of the watchdog's events


@dataclass
class _Rank:
    identity: dict[str, Any]  # rank, pid, node_id, host
    writer: asyncio.StreamWriter | None  # None: never reached the watchdog
    progress: int = -1
    allowance: float = math.inf  # until it reports one
    own_phase: bool = False  # the allowance is its phase's (restore, warm-up, save), not its steps'
    phase: str = "start"
    step: int | None = None  # the run's step it last finished
    changed: float = field(default_factory=time.monotonic)  # when its progress last moved
    heard: float = field(default_factory=time.monotonic)  # when it last sent anything
    cpu_ticks: int | None = None  # its process's CPU time when last looked at while silent
    stack: asyncio.Future | None = None


def _cpu_state(pid: int) -> tuple[bool, int] | None:
    """Whether process ``pid`` of this node is runnable, and its CPU time in ticks; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            stat = stream.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # from the state on: its name may hold spaces
    return fields[0] == "R", int(fields[11]) + int(fields[12])  # state; utime + stime


def watchdog_address(name: str) -> tuple[str, int, str]:
    """Where the watchdog actor ``name`` listens and its secret (waits for rank 0 to have created it)."""
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
    """One attempt's watchdog (see the module docstring); ``storage``: the run's, for the ledger
    and the hang history; ``ranks``: the identities of the attempt's ranks (rank, pid, host,
    node_id): a rank it knows is accepted from its own process only; ``silent_floor_s``: the
    silence that declares a rank on a quiet machine."""

    def __init__(self, storage: RunStorage | None, ranks: Sequence[dict[str, Any]] = (),
                 silent_floor_s: float = HangWatchdogConfig.silent_floor_s):
        self._storage = storage
        self._secret = secrets.token_hex(16)
        self._silence = SilenceRule(silent_floor_s)
        self._known = {r["rank"]: r for r in ranks}
        self._ranks: dict[int, _Rank] = {}
        # Ranks not heard yet: allowed nothing, since the watchdog started.
        self._absent = {r["rank"]: _Rank(r, None, phase="start") for r in ranks}
        self._declared: list[dict[str, Any]] = []
        self._failing: str | None = None  # why the attempt is failing: nothing is judged any more
        self._history = HangHistory(storage)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._server: asyncio.base_events.Server | None = None
        self._starting = asyncio.Lock()  # every rank calls start(), at once
        self._checker: asyncio.Task | None = None

    async def start(self) -> tuple[str, int, str]:
        """Start listening (once); the host and port the ranks connect to, and the secret they show."""
        async with self._starting:
            if self._server is None:
                if self._storage is not None:
                    try:
                        await asyncio.wait_for(asyncio.to_thread(self._history.load), RECORD_TIMEOUT_S)
                    except Exception:  # noqa: BLE001 - judged without it: no allowance doubled
                        logger.warning("Could not read the run's hang history", exc_info=True)
                self._server = await asyncio.start_server(self._serve, ray.util.get_node_ip_address(), 0)
                self._checker = asyncio.get_running_loop().create_task(self._check())
        return ray.util.get_node_ip_address(), self._server.sockets[0].getsockname()[1], self._secret

    def heard(self) -> list[int]:
        """The ranks connected now."""
        return sorted(self._ranks)

    def declared(self) -> list[dict[str, Any]]:
        """The hangs declared so far."""
        return list(self._declared)

    def failing(self) -> str | None:
        """Why the watchdog stopped judging (a rank died or failed), or None."""
        return self._failing

    def silence_threshold(self) -> float:
        """How long a connected rank may send nothing before it counts as stopped."""
        return self._silence.threshold_s

    def _admits(self, identity: dict[str, Any]) -> bool:
        if not secrets.compare_digest(str(identity.get("secret", "")), self._secret):
            return False
        known = self._known.get(identity.get("rank"))
        return (isinstance(identity.get("rank"), int) and all(k in identity for k in ("pid", "host", "node_id"))
                and (known is None or all(identity.get(k) == known[k] for k in ("pid", "node_id"))))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            identity = json.loads(await reader.readline())
        except (ConnectionError, ValueError):
            identity = {}
        if not isinstance(identity, dict) or not self._admits(identity):
            logger.warning("Refused a connection to the hang watchdog from %s: not a rank of this attempt",
                           writer.get_extra_info("peername"))
            writer.close()
            return
        identity = {k: v for k, v in identity.items() if k != "secret"}
        rank = _Rank(identity, writer)
        self._absent.pop(identity["rank"], None)
        self._ranks[identity["rank"]] = rank
        goodbye = None
        try:
            while line := await reader.readline():
                message = json.loads(line)
                now = time.monotonic()
                self._silence.heard(now - rank.heard)
                rank.heard, rank.cpu_ticks = now, None
                if "stack" in message:
                    if rank.stack is not None and not rank.stack.done():
                        rank.stack.set_result(message["stack"])
                    continue
                if "bye" in message:
                    goodbye = message["bye"]
                    break
                if message["p"] != rank.progress:
                    rank.progress, rank.changed = message["p"], now
                rank.allowance, rank.phase, rank.own_phase = message["a"], message["ph"], message["own"]
                rank.step = message.get("s")
        except (ConnectionError, ValueError):
            pass
        finally:
            if self._ranks.get(identity["rank"]) is rank:
                del self._ranks[identity["rank"]]
                if goodbye != "done" and self._failing is None:
                    self._failing = (f"rank {identity['rank']} (pid {identity['pid']}) "
                                     f"{'failed' if goodbye else 'closed its connection without a goodbye (it died)'}")
                    logger.info("%s: the attempt is failing and Ray restarts it; no hang is judged any more",
                                self._failing)
            with contextlib.suppress(RuntimeError):  # the actor is being killed: its event loop closed
                writer.close()

    async def _check(self) -> None:
        """Declare one culprit, silent or without progress (see the module docstring): checked every
        :data:`CHECK_EVERY_S`, and the moment the first silence would exceed the threshold."""
        last, wait = time.monotonic(), CHECK_EVERY_S
        while True:
            await asyncio.sleep(wait)
            now = time.monotonic()
            late, last = now - last - wait > LATE_S, now
            threshold = self.silence_threshold()
            first_silent = min((r.heard + threshold for r in self._ranks.values() if now - r.heard <= threshold),
                               default=now + CHECK_EVERY_S)
            wait = min(CHECK_EVERY_S, max(0.005, first_silent - now + 0.005))
            if self._failing is not None:
                return
            if late or not self._ranks:
                continue
            silent = [r for r in self._ranks.values() if now - r.heard > threshold and not self._alive_here(r)]
            if silent:
                culprit = min(silent, key=lambda r: r.heard)
                await self._declare(culprit, now, now - culprit.changed, threshold, silent=True)
                return
            answering = self._ranks.values()
            allowed = max([min((self._allowance(r) for r in answering if not r.own_phase), default=0.0),
                           *(self._allowance(r) for r in answering if r.own_phase)])
            ranks = [*answering, *self._absent.values()]
            if all(now - rank.changed > allowed for rank in ranks):
                culprit = min(ranks, key=lambda r: (r.writer is not None, r.changed))
                await self._declare(culprit, now, now - culprit.changed, allowed, silent=False)
                return  # its death ends the attempt

    def _alive_here(self, rank: _Rank) -> bool:
        """Whether a silent rank's process runs on this node and is runnable or used CPU since last
        looked at: alive (starved, or holding the GIL), not stopped."""
        if rank.identity["node_id"] != self._node_id:
            return False
        seen = _cpu_state(rank.identity["pid"])
        if seen is None:
            return False
        runnable, ticks = seen
        used_cpu = rank.cpu_ticks is not None and ticks > rank.cpu_ticks
        rank.cpu_ticks = ticks
        return runnable or used_cpu

    def _allowance(self, rank: _Rank) -> float:
        return rank.allowance * self._history.factor(rank.step)

    async def _declare(self, rank: _Rank, now: float, age: float, allowed: float, silent: bool) -> None:
        who = rank.identity
        if rank.writer is None:
            stalled = f"never reached the watchdog, started {age:.1f} s ago"
            doing = "; it does not answer (stopped, or its node lost, before it could reach the watchdog)"
        elif silent:
            stalled = (f"sent nothing for {now - rank.heard:.1f} s (silent after {allowed:.1f} s), its last phase "
                       f"{rank.phase!r}")
            doing = "; it does not answer (stopped, or its node is lost)"
        else:
            stalled = f"made no progress for {age:.1f} s (allowed {allowed:.1f} s) in {rank.phase!r}"
            doing = ""
            rank.stack = asyncio.get_running_loop().create_future()
            try:
                rank.writer.write(b"stack\n")
                await rank.writer.drain()
                doing = f"; its training thread is at:\n{await asyncio.wait_for(rank.stack, STACK_WAIT_S)}"
            except (asyncio.TimeoutError, ConnectionError):
                pass
        if self._history.hangs.get(rank.step):
            stalled += (f", at step {rank.step}, where the watchdog declared a hang {self._history.hangs[rank.step]} "
                        "time(s) before (its allowance doubled for each)")
        others = ", ".join(
            f"rank {r.identity['rank']} {'never connected' if r.writer is None else 'answering'}, no progress "
            f"for {now - r.changed:.1f} s" for r in [*self._ranks.values(), *self._absent.values()] if r is not rank)
        message = (f"rank {who['rank']} on {who['host']} (pid {who['pid']}) {stalled}: declared hung, killing it so "
                   f"that Ray restarts the worker group ({others or 'no other rank connected'}){doing}")
        logger.error("%s", message)
        wall = time.time()
        record = {"hung_rank": who["rank"], "host": who["host"], "pid": who["pid"], "phase": rank.phase,
                  "step": rank.step, "silent": silent, "error": message[:4000]}
        self._declared.append({**record, "t": wall, "t_start": wall - age})
        if rank.writer is not None:
            rank.writer.close()
        try:
            if who["node_id"] == self._node_id:
                _kill_rank(who["pid"])  # at once: a task may wait seconds for a worker process
            else:
                await _kill_rank_on_its_node.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(who["node_id"], soft=False)).remote(who["pid"])
        except Exception:  # noqa: BLE001 - gone already (its node too): Ray sees that itself
            logger.warning("Could not kill the hung rank %s", who["rank"], exc_info=True)
        try:
            await asyncio.wait_for(asyncio.to_thread(self._record, record, wall, wall - age, rank.step),
                                   RECORD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the kill is done; only the run's records miss it
            logger.error("Could not record the hang of rank %s in the run's ledger", who["rank"], exc_info=True)

    def _record(self, record: dict[str, Any], t: float, t_start: float, step: int | None) -> None:
        ledger = LedgerWriter(self._storage, WATCHDOG_RANK)
        try:
            ledger.record(EventKind.HANG, t=t, t_start=t_start, **record)
        finally:
            ledger.close()
        if step is not None:
            self._history.add(step)
