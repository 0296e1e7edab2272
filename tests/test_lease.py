"""The run directory's lease: one writer per run, on local storage and on S3 (SeaweedFS)."""

from __future__ import annotations

import json
import time

import pyarrow.fs as pafs
import pytest

from ray_resilient.checkpoint.lease import LEASE_FILE, RunLease, RunLeaseHeldError, RunLeaseLostError
from ray_resilient.testing import wait_until

FAST = {"ttl_s": 2.0, "renew_every_s": 0.2, "settle_s": 0.2}
LIVE = {"ttl_s": 20.0, "renew_every_s": 0.5}  # renewals far within the expiry, even on a loaded machine


@pytest.fixture(params=["local", "s3"])
def run_dir(request, tmp_path):
    """(filesystem, run directory) on a local disk or on a real S3 server."""
    if request.param == "local":
        return pafs.LocalFileSystem(), str(tmp_path / "run")
    server = request.getfixturevalue("s3_server")
    return server.filesystem(), f"{server.bucket}/{tmp_path.name}/run"


def test_a_live_run_keeps_the_lease_and_a_second_run_is_refused_naming_it(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    first = RunLease(filesystem, path, "run-a", **LIVE)
    first.acquire()
    try:
        with pytest.raises(RunLeaseHeldError) as refused:
            RunLease(filesystem, path, "run-b", **LIVE).acquire()
        assert "Ray Train run run-a" in str(refused.value) and "another run name" in str(refused.value)
        assert first.read_record().run_id == "run-a"
        first.check()  # still the holder
    finally:
        first.release()
    assert first.read_record() is None  # released at the end of the run


def test_a_restarted_attempt_of_the_same_run_takes_its_lease_back_at_once(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    killed = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=0.2)
    killed.acquire()
    killed.stop()  # the attempt was killed: its lease runs for an hour more
    before = killed.read_record()
    restarted = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=0.2)
    restarted.acquire()  # without waiting for the expiry (the test would time out)
    try:
        assert restarted.read_record().renewed > before.renewed
    finally:
        restarted.release()


