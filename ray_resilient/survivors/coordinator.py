"""The membership coordinator: which replicas train together, from which step, after each change.

One async Ray actor per worker group, owned by Ray Train's controller (created by the survivor
backend), so it outlives any replica. It hosts the ``TCPStore`` the replicas rendezvous their
gloo groups on, and a TCP server each replica keeps one connection to: a replica process that
dies (SIGKILL, OOM, a lost node's kernel resetting it) closes that connection, so the coordinator
knows who is gone at once instead of after a timeout.

A *membership* (an epoch number, the replica ids in it, the step it starts from) changes when a
replica is lost or a replacement is waiting. As soon as a member is gone, or one asks for the next
membership, the coordinator sets :func:`lost_key` in the store: a member blocked in a collective
that the dead one's broken connections did not reach (gloo only fails the pairs that touch it)
stops waiting too. Every replica of the old membership calls
:meth:`MembershipCoordinator.reform` with the last step it applied; the new membership is formed
once each of them has called or is gone, and takes in the replacements waiting. Its source is a
replica that applied the most steps: the replicas behind it (and every replacement) copy its state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)

JOINERS_KEY = "joiners_waiting"  # set in the store while a replacement waits to be taken in


def lost_key(epoch: int) -> str:
    """Set in the store once membership ``epoch`` lost a member (or one asked for the next)."""
    return f"lost/{epoch}"

UNRESPONSIVE_S = 120.0  # a live replica that never reports a membership change is dropped after this


@dataclasses.dataclass(frozen=True)
class Membership:
    """Who trains together: replica ids in rank order, from which step, copying whose state."""

    epoch: int
    members: tuple[int, ...]
    step: int  # the step every member continues from (the source's last applied step)
    source: int  # the member whose state the others behind ``step`` copy
    lead: int  # the member that saves checkpoints and records progress (kept while it lives)
    behind: tuple[int, ...]  # members (replacements included) that copy the source's state
    finished: bool = False

    def rank(self, member: int) -> int:
        return self.members.index(member)


@ray.remote(num_cpus=0)
class MembershipCoordinator:
    """The membership of one worker group's replicas (see the module docstring)."""

    def __init__(self, replicas: int):
        self._replicas = replicas
        self._store: Any = None
        self._server: asyncio.base_events.Server | None = None
        self._host = ""
        self._connected: dict[str, int] = {}  # live replica token -> replica id
        self._changed = asyncio.Condition()
        self._current: Membership | None = None
        self._tokens: dict[int, str] = {}  # replica id -> token of the current membership's members
        self._reports: dict[str, int] = {}  # token -> last applied step, for the membership being changed
        self._joiners: dict[int, str] = {}  # replica id -> token of replacements waiting
        self._finished_step: int | None = None

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
        """One replica's connection: its token, then nothing until the process is gone."""
        line = await reader.readline()
        replica, token = line.decode().split()
        async with self._changed:
            self._connected[token] = int(replica)
            self._changed.notify_all()
        await reader.read()  # EOF: the process closed the connection or died
        writer.close()
        async with self._changed:
            del self._connected[token]
            if self._current is not None and token in self._tokens.values():
                self._store.set(lost_key(self._current.epoch), "1")
            self._changed.notify_all()
        logger.info("Replica %s (%s) is gone", replica, token)

    async def join(self, replica: int, token: str) -> Membership:
        """A replica process starting: the first membership, or the next one that takes it in."""
        async with self._changed:
            await self._changed.wait_for(lambda: token in self._connected)
            if self._finished_step is not None:
                return self._finished_membership()
            if self._current is None:  # the worker group's first start: all replicas together
                self._joiners[replica] = token
                if len(self._joiners) == self._replicas:
                    members = tuple(sorted(self._joiners))
                    self._tokens, self._joiners = dict(self._joiners), {}
                    self._current = Membership(0, members, 0, members[0], members[0], ())
                    self._changed.notify_all()
                await self._changed.wait_for(lambda: self._current is not None)
                return self._current
            epoch = self._current.epoch
            self._joiners[replica] = token
            self._store.set(JOINERS_KEY, "1")
            await self._changed.wait_for(lambda: self._current.epoch > epoch or self._finished_step is not None)
            if self._finished_step is not None:
                return self._finished_membership()
            return self._current

    async def reform(self, epoch: int, token: str, applied_step: int) -> Membership:
        """A member of membership ``epoch`` asks for the next one, having applied ``applied_step``."""
        async with self._changed:
            if self._current.epoch != epoch or token not in self._tokens.values():
                if self._current.epoch > epoch and token in self._tokens.values():
                    return self._current  # formed while this member was on its way
                raise RuntimeError(f"replica {token} was dropped from membership {epoch}; it must restart")
            self._reports[token] = applied_step
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

    async def finish(self, step: int) -> None:
        """The run trained its last step: replacements still starting have nothing to join."""
        async with self._changed:
            self._finished_step = step
            self._changed.notify_all()

    def _all_reported(self) -> bool:
        return all(token in self._reports or token not in self._connected for token in self._tokens.values())

    def _form_next(self) -> None:
        old = self._current
        reported = {replica: token for replica, token in self._tokens.items() if token in self._reports}
        step = max(self._reports[token] for token in reported.values())
        source = min(replica for replica, token in reported.items() if self._reports[token] == step)
        tokens = {**reported, **{r: t for r, t in self._joiners.items() if t in self._connected}}
        members = tuple(sorted(tokens))
        behind = tuple(r for r in members if r not in reported or self._reports[reported[r]] < step)
        lead = old.lead if old.lead in reported else members[0]
        self._current = Membership(old.epoch + 1, members, step, source, lead, behind)
        self._tokens, self._reports, self._joiners = tokens, {}, {}
        self._store.delete_key(JOINERS_KEY)
        logger.info("Membership %d: replicas %s from step %d (lost %s, joined %s)", self._current.epoch, members,
                    step, sorted(set(old.members) - set(members)), sorted(set(members) - set(old.members)))
        self._changed.notify_all()

    def _finished_membership(self) -> Membership:
        old = self._current
        return dataclasses.replace(old, step=self._finished_step, finished=True) if old else Membership(
            0, (), self._finished_step, -1, -1, (), finished=True)
