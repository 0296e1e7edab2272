"""The run directory's fenced lease: one writer per run, on local storage and on S3 (SeaweedFS)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time

import pyarrow.fs as pafs
import pytest
import urllib3

from ray_resilient.checkpoint.lease import (
    RunLease, RunLeaseHeldError, RunLeaseLostError, check_fence, generation_path, list_generations,
)
from ray_resilient.storage.conditional import exclusive_create_for
from ray_resilient.testing import wait_until

FAST = {"ttl_s": 2.0, "renew_every_s": 0.2, "settle_s": 0.2}
LIVE = {"ttl_s": 20.0, "renew_every_s": 0.5}  # renewals far within the expiry, even on a loaded machine


@pytest.fixture(params=["local", "s3", "s3-unconditional"])
def run_dir(request, tmp_path):
    """(filesystem, run directory, lease options) on a local disk, on a real S3 server, and on it
    without conditional writes (as on stores that ignore them)."""
    if request.param == "local":
        return pafs.LocalFileSystem(), str(tmp_path / "run"), {}
    server = request.getfixturevalue("s3_server")
    options = {"conditional_writes": False, "settle_s": 2.0} if request.param == "s3-unconditional" else {}
    return server.filesystem(), f"{server.bucket}/{tmp_path.name}/run", options


def write_generation(filesystem: pafs.FileSystem, path: str, generation: int, run_id: str, *,
                     data: bytes | None = None) -> None:
    """Another writer's record for ``generation``, written over whatever is there."""
    filesystem.create_dir(f"{path}/.leases", recursive=True)
    if data is None:
        data = json.dumps({"run_id": run_id, "holder": "host x pid 1", "renewed": time.time(),
                           "expires": time.time() + 30, "generation": generation, "token": "t"}).encode()
    with filesystem.open_output_stream(generation_path(path, generation)) as out:
        out.write(data)


def test_a_live_run_keeps_the_lease_and_a_second_run_is_refused_naming_it(run_dir):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    first = RunLease(filesystem, path, "run-a", **LIVE, **options)
    assert first.acquire() == 0
    try:
        with pytest.raises(RunLeaseHeldError) as refused:
            RunLease(filesystem, path, "run-b", **LIVE, **options).acquire()
        assert "Ray Train run run-a" in str(refused.value) and "another run name" in str(refused.value)
        assert first.read_record().run_id == "run-a"
        first.verify()  # still the holder
    finally:
        first.release()
    assert first.read_record().released  # the run ended: marked, never deleted (the numbers only grow)
    after = RunLease(filesystem, path, "run-b", ttl_s=3600, **{"settle_s": 0.2, **options})
    assert after.acquire() == 1  # at once: a released lease is not watched (the test would time out)
    after.release()


def test_a_restarted_attempt_takes_the_next_generation_at_once_and_fences_the_old_one(run_dir):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    old = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=0.2, **options)
    old.acquire()
    restarted = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=0.2, **{"settle_s": 0.2, **options})
    try:
        assert restarted.acquire() == old.generation + 1  # without waiting for the expiry
        # The old attempt's rank 0 still runs (not yet killed): it is fenced off, at its next
        # renewal and at any commit, and every rank's shard writes of its attempt are refused.
        with pytest.raises(RunLeaseLostError, match="generation 1"):
            old.verify()
        with pytest.raises(RunLeaseLostError):
            check_fence(filesystem, path, old.generation)
        check_fence(filesystem, path, restarted.generation)
        old.release()
        assert restarted.read_record().run_id == "run-a" and not restarted.read_record().released
    finally:
        restarted.release()


def test_a_lease_its_driver_stopped_renewing_is_taken_over_once_expired(run_dir):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    dead = RunLease(filesystem, path, "run-a", **{**FAST, **options})
    dead.acquire()
    dead.stop()  # its driver died: no more renewals
    expires = dead.read_record().expires
    successor = RunLease(filesystem, path, "run-b", **{**FAST, **options})
    assert successor.acquire() == 1
    try:
        assert time.time() >= expires  # not taken while still valid
        assert successor.read_record().run_id == "run-b"
    finally:
        successor.release()


