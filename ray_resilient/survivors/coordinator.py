"""The membership coordinator: which replicas train together, from which step, after each change.

One async Ray actor per worker group, owned by Ray Train's controller (created by the survivor
backend), so it outlives any replica. It hosts the ``TCPStore`` the replicas rendezvous their
gloo groups on, and a TCP server each replica keeps one connection to, sending a heartbeat on it
(:mod:`.liveness`). A replica process that dies (SIGKILL, OOM) closes that connection, so
the coordinator knows at once; one that stops answering without dying (SIGSTOP, a hang that holds
the interpreter, a lost node or a partition that sends no FIN) is dropped once silent past the
:class:`~ray_resilient.watchdog.silence.SilenceRule` of the heartbeats the coordinator hears (2 s on
a quiet machine), where an idle connection would wait for gloo's timeout and more.

A *membership* (an epoch number, the replica ids in it, the step it starts from) changes when a
replica is lost or a replacement is waiting. As soon as a member is gone, or one asks for the next
membership, the coordinator sets :func:`lost_key` in the store: a member blocked in a collective
that the dead one's broken connections did not reach (gloo only fails the pairs that touch it)
stops waiting too. Every replica of the old membership calls
:meth:`MembershipCoordinator.reform` with the last step it applied and whether it holds the run's
state; the new membership is formed once each of them has called or is gone, and takes in the
replacements waiting (:func:`next_membership`). Its source is a replica holding state that applied
the most steps: the replicas behind it (and every replacement) copy its state. A replica without
state (a replacement whose copy broke off) is never the source nor the lead. When no member holding
state is left (the source died while copying, or every member died while replacements waited), the
next membership restores from storage: its source reads the newest complete checkpoint, under a new
attempt number, and the others copy from it, so committed checkpoints are never written over. The
first membership of a worker group starts that way too, so that every replica starts from one read.
Each process says, as it joins, the newest checkpoint Ray had registered when it started: the
membership that takes replacements in carries it, and so does :meth:`MembershipCoordinator.wait_for_every_replica`
at the run's end (the lead offers again the registrations Ray dropped when it replaced a replica).
A lead lost at the run's end before :meth:`MembershipCoordinator.finish` leaves the others to re-form.

Two members that reach the coordinator but not each other (a partition between their nodes) fail
to form every group they are both in, while the others form it: once such a pair alone failed
:data:`PAIR_FAILURES_TO_DROP` formations, the next membership leaves one of them out (never the
lead), whose process must restart (Ray replaces it, and its replacement joins), and the rest train
on instead of re-forming until every replica gives up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

import ray

from ray_resilient.survivors.liveness import watch_heartbeats
from ray_resilient.survivors.run_end import RunEnd
from ray_resilient.watchdog.silence import SilenceRule

logger = logging.getLogger(__name__)

JOINERS_KEY = "joiners_waiting"  # set in the store while a replacement waits to be taken in


def lost_key(epoch: int) -> str:
    """Set in the store once membership ``epoch`` lost a member (or one asked for the next)."""
    return f"lost/{epoch}"

UNRESPONSIVE_S = 120.0  # a live replica that never reports a membership change is dropped after this
PAIR_FAILURES_TO_DROP = 2  # formations a pair alone failed before one of the two is dropped
JOIN_TIMEOUT_S = 600.0  # a replacement not taken in by then fails (Ray starts it again)
FINAL_REPLACEMENT_WAIT_S = 120.0  # at the run's end, how long the lead waits for Ray's replacements to start


@dataclasses.dataclass(frozen=True)
class Membership:
    """Who trains together: replica ids in rank order, from which step, copying whose state."""

    epoch: int
    members: tuple[int, ...]
    step: int  # the step every member continues from (the source's last applied step)
    source: int  # the member whose state the others behind ``step`` copy
    lead: int  # the member that saves checkpoints and records progress (kept while it lives)
    behind: tuple[int, ...]  # members (replacements included) that copy the source's state
    from_storage: bool = False  # the source restores the newest complete checkpoint first (none holds state)
    finished: bool = False
    ray_registered: int | None = None  # the newest step Ray had registered as the processes taken in started

    def rank(self, member: int) -> int:
        return self.members.index(member)


@dataclasses.dataclass(frozen=True)
class Report:
    """What a member of the membership being changed said: its last applied step, and whether it
    holds the run's state (False: a replacement whose state copy broke off)."""

    step: int
    has_state: bool


