"""A replica's link to the run's memberships: the coordinator, its store, each membership's gloo
group, the copy of the state to the members behind its source, and the waits that notice a lost
member at once.

Every wait of a replica (a collective, the lead beginning a step, the source's restore or copy)
polls the coordinator's store every :data:`LOST_POLL_S` for the membership's "lost" mark, so a
member that died ends the wait in a beat, whatever gloo would still wait for. A group left inside
a collective with a lost member stays referenced (destroying it would wait for that collective).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import ray
import torch.distributed as dist

from ray_resilient._torch_internals import gloo_group
from ray_resilient.faults import FaultInjector
from ray_resilient.survivors.coordinator import JOINERS_KEY, Membership, lost_key
from ray_resilient.survivors.liveness import LivenessLink
from ray_resilient.survivors.state_copy import receive_state, send_state

LOST_POLL_S = 0.02  # how often a replica inside a collective asks whether a member was lost
RESTORE_STALL_TIMEOUTS = 10  # x timeout_s: a source restoring without progress that long is taken as lost
RESTORE_PROGRESS_EVERY_S = 1.0  # how often a source restoring from storage tells the others it gets on


def restored_key(epoch: int) -> str:
    """Set once the source of membership ``epoch`` restored from storage."""
    return f"membership{epoch}/restored"


def restore_progress_key(epoch: int) -> str:
    """The progress the source of membership ``epoch`` made restoring from storage (a count)."""
    return f"membership{epoch}/restore_progress"


def lead_step_key(epoch: int) -> str:
    """The steps the lead of membership ``epoch`` has begun (the last one's number + 1), in the
    coordinator's store."""
    return f"lead_step/{epoch}"


class ReplicaLostError(RuntimeError):
    """A member of this replica's membership is gone (or another member found one gone)."""


class FormationError(RuntimeError):
    """This replica could not form its membership's group (a member it cannot reach)."""


class MembershipLink:
    """Replica ``replica``'s link (see the module docstring); ``token`` names this process of it,
    ``timeout`` bounds a collective on a silent connection, ``faults`` injects partitions and the
    ``copy`` fault."""

    def __init__(self, replica: int, token: str, timeout: datetime.timedelta, faults: FaultInjector):
        from ray_resilient.survivors.backend import coordinator

        self.replica, self.timeout = replica, timeout
        self._token, self._faults = token, faults
        self.coordinator = coordinator()
        host, store_port, live_port = ray.get(self.coordinator.start.remote())
        self._store = dist.TCPStore(host, store_port, is_master=False, timeout=timeout)
        self._node_ip = ray.util.get_node_ip_address()
        self.live = LivenessLink(host, live_port, replica, token)
        self.membership: Membership | None = None
        self.group: Any = None  # the membership's gloo group
        self._copy_group: Any = None  # the source's and the replicas' behind it, while it copies
        self._abandoned: list[Any] = []  # gloo groups left inside a collective with a lost replica
        self.formation_failed = False  # this replica could not form the membership it last took (set by its owner)

    def join(self, registered_step: int) -> Membership:
        """This process joins the run (``registered_step``: the newest checkpoint Ray had as it started)."""
        return ray.get(self.coordinator.join.remote(self.replica, self._token, registered_step))

    def reform(self, step: int, holds_state: bool) -> Membership:
        """Report this replica (its step, whether it holds the state) and get the next membership."""
        return ray.get(self.coordinator.reform.remote(self.membership.epoch, self._token, step, holds_state,
                                                       self.formation_failed))

    def form(self, membership: Membership) -> None:
        """Form ``membership``'s gloo group: :class:`FormationError` when a member cannot be reached."""
        self.membership = membership
        self.formation_failed = False
        store = dist.PrefixStore(f"membership{membership.epoch}/", self._store)
        try:
            self.group = gloo_group(store, membership.rank(self.replica), len(membership.members), self.timeout,
                                    self._node_ip)
        except RuntimeError as err:
            raise FormationError(f"replica {self.replica} could not form membership {membership.epoch}'s group: "
                                 f"{str(err).splitlines()[0][:200]}") from err
        self._faults.unreachable &= set(membership.members)  # an injected partition ends with a side leaving
        if self._faults.unreachable:
            self._abandoned.append(self.group)
            raise FormationError(f"replica {self.replica} cannot reach replicas {sorted(self._faults.unreachable)}")

    def wait(self, work: Any) -> None:
        """Wait for a collective of this membership; :class:`ReplicaLostError` as soon as the
        coordinator marks a member lost, while the collective may still be waiting for it."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(LOST_POLL_S):
            self.raise_if_lost()
        work.wait()  # raises gloo's error, if the collective failed

    def raise_if_lost(self) -> None:
        if self._store.check([lost_key(self.membership.epoch)]):
            self._abandoned += [group for group in (self.group, self._copy_group) if group is not None]
            raise ReplicaLostError(f"membership {self.membership.epoch} lost a replica")

    def raise_if_cut_off(self) -> None:
        """What gloo would find at once where an injected partition cuts this replica off."""
        cut_off = self._faults.unreachable & set(self.membership.members)
        if cut_off:
            raise RuntimeError(f"replica {self.replica} cannot reach replicas {sorted(cut_off)}")

    def lead_begins(self, step: int) -> None:
        """The lead begins step ``step + 1`` (the others may enter its exchange)."""
        self._store.set(lead_step_key(self.membership.epoch), str(step + 1))

    def wait_for_the_lead(self, step: int) -> None:
        """Wait until the lead has begun step ``step + 1`` (it may have worked alone since the last
        one); :class:`ReplicaLostError` if a member is lost meanwhile."""
        key = lead_step_key(self.membership.epoch)
        while self._store.add(key, 0) <= step:  # one round trip when the lead is not behind
            self.raise_if_lost()
            time.sleep(LOST_POLL_S)

    def joiners_waiting(self) -> bool:
        """Whether a replacement waits to be taken in."""
        return self._store.check([JOINERS_KEY])

    def restore_progress(self) -> None:
        """The source restoring from storage gets on (counted once a second at most)."""
        self._store.add(restore_progress_key(self.membership.epoch), 1)

    def restored(self) -> None:
        """The source restored from storage."""
        self._store.set(restored_key(self.membership.epoch), "1")

    def wait_for_the_restore(self) -> None:
        """Wait until the membership's source restored from storage, however long that takes while
        it gets on (taking over a dead driver's lease alone can take its TTL; a group's formation
        would time out): :class:`ReplicaLostError` once it made no progress (its reads, its lease's
        watch) for :data:`RESTORE_STALL_TIMEOUTS` x ``timeout_s`` (a read stuck), or a member is lost."""
        epoch = self.membership.epoch
        allowance = RESTORE_STALL_TIMEOUTS * self.timeout.total_seconds()
        progress, since = -1, time.monotonic()
        while True:
            self.raise_if_lost()
            if self._store.check([restored_key(epoch)]):
                return
            if (now := self._store.add(restore_progress_key(epoch), 0)) != progress:
                progress, since = now, time.monotonic()
            elif time.monotonic() - since > allowance:
                raise ReplicaLostError(f"replica {self.membership.source} made no progress restoring from storage "
                                       f"for {allowance:.0f} s")
            time.sleep(LOST_POLL_S)

    def copy_state(self, state: dict[str, Any], step: int) -> tuple[dict[str, Any] | None, int, int]:
        """The source sends ``state`` (``{"state": the shared state}``) and ``step`` to the members
        behind it (:mod:`.state_copy`); a member behind receives them into ``state``'s tensors; the
        others wait until it was sent. Returns what this replica received (None: nothing), the step
        it goes on from and the bytes sent to each member."""
        membership = self.membership
        copied = f"membership{membership.epoch}/copied"
        copiers = (membership.source, *membership.behind)
        if self.replica not in copiers:
            while not self._store.check([copied]):
                self.raise_if_lost()
                time.sleep(LOST_POLL_S)
            return None, step, 0
        store = dist.PrefixStore(f"membership{membership.epoch}/copy/", self._store)
        self._copy_group = gloo_group(store, copiers.index(self.replica), len(copiers), self.timeout, self._node_ip)
        try:
            if self.replica == membership.source:
                sent = send_state(self._copy_group, {**state, "step": step}, self.wait,
                                  before_tensors=lambda: self._faults.fire("copy", step))
                self._store.set(copied, "1")
                return None, step, sent
            received = receive_state(self._copy_group, state, self.wait)
            return received, received["step"], 0
        finally:
            self._copy_group = None

    def close(self) -> None:
        self.live.close()