def test_a_holder_whose_lease_was_taken_over_stops_and_commits_nothing(run_dir):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", **{**FAST, **options})
    holder.acquire()
    write_generation(filesystem, path, holder.generation + 1, "run-b")  # it was paused past its TTL
    wait_until(lambda: holder.lost is not None, timeout=30, what="the holder's renewal to notice")
    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.check()
    committed = []
    with pytest.raises(RunLeaseLostError):
        holder.commit(lambda: committed.append(True), lambda: committed.clear())
    assert committed == []
    holder.release()
    record = holder.read_record()
    assert record.run_id == "run-b" and not record.released  # never touches another writer's generation


def test_a_holder_whose_clock_is_a_minute_behind_keeps_its_lease(run_dir):
    """Its lease says it expired a minute ago by the taker's clock: expiry is watched, not trusted."""
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    behind = RunLease(filesystem, path, "run-a", **{**FAST, **options}, clock=lambda: time.time() - 60)
    behind.acquire()
    try:
        assert behind.read_record().expires < time.time()  # "expired", by the taker's clock
        with pytest.raises(RunLeaseHeldError, match="run-a"):
            RunLease(filesystem, path, "run-b", **{**FAST, **options}).acquire()
        behind.verify()  # still the holder
    finally:
        behind.release()


def test_an_unreadable_generation_file_is_watched_and_then_taken_over(run_dir, caplog):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    write_generation(filesystem, path, 4, "", data=b"{}")
    taker = RunLease(filesystem, path, "run-b", **{**FAST, **options})
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        assert taker.acquire() == 5
    taker.release()
    assert "an unreadable lease file; watching it for 2s" in caplog.text


def test_a_commit_rereads_the_lease_instead_of_trusting_the_last_renewal(run_dir):
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=1800, **{"settle_s": 0.0, **options})
    holder.acquire()
    write_generation(filesystem, path, holder.generation + 1, "run-b")
    holder.check()  # no renewal ran since: the flag alone cannot know
    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.verify()
    holder.release()
    assert holder.read_record().run_id == "run-b"


def test_a_holder_fenced_off_while_it_commits_withdraws_the_commit(run_dir):
    """Paused past its TTL between the check before a commit and the commit's write (a taker went on
    meanwhile): its commit marker is withdrawn, so the taker's run never holds a checkpoint of it."""
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=3600, renew_every_s=1800, **{"settle_s": 0.0, **options})
    holder.acquire()
    marker = f"{path}/checkpoint_0000000010_000/.metadata"

    def write_after_a_takeover() -> None:
        write_generation(filesystem, path, holder.generation + 1, "run-b")
        filesystem.create_dir(marker.rsplit("/", 1)[0])
        with filesystem.open_output_stream(marker) as out:
            out.write(b"metadata")

    with pytest.raises(RunLeaseLostError, match="run-b"):
        holder.commit(write_after_a_takeover, lambda: filesystem.delete_file(marker))
    assert filesystem.get_file_info(marker).type == pafs.FileType.NotFound
    holder.release()