def next_membership(old: Membership | None, reports: dict[int, Report], joiners: tuple[int, ...]) -> Membership | None:
    """The membership after ``old`` (None: the worker group's first) of the live members that
    reported and the replacements waiting; None when nobody is left to form one."""
    members = tuple(sorted({*reports, *joiners}))
    if not members:
        return None
    epoch = 0 if old is None else old.epoch + 1
    holders = {replica: report.step for replica, report in reports.items() if report.has_state}
    if not holders:  # nobody holds the run's state: the source reads it from storage
        return Membership(epoch, members, 0, members[0], members[0], members[1:], from_storage=True)
    step = max(holders.values())
    source = min(replica for replica, applied in holders.items() if applied == step)
    behind = tuple(r for r in members if holders.get(r, -1) < step)
    lead = old.lead if old is not None and old.lead in holders else source
    return Membership(epoch, members, step, source, lead, behind)


@ray.remote(num_cpus=0)
class MembershipCoordinator:
    """The membership of one worker group's replicas (see the module docstring)."""

    def __init__(self, replicas: int):
        self._replicas = replicas
        self._store: Any = None
        self._server: asyncio.base_events.Server | None = None
        self._host = ""
        self._connected: dict[str, int] = {}  # live replica token -> replica id
        self._silence = SilenceRule()  # when a replica's heartbeats have stopped
        self._formation_failed: set[str] = set()  # tokens that could not form the current membership's group
        self._pair_failures: Counter[tuple[int, int]] = Counter()  # formations a pair alone failed
        self._changed = asyncio.Condition()
        self._current: Membership | None = None
        self._tokens: dict[int, str] = {}  # replica id -> token of the current membership's members
        self._reports: dict[str, Report] = {}  # token -> its report, for the membership being changed
        self._joiners: dict[int, str] = {}  # replica id -> token of replacements waiting
        self._ray_registered: dict[str, int] = {}  # joiner's token -> Ray's newest registered step at its start
        self._end: RunEnd | None = None  # the lead's report once it trained the last step

    async def start(self) -> tuple[str, int, int]:
        """Start the store and the liveness server; their host, store port and liveness port."""
        import torch.distributed as dist

        if self._server is None:
            self._host = ray.util.get_node_ip_address()
            self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=60))
            self._server = await asyncio.start_server(self._watch, self._host, 0)
        return self._host, self._store.port, self._server.sockets[0].getsockname()[1]

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One replica's connection: its token, then heartbeats until the process is gone or silent."""
        line = await reader.readline()
        replica, token = line.decode().split()
        async with self._changed:
            self._connected[token] = int(replica)
            self._changed.notify_all()
        how = await watch_heartbeats(reader, self._silence)
        writer.close()  # a silent replica that wakes up finds it was dropped
        async with self._changed:
            del self._connected[token]
            if self._current is not None and token in self._tokens.values():
                self._store.set(lost_key(self._current.epoch), "1")
                self._form_if_abandoned()
            self._changed.notify_all()
        logger.warning("Replica %s (%s) is gone: it %s", replica, token, how)

    async def join(self, replica: int, token: str, ray_registered: int) -> Membership:
        """A replica process starting, which found ``ray_registered`` the newest step Ray had
        registered (``get_checkpoint()``): the first membership, or the next one that takes it in."""
        async with self._changed:
            await self._changed.wait_for(lambda: token in self._connected)
            if self._end is not None:
                return self._finished_membership()
            self._ray_registered[token] = ray_registered
            if self._current is None:  # the worker group's first start: all replicas together
                self._joiners[replica] = token
                if len(self._joiners) == self._replicas:
                    self._form_next()
                await self._changed.wait_for(lambda: self._current is not None)
                return self._current
            epoch = self._current.epoch
            self._joiners[replica] = token
            self._store.set(JOINERS_KEY, "1")
            self._form_if_abandoned()
            self._changed.notify_all()  # a lead waiting for every replica at the run's end
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self._current.epoch > epoch or self._end is not None), JOIN_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._joiners.pop(replica, None)
                raise RuntimeError(f"replica {replica} waited {JOIN_TIMEOUT_S:.0f} s to be taken in: the live "
                                   "replicas never reached a step boundary") from None
            if self._end is not None:
                return self._finished_membership()
            return self._current

    async def reform(self, epoch: int, token: str, applied_step: int, has_state: bool,
                     formation_failed: bool = False) -> Membership:
        """A member of membership ``epoch`` asks for the next one, having applied ``applied_step``
        (meaningful only when it ``has_state``); ``formation_failed``: it could not form
        membership ``epoch``'s group (a member it cannot reach)."""
        async with self._changed:
            if self._current.epoch != epoch or token not in self._tokens.values():
                if self._current.epoch > epoch and token in self._tokens.values():
                    return self._current  # formed while this member was on its way
                raise RuntimeError(f"replica {token} was dropped from membership {epoch}; it must restart")
            self._reports[token] = Report(applied_step, has_state)
            if formation_failed:
                self._formation_failed.add(token)
            self._store.set(lost_key(epoch), "1")  # members still inside a collective stop waiting
            if not self._all_reported():
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._current.epoch > epoch or self._all_reported()),
                        UNRESPONSIVE_S)
                except asyncio.TimeoutError:
                    logger.warning("Members of membership %d never reported; dropping them", epoch)
            if self._current.epoch == epoch:
                self._form_next()
            if token not in self._tokens.values():
                raise RuntimeError(f"replica {token} was dropped from membership {epoch}; it must restart")
            return self._current

    async def finish(self, end: RunEnd) -> None:
        """The lead trained the last step: every member passes ``end`` on (:meth:`wait_finished`),
        and replacements still starting have nothing to join."""
        async with self._changed:
            self._end = end
            self._changed.notify_all()

    async def wait_for_every_replica(self, timeout_s: float) -> tuple[bool, int | None]:
        """Wait until a process of every replica id is up, a member's or a replacement's that joined
        (Ray started the replacements of the lost ones, so every worker of its group can meet at its
        report barrier): whether so within ``timeout_s``, and the newest step Ray had registered as
        the replacements waiting started (None: none waits)."""
        def up() -> set[int]:
            return {replica for replica, token in [*self._tokens.items(), *self._joiners.items()]
                    if token in self._connected}

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: up() >= set(range(self._replicas))), timeout_s)
                everyone = True
            except asyncio.TimeoutError:
                everyone = False
            return everyone, self._newest_registered(self._joiners.values())

    async def wait_finished(self) -> RunEnd | None:
        """A member past the last step (or a replacement that joined after it) waits for the lead's
        :meth:`finish`: its report; None when the lead is lost before it (the members left re-form,
        and their new lead finishes the run)."""
        async with self._changed:
            token = self._tokens.get(self._current.lead)
            await self._changed.wait_for(lambda: self._end is not None or token not in self._connected)
            return self._end

    def _all_reported(self) -> bool:
        return all(token in self._reports or token not in self._connected for token in self._tokens.values())

    def _form_if_abandoned(self) -> None:
        """With no member of the current membership left, form the next one of the replacements
        waiting (nobody else would: only members ask for it)."""
        if (self._end is None and not any(t in self._connected for t in self._tokens.values())
                and any(t in self._connected for t in self._joiners.values())):
            self._form_next()

    def _form_next(self) -> None:
        old = self._current
        reported = self._without_a_partitioned_member({replica: token for replica, token in self._tokens.items()
                                                       if token in self._reports and token in self._connected})
        self._formation_failed = set()
        joiners = {replica: token for replica, token in self._joiners.items() if token in self._connected}
        current = next_membership(old, {replica: self._reports[token] for replica, token in reported.items()},
                                  tuple(joiners))
        if current is None:
            return
        ray_registered = self._newest_registered(joiners.values())
        self._current = dataclasses.replace(current, ray_registered=ray_registered)
        self._tokens, self._reports, self._joiners, self._ray_registered = {**reported, **joiners}, {}, {}, {}
        self._store.delete_key(JOINERS_KEY)
        before = set(old.members) if old is not None else set()
        logger.info("Membership %d: replicas %s from %s (lost %s, joined %s)", current.epoch, current.members,
                    "storage" if current.from_storage else f"step {current.step} of replica {current.source}",
                    sorted(before - set(current.members)), sorted(set(current.members) - before))
        self._changed.notify_all()

    def _newest_registered(self, tokens: Iterable[str]) -> int | None:
        """The newest step Ray had registered as the processes of ``tokens`` started (None: none):
        the one started last saw the most."""
        return max((self._ray_registered[token] for token in tokens if token in self._ray_registered), default=None)

    def _without_a_partitioned_member(self, reported: dict[int, str]) -> dict[int, str]:
        """``reported`` less one member of a pair that alone failed to form the group
        :data:`PAIR_FAILURES_TO_DROP` times while the other members formed it: the two reach the
        coordinator but not each other (a partition), and re-forming with both would fail for ever.
        The lead is kept; else the pair's lower replica id."""
        failed = tuple(sorted(r for r, token in reported.items() if token in self._formation_failed))
        if len(failed) != 2 or len(reported) == 2:
            return reported
        self._pair_failures[failed] += 1
        if self._pair_failures[failed] < PAIR_FAILURES_TO_DROP:
            return reported
        del self._pair_failures[failed]
        dropped = failed[0] if failed[1] == self._current.lead else failed[1]
        logger.warning("Replicas %d and %d failed to form a group together %d times while the others formed it "
                       "(they cannot reach each other): dropping replica %d so that the rest train on",
                       *failed, PAIR_FAILURES_TO_DROP, dropped)
        return {replica: token for replica, token in reported.items() if replica != dropped}

    def _finished_membership(self) -> Membership:
        """What a process joining the finished run is given: the run's last step, finished."""
        if self._end.error is not None:
            raise RuntimeError(f"the run ended without its final checkpoint: {self._end.error}")
        old = self._current
        return dataclasses.replace(old, step=self._end.step, finished=True) if old else Membership(
            0, (), self._end.step, -1, -1, (), finished=True)