def test_a_lease_its_driver_stopped_renewing_is_taken_over_once_expired(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    dead = RunLease(filesystem, path, "run-a", **FAST)
    dead.acquire()
    dead.stop()  # its driver died: no more renewals
    expires = dead.read_record().expires
    successor = RunLease(filesystem, path, "run-b", **FAST)
    successor.acquire()
    try:
        assert time.time() >= expires  # not taken while still valid
        assert successor.read_record().run_id == "run-b"
    finally:
        successor.release()


def test_a_holder_whose_lease_was_taken_over_stops_and_commits_nothing(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", **FAST)
    holder.acquire()
    def other_run_writes() -> bool:  # another run took the lease at the same moment (no compare-and-swap)
        with filesystem.open_output_stream(f"{path}/{LEASE_FILE}") as out:
            out.write(json.dumps({"run_id": "run-b", "holder": "host x pid 1", "renewed": 0.0,
                                  "expires": 1e12}).encode())
        return holder.lost is not None

    wait_until(other_run_writes, timeout=30, what="the holder's renewal to notice")
    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.check()
    holder.release()
    assert holder.read_record().run_id == "run-b"  # never deletes another run's lease


def test_a_holder_whose_clock_is_a_minute_behind_keeps_its_lease(run_dir):
    """Its lease says it expired a minute ago by the taker's clock: expiry is watched, not trusted."""
    filesystem, path = run_dir
    filesystem.create_dir(path)
    behind = RunLease(filesystem, path, "run-a", **FAST, clock=lambda: time.time() - 60)
    behind.acquire()
    try:
        assert behind.read_record().expires < time.time()  # "expired", by the taker's clock
        with pytest.raises(RunLeaseHeldError, match="run-a"):
            RunLease(filesystem, path, "run-b", **FAST).acquire()
        behind.verify()  # still the holder
    finally:
        behind.release()


def test_a_lease_file_overwritten_with_garbage_ends_the_holder_loudly(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", **FAST)
    holder.acquire()
    with filesystem.open_output_stream(f"{path}/{LEASE_FILE}") as out:
        out.write(b"{}")
    wait_until(lambda: holder.lost is not None, timeout=30, what="the holder's renewal to notice")
    with pytest.raises(RunLeaseLostError, match="no longer parses"):
        holder.check()
    holder.stop()
    assert holder._thread is None


def test_a_commit_rereads_the_lease_instead_of_trusting_the_last_renewal(run_dir):
    filesystem, path = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=1800, settle_s=0.0)
    holder.acquire()
    with filesystem.open_output_stream(f"{path}/{LEASE_FILE}") as out:
        out.write(json.dumps({"run_id": "run-b", "holder": "host x pid 1", "renewed": 0.0, "expires": 0.0}).encode())
    holder.check()  # no renewal ran since: the flag alone cannot know
    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.verify()
    holder.release()
    assert holder.read_record().run_id == "run-b"


def test_two_takers_of_a_dead_runs_lease_at_the_same_moment_one_goes_on(run_dir):
    """Both watched the same dead lease and write theirs at once: exactly one goes on, the other is
    refused before it lists, writes or deletes anything."""
    import threading

    filesystem, path = run_dir
    filesystem.create_dir(path)
    dead = RunLease(filesystem, path, "run-dead", **FAST)
    dead.acquire()
    dead.stop()
    takers = [RunLease(filesystem, path, f"run-{name}", **{**FAST, "settle_s": 1.0}) for name in "bc"]
    start = threading.Barrier(2)
    outcomes: dict[str, BaseException | None] = {}

    def take(lease: RunLease) -> None:
        start.wait()
        try:
            lease.acquire()
            outcomes[lease.run_id] = None
        except RunLeaseHeldError as err:
            outcomes[lease.run_id] = err

    threads = [threading.Thread(target=take, args=(lease,)) for lease in takers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    winners = [run for run, error in outcomes.items() if error is None]
    assert len(outcomes) == 2 and len(winners) == 1, outcomes
    assert takers[0].read_record().run_id == winners[0]
    for lease in takers:
        lease.release()


def write_lease_of(run_id: str, filesystem: pafs.FileSystem, path: str) -> None:
    """Another run's lease record, written over whatever is there (as its takeover would)."""
    with filesystem.open_output_stream(f"{path}/{LEASE_FILE}") as out:
        out.write(json.dumps({"run_id": run_id, "holder": "host x pid 1", "renewed": time.time(),
                              "expires": time.time() + 30}).encode())


def writing_first(write, calls_before: int = 0):
    """A lease clock that runs ``write`` at its call number ``calls_before`` (a lease reads its
    clock just before it writes its record): another writer's write lands between the lease's
    read and its write, a race no sleep can place."""
    calls = []

    def clock() -> float:
        if len(calls) == calls_before:
            write()
        calls.append(None)
        return time.time()

    return clock


@pytest.fixture(params=["options", "uri"])
def s3_run_dir(request, s3_server, tmp_path, monkeypatch):
    """(filesystem, run directory) on the S3 server: a filesystem made with its options, or, as Ray
    Train makes one from an ``s3://`` storage path, from the URI with the endpoint and keys in the
    environment."""
    if request.param == "options":
        return s3_server.filesystem(), f"{s3_server.bucket}/{tmp_path.name}/run"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_server.endpoint}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    filesystem, path = pafs.FileSystem.from_uri(f"s3://{s3_server.bucket}/{tmp_path.name}/run")
    return filesystem, path


def test_on_s3_a_taker_never_replaces_a_lease_written_after_it_last_read(s3_run_dir):
    """Another taker's lease lands after this taker's last read of the dead lease, just before its
    own write (the read-back cannot tell who wrote last if the other read back in between). On S3
    the write replaces only the version read: it fails, this taker stops, the other's lease stands."""
    filesystem, path = s3_run_dir
    filesystem.create_dir(path)
    dead = RunLease(filesystem, path, "run-dead", **FAST)
    dead.acquire()
    dead.stop()
    taker = RunLease(filesystem, path, "run-b", **FAST,
                     clock=writing_first(lambda: write_lease_of("run-c", filesystem, path)))
    with pytest.raises(RunLeaseHeldError, match="run-c"):
        taker.acquire()
    assert taker.read_record().run_id == "run-c"


def test_on_s3_a_renewal_never_replaces_a_lease_taken_over_after_it_read(s3_run_dir):
    """A takeover lands between a renewal's read and its write: the renewal must not write over it
    (the taker would go on beside this holder); the holder has lost its lease."""
    filesystem, path = s3_run_dir
    filesystem.create_dir(path)
    taken = []
    holder = RunLease(filesystem, path, "run-a", **FAST, clock=writing_first(
        lambda: (write_lease_of("run-b", filesystem, path), taken.append(True)), calls_before=1))  # 0: its acquire
    holder.acquire()
    wait_until(lambda: taken and holder.lost is not None, timeout=30, what="the renewal to find the lease taken")
    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.check()
    holder.release()
    assert holder.read_record().run_id == "run-b"


@pytest.mark.parametrize("holder_ttl_s, taker_ttl_s", [(2.0, 30.0), (3600.0, 2.0)])
def test_a_taker_watches_a_lease_for_the_ttl_its_holder_declared(run_dir, caplog, holder_ttl_s, taker_ttl_s):
    """A dead holder that declared a short TTL is taken over after it, not after the taker's longer
    one; a live holder that declared a long TTL (renewing rarely) is not taken over after the
    taker's shorter one."""
    import threading

    filesystem, path = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=holder_ttl_s, settle_s=0.0)
    holder.acquire()
    holder.stop()  # no renewal from now on
    taker = RunLease(filesystem, path, "run-b", ttl_s=taker_ttl_s, settle_s=0.0)
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        thread = threading.Thread(target=taker.acquire)
        thread.start()
        watching = f"watching it for {holder_ttl_s:.0f}s"
        wait_until(lambda: any(watching in r.getMessage() for r in caplog.records), timeout=30,
                   what=f"the taker to log {watching!r}")
        if holder_ttl_s > taker_ttl_s:  # the holder's driver ends its run: it lets go of its lease
            filesystem.delete_file(f"{path}/{LEASE_FILE}")
        thread.join(timeout=60)
    try:
        assert taker.read_record().run_id == "run-b"
        assert not any(f"watching it for {taker_ttl_s:.0f}s" in r.getMessage() for r in caplog.records)
    finally:
        taker.release()


def test_a_lease_declaring_an_endless_ttl_is_watched_an_hour_at_most(tmp_path, caplog):
    """A lease file whose holder declares it never expires (``Infinity``, or 1e300 s) would make
    every later driver wait for ever: it is watched for an hour at most."""
    import threading

    filesystem, path = pafs.LocalFileSystem(), str(tmp_path / "run")
    filesystem.create_dir(path)
    with open(f"{path}/{LEASE_FILE}", "w") as out:
        out.write('{"run_id": "run-x", "holder": "host h pid 1", "renewed": 1.0, "expires": Infinity}')
    taker = RunLease(filesystem, path, "run-b", ttl_s=2.0, settle_s=0.0)
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        thread = threading.Thread(target=taker.acquire)
        thread.start()
        wait_until(lambda: any("watching it for 3600s" in r.getMessage() for r in caplog.records), timeout=30,
                   what="the taker to watch the lease for an hour")
        filesystem.delete_file(f"{path}/{LEASE_FILE}")  # (the test does not wait the hour)
        thread.join(timeout=60)
    try:
        assert "declares a TTL of inf s" in caplog.text and taker.read_record().run_id == "run-b"
    finally:
        taker.release()