@pytest.mark.parametrize("late_s", [0.0, 0.7, 3.0])
def test_of_two_takers_at_most_one_goes_on_whatever_the_write_latency(run_dir, late_s):
    """Both found the lease free; the second's write lands ``late_s`` after its listing, past the
    first's read-back when late (the review's experiment: both went on at 0.7 s without
    conditional writes). Exactly one goes on; the other is refused before it writes a checkpoint."""
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    listed = threading.Event()

    def late_clock() -> float:  # read just before the lease writes its record
        listed.set()
        time.sleep(late_s)
        return time.time()

    takers = [RunLease(filesystem, path, "run-b", **{**FAST, **options}),
              RunLease(filesystem, path, "run-c", **{**FAST, **options}, clock=late_clock)]
    outcomes: dict[str, BaseException | None] = {}

    def take(lease: RunLease, after: threading.Event | None) -> None:
        if after is not None:
            after.wait(timeout=30)  # the late taker has listed the lease as free
        try:
            lease.acquire()
            outcomes[lease.run_id] = None
        except RunLeaseHeldError as err:
            outcomes[lease.run_id] = err

    threads = [threading.Thread(target=take, args=(takers[1], None)),
               threading.Thread(target=take, args=(takers[0], listed))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        winners = [run for run, error in outcomes.items() if error is None]
        assert len(outcomes) == 2 and len(winners) == 1, outcomes
        winner = next(lease for lease in takers if lease.run_id == winners[0])
        wait_until(lambda: winner.read_record().run_id == winner.run_id, timeout=30,
                   what="the winner's renewal to rewrite a late loser's record")
        assert list_generations(filesystem, path) == [winner.generation]
    finally:
        for lease in takers:
            lease.release()


def test_renewals_go_on_after_any_error(tmp_path, caplog):
    """A renewal that raises something other than an OSError (a credential refresh's error) is
    logged, escalated after several in a row, and retried; the lease is kept."""
    failing = iter([False, True, True, True])  # the acquire's write, then three failing renewals

    def clock() -> float:
        if next(failing, False):
            raise RuntimeError("credentials expired")
        return time.time()

    filesystem, path = pafs.LocalFileSystem(), str(tmp_path / "run")
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=20.0, renew_every_s=0.1, clock=clock)
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        holder.acquire()
        renewed = holder.read_record().renewed
        wait_until(lambda: holder.read_record().renewed > renewed, timeout=30, what="a renewal after the errors")
    holder.verify()
    holder.release()
    errors = [r for r in caplog.records if "credentials expired" in r.getMessage()]
    assert [r.levelname for r in errors] == ["WARNING", "WARNING", "ERROR"]


@pytest.fixture
def rejecting_s3(s3_server):
    """The S3 server behind a gateway that answers 501 to conditional PUTs (and passes the rest)."""
    pool = urllib3.PoolManager()
    upstream = f"http://{s3_server.endpoint}"

    class Gateway(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.command == "PUT" and ("If-None-Match" in self.headers or "If-Match" in self.headers):
                status, headers, data = 501, {}, b"<Error><Code>NotImplemented</Code></Error>"
            else:
                sent = {name: value for name, value in self.headers.items() if name.lower() != "expect"}
                answer = pool.request(self.command, upstream + self.path, headers=sent, body=body, redirect=False,
                                      decode_content=False, retries=False)
                status, headers, data = answer.status, answer.headers, answer.data
            self.send_response(status)
            for name, value in headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        def log_message(self, *args) -> None:
            pass

    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    yield dataclasses.replace(s3_server, endpoint=f"127.0.0.1:{gateway.server_address[1]}")
    gateway.shutdown()
    gateway.server_close()


def test_a_store_that_rejects_conditional_writes_falls_back_to_the_read_back_protocol(s3_server, rejecting_s3,
                                                                                        tmp_path, caplog):
    """The conditional requests go through the gateway (the rest straight to the store)."""
    filesystem, path = s3_server.filesystem(), f"{s3_server.bucket}/{tmp_path.name}/run"
    filesystem.create_dir(path)
    unconditional = {**FAST, "settle_s": 2.0, "exclusive": exclusive_create_for(rejecting_s3.filesystem())}
    lease = RunLease(filesystem, path, "run-a", **unconditional)
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        assert lease.acquire() == 0
        lease.release()
        taker = RunLease(filesystem, path, "run-b", **unconditional)
        assert taker.acquire() == 1
        taker.release()
    warnings = [r.getMessage() for r in caplog.records if "refuses conditional writes" in r.getMessage()]
    assert len(warnings) == 2 and "501" in warnings[0]  # once per lease object, then the read-back protocol
    assert lease.read_record().run_id == "run-b" and list_generations(filesystem, path) == [0, 1]


def test_a_taker_whose_writes_keep_outlasting_settle_s_stops_instead_of_trying_for_ever(s3_server, tmp_path):
    """Without exclusive creation, every take whose write took longer than ``settle_s`` is given up
    (it could let a second driver go on): after a few in a row, ``acquire`` says why it stopped."""
    filesystem, path = s3_server.filesystem(), f"{s3_server.bucket}/{tmp_path.name}/run"
    filesystem.create_dir(path)
    taker = RunLease(filesystem, path, "run-a", **{**FAST, "settle_s": 0.0}, conditional_writes=False)
    with pytest.raises(RunLeaseHeldError, match="3 takes were given up.*longer than settle_s=0s"):
        taker.acquire()
    assert list_generations(filesystem, path) == [0, 1, 2]  # each given up after its TTL, none taken


@pytest.mark.parametrize("holder_ttl_s, taker_ttl_s", [(2.0, 30.0), (3600.0, 2.0)])
def test_a_taker_watches_a_lease_for_the_ttl_its_holder_declared(run_dir, caplog, holder_ttl_s, taker_ttl_s):
    """A dead holder that declared a short TTL is taken over after it, not after the taker's longer
    one; a live holder that declared a long TTL (renewing rarely) is not taken over after the
    taker's shorter one."""
    filesystem, path, options = run_dir
    filesystem.create_dir(path)
    holder = RunLease(filesystem, path, "run-a", ttl_s=holder_ttl_s, **{"settle_s": 0.0, **options})
    holder.acquire()
    holder.stop()  # no renewal from now on
    taker = RunLease(filesystem, path, "run-b", ttl_s=taker_ttl_s, **{"settle_s": 0.2, **options})
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        thread = threading.Thread(target=taker.acquire)
        thread.start()
        watching = f"watching it for {holder_ttl_s:.0f}s"
        wait_until(lambda: any(watching in r.getMessage() for r in caplog.records), timeout=30,
                   what=f"the taker to log {watching!r}")
        if holder_ttl_s > taker_ttl_s:  # the holder's driver ends its run: it lets go of its lease
            holder.release()
        thread.join(timeout=60)
    try:
        assert taker.read_record().run_id == "run-b"
        assert not any(f"watching it for {taker_ttl_s:.0f}s" in r.getMessage() for r in caplog.records)
    finally:
        taker.release()


def test_a_lease_declaring_an_endless_ttl_is_watched_an_hour_at_most(tmp_path, caplog):
    """A lease file whose holder declares it never expires (``Infinity``, or 1e300 s) would make
    every later driver wait for ever: it is watched for an hour at most."""
    filesystem, path = pafs.LocalFileSystem(), str(tmp_path / "run")
    filesystem.create_dir(path)
    write_generation(filesystem, path, 0, "", data=b'{"run_id": "run-x", "holder": "host h pid 1", "renewed": 1.0, '
                                                   b'"expires": Infinity, "generation": 0, "token": "t"}')
    taker = RunLease(filesystem, path, "run-b", ttl_s=2.0, settle_s=0.0)
    with caplog.at_level("WARNING", logger="ray_resilient.checkpoint.lease"):
        thread = threading.Thread(target=taker.acquire)
        thread.start()
        wait_until(lambda: any("watching it for 3600s" in r.getMessage() for r in caplog.records), timeout=30,
                   what="the taker to watch the lease for an hour")
        released = (b'{"run_id": "run-x", "holder": "h", "renewed": 1.0, "expires": 2.0, "generation": 0, '
                    b'"token": "t", "released": true}')
        write_generation(filesystem, path, 0, "", data=released)
        thread.join(timeout=60)  # (the test does not wait the hour: the holder's run ended)
    try:
        assert "declares a TTL of inf s" in caplog.text and taker.read_record().run_id == "run-b"
    finally:
        taker.release()
