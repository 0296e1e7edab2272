"""The volume dataset on real JPEGs, local and on a real S3 server: plan, position, cache, bad input."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pyarrow.fs as pafs
import pytest
import torch

from ray_resilient.data import (
    CorruptSampleError,
    FileCache,
    SamplePlan,
    StreamingConfig,
    Volume,
    VolumeDataLoader,
    VolumeError,
    VolumeImageDataset,
    default_cache_dir,
    default_transform,
)
from ray_resilient.lifecycle import DataProgressSource
from ray_resilient.data.cache import entry_name
from ray_resilient.data.dataset import read_bytes
from ray_resilient.data.prefetch import Prefetcher
from ray_resilient.data.s3_get import SignedGetReader
from ray_resilient.storage.uri import s3_settings

GLOBAL_BATCH = 6  # the session's image_dir volume has 69 images: an uneven count


def make_loader(volume: Volume, cache_dir, rank=0, world=1, workers=2, skip_corrupt=False,
                **streaming) -> VolumeDataLoader:
    dataset = VolumeImageDataset(volume, global_batch=GLOBAL_BATCH, rank=rank, world_size=world, seed=11,
                                 transform=default_transform(16), skip_corrupt=skip_corrupt,
                                 streaming=StreamingConfig(str(cache_dir), **streaming))
    return VolumeDataLoader(dataset, num_workers=workers)


def global_batches(loaders: list[VolumeDataLoader], epochs: int = 1) -> list[tuple[list[int], torch.Tensor]]:
    """The global sequence the ranks' loaders produce: per global batch, sample ids and images."""
    out = []
    for _ in range(epochs):
        for per_rank in zip(*loaders, strict=True):
            out.append((sum((b.sample_ids.tolist() for b in per_rank), []), torch.cat([b.images for b in per_rank])))
    return out


# --- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_plan_covers_each_epoch_exactly_and_evenly(world, workers, drop_last):
    plan = SamplePlan(69, GLOBAL_BATCH, world, seed=3, drop_last=drop_last)
    for epoch in (0, 1):
        served = {r: [] for r in range(world)}
        for rank in range(world):
            for worker in range(workers):
                for _number, idx in plan.worker_batches(epoch, rank, worker, workers):
                    served[rank].append(idx.tolist())
        assert len({len(batches) for batches in served.values()}) == 1  # equal batch counts per rank
        everything = sorted(i for batches in served.values() for b in batches for i in b)
        if drop_last:
            assert len(everything) == 66 and len(set(everything)) == 66  # no duplicates; the 3-sample tail dropped
        else:
            assert set(everything) == set(range(69)) and len(everything) == 72  # padded with 3 repeats
    assert not np.array_equal(plan.permutation(0), plan.permutation(1))


def test_plan_rejects_layouts_that_leave_someone_without_data():
    with pytest.raises(ValueError, match="not divisible by the world size 4"):
        SamplePlan(69, 6, 4)
    with pytest.raises(ValueError, match="5 samples cannot fill one global batch of 6"):
        SamplePlan(5, 6, 2)
    with pytest.raises(ValueError, match="12 DataLoader workers per rank but only 11 batches"):
        SamplePlan(69, 6, 2).check_workers(12)


# --- volumes -------------------------------------------------------------------------------------


def test_image_folder_listing_is_sorted_and_labelled(image_dir):
    volume = Volume(image_dir)
    assert volume.classes == ["class_0_disc", "class_1_square", "class_2_triangle"]
    assert [f.path for f in volume.files] == sorted(f.path for f in volume.files)
    assert {f.label for f in volume.files if f.path.startswith("class_1")} == {1}
    assert len(Volume(image_dir, pattern="class_2*/0000*.jpg").files) == 10


def test_local_and_s3_volumes_give_identical_samples(image_dir, s3_server, tmp_path):
    fs = s3_server.filesystem()
    prefix = f"{s3_server.bucket}/volumes/shapes"
    pafs.copy_files(image_dir, prefix, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    os.environ.update(AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key)
    remote = Volume(f"s3://{prefix}", endpoint=f"http://{s3_server.endpoint}")
    local = Volume(image_dir)
    assert remote.listing() == local.listing()
    s3_loader, disk_loader = make_loader(remote, tmp_path / "cache-s3"), make_loader(local, tmp_path / "cache-local")
    from_s3, from_disk = global_batches([s3_loader]), global_batches([disk_loader])
    assert [ids for ids, _ in from_s3] == [ids for ids, _ in from_disk]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(from_s3, from_disk))
    # What the hang watchdog sees of the worker processes (spawned for S3, forked here) while it waits.
    assert isinstance(s3_loader, DataProgressSource)  # the checkpointer's watchdog polls it
    assert s3_loader.samples_read == disk_loader.samples_read == sum(len(ids) for ids, _ in from_s3)


class TcpForwarder:
    """Forwards 127.0.0.1:<port> to ``upstream``, one thread pair per connection, until :meth:`close`,
    which also cuts the open connections (the storage endpoint going away)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream, self._sockets = upstream, []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # stops listening and wakes the accept()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _s3_volume(image_dir, s3_server, name: str, endpoint: str, **options) -> Volume:
    prefix = f"{s3_server.bucket}/volumes/{name}"
    pafs.copy_files(image_dir, prefix, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3_server.filesystem())
    return Volume(f"s3://{prefix}", endpoint=endpoint, access_key=s3_server.access_key,
                  secret_key=s3_server.secret_key, **options)


def test_s3_errors_retrying_cannot_fix_name_the_file_at_once(image_dir, s3_server, tmp_path, caplog):
    volume = _s3_volume(image_dir, s3_server, "vanishing", f"http://{s3_server.endpoint}")
    gone = volume.files[3]
    s3_server.filesystem().delete_file(f"{volume.root}/{gone.path}")
    with pytest.raises(VolumeError, match=f"{gone.path} failed: GET .* answered 404"):
        volume.download(gone.path, str(tmp_path / "x"))
    assert "retrying" not in caplog.text  # a missing object is not retried
    assert volume.download(volume.files[0].path, str(tmp_path / "y")) == volume.files[0].size


def test_transient_s3_failures_are_retried_then_name_the_file(image_dir, s3_server, tmp_path, caplog):
    host, port = s3_server.endpoint.split(":")
    forwarder = TcpForwarder((host, int(port)))
    volume = _s3_volume(image_dir, s3_server, "flaky", f"http://127.0.0.1:{forwarder.port}", retry_seconds=1.0)
    first = volume.files[0]
    assert volume.download(first.path, str(tmp_path / "ok")) == first.size
    forwarder.close()  # the endpoint goes away: a kept-alive connection breaks, new ones are refused
    with pytest.raises(VolumeError, match=rf"{volume.files[1].path} failed after \d+ attempts in 1\.\ds"):
        volume.download(volume.files[1].path, str(tmp_path / "broken"))
    assert caplog.text.count("retrying in") >= 2


class ThrottlingProxy:
    """An HTTP proxy to ``upstream`` that forwards every request as it came (the signed Host header
    included), except while throttling: then it answers 503 SlowDown, as S3 does. It counts the
    GETs of each path, and forwards each one ``latency`` seconds late (a far-away store)."""

    def __init__(self, upstream: str, latency: float = 0.0):
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.throttled, self.throttling = 0, threading.Event()
        self.gets: collections.Counter[str] = collections.Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self) -> None:
                if proxy.throttling.is_set():
                    proxy.throttled += 1
                    self._answer(503, [], b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
                                          b"</Message></Error>")
                    return
                if self.command == "GET":
                    proxy.gets[self.path.split("?", 1)[0]] += 1
                    time.sleep(latency)
                length = int(self.headers.get("Content-Length") or 0)
                connection = http.client.HTTPConnection(upstream)
                connection.request(self.command, self.path, body=self.rfile.read(length) if length else None,
                                   headers=dict(self.headers.items()))
                answer = connection.getresponse()
                self._answer(answer.status, answer.getheaders(), answer.read())
                connection.close()

            do_GET = do_HEAD = _forward

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_s3_throttling_is_retried_until_it_ends_and_a_full_local_disk_is_named_at_once(image_dir, s3_server,
                                                                                         tmp_path, caplog):
    proxy = ThrottlingProxy(s3_server.endpoint)
    try:
        volume = _s3_volume(image_dir, s3_server, "throttled", f"http://127.0.0.1:{proxy.port}")
        first = volume.files[0]
        proxy.throttling.set()
        threading.Timer(2.0, proxy.throttling.clear).start()  # S3 throttles for 2 s
        assert volume.download(first.path, str(tmp_path / "f")) == first.size
        assert proxy.throttled >= 2 and "503" in caplog.text and "SlowDown" in caplog.text
        assert (tmp_path / "f").read_bytes() == (Path(image_dir) / first.path).read_bytes()
        caplog.clear()
        with pytest.raises(VolumeError, match=r"writing the local copy .* No space left on device .* cache's disk"):
            volume.download(first.path, "/dev/full")  # every write to it fails with ENOSPC
        assert "retrying" not in caplog.text
    finally:
        proxy.close()


def test_a_loaders_retries_of_a_throttled_volume_count_as_its_progress(image_dir, s3_server, tmp_path):
    """The volume throttles (503 SlowDown) for 2 s as the loader starts: its download process
    retries, and each retry reaches the loader's count of progress (what the hang watchdog polls
    while the training loop waits for the batch), beside the samples read."""
    proxy = ThrottlingProxy(s3_server.endpoint)
    try:
        volume = _s3_volume(image_dir, s3_server, "throttled-loader", f"http://127.0.0.1:{proxy.port}")
        loader = make_loader(volume, tmp_path / "cache", workers=0)
        assert loader.loading_progress == 0
        proxy.throttling.set()
        threading.Timer(2.0, proxy.throttling.clear).start()  # S3 throttles for 2 s
        batch = next(iter(loader))
        retried = loader.volume_dataset.reads_retried
        assert proxy.throttled >= retried >= 1
        assert loader.loading_progress == loader.samples_read + retried and loader.samples_read >= len(batch.labels)
    finally:
        proxy.close()


def _fetch_into_cache(volume: Volume, cache_dir: str, files: list[tuple[str, int]]) -> list[str]:
    cache = FileCache(cache_dir)
    return [cache.fetch(path, size, lambda dest, path=path: volume.download(path, dest)) for path, size in files]


@pytest.mark.slow  # four spawned processes
def test_processes_missing_the_same_files_download_each_once_per_node(image_dir, s3_server, tmp_path):
    """4 processes miss the same 5 files of a far-away S3 (0.3 s per GET) at once, each with its own
    cache object on the node's cache directory: every file is fetched once, all get it byte-exact."""
    proxy = ThrottlingProxy(s3_server.endpoint, latency=0.3)
    try:
        volume = _s3_volume(image_dir, s3_server, "once", f"http://127.0.0.1:{proxy.port}")
        files = [(f.path, f.size) for f in volume.files[:5]]
        proxy.gets.clear()  # the listing's GETs
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(4, mp_context=spawn) as pool:
            results = list(pool.map(_fetch_into_cache, *zip(*[(volume, str(tmp_path / "cache"), files)] * 4)))
    finally:
        proxy.close()
    assert len(proxy.gets) == 5 and set(proxy.gets.values()) == {1}, proxy.gets
    for paths in results:
        for (key, _), path in zip(files, paths):
            assert Path(path).read_bytes() == (Path(image_dir) / key).read_bytes()


SPECIAL_KEYS = ("golden retriever/a+b (1).jpg", "café/x=y.jpg", "odd/100% & ~tilde;'quote'.jpg")


def test_s3_gets_are_signed_as_aws_expects_and_keys_with_special_characters_download_byte_exact(s3_server, tmp_path):
    fs = s3_server.filesystem()
    contents = {key: os.urandom(5000 + i) for i, key in enumerate(SPECIAL_KEYS)}
    for key, data in contents.items():
        with fs.open_output_stream(f"{s3_server.bucket}/special/{key}") as out:
            out.write(data)
    reader = SignedGetReader(f"http://{s3_server.endpoint}", "us-east-1", s3_server.access_key, s3_server.secret_key)
    for key, data in contents.items():  # SeaweedFS checks every signature (a wrong one is a 403)
        assert reader.download(f"{s3_server.bucket}/special/{key}", str(tmp_path / "f")) == len(data)
        assert (tmp_path / "f").read_bytes() == data, key
    url, headers = reader.signed_get(f"{s3_server.bucket}/café/x=y.jpg")
    assert url == f"http://{s3_server.endpoint}/{s3_server.bucket}/caf%C3%A9/x%3Dy.jpg"  # path style, encoded once
    assert headers["X-Amz-Content-SHA256"] and "x-amz-content-sha256" in headers["Authorization"]
    aws = SignedGetReader(None, "eu-west-1", "AKID", "SECRET")
    url, headers = aws.signed_get("my-bucket/golden retriever/a+b (1).jpg")
    assert url == "https://my-bucket.s3.eu-west-1.amazonaws.com/golden%20retriever/a%2Bb%20%281%29.jpg"
    assert "X-Amz-Content-SHA256" in headers and "/eu-west-1/s3/aws4_request" in headers["Authorization"]
    assert aws.signed_get("dotted.bucket/k")[0] == "https://s3.eu-west-1.amazonaws.com/dotted.bucket/k"


def test_s3_credentials_from_a_shared_credentials_file_are_resolved_once(image_dir, s3_server, tmp_path,
                                                                         monkeypatch):
    source = _s3_volume(image_dir, s3_server, "chain", f"http://{s3_server.endpoint}")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\n"
                           f"aws_secret_access_key = {s3_server.secret_key}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    volume = Volume(f"s3://{source.root}", endpoint=f"http://{s3_server.endpoint}")  # no keys: the chain
    assert volume.listing() == source.listing()
    for i in range(3):
        assert volume.download(volume.files[i].path, str(tmp_path / f"f{i}")) == volume.files[i].size
    reader = volume._signed_get
    resolved = reader._chain
    assert resolved is not None and reader._credentials().access_key == s3_server.access_key
    assert reader._chain is resolved  # not once per request (a botocore session costs ~5 ms)


def test_temporary_s3_credentials_from_the_environment_keep_their_session_token(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-token")
    assert s3_settings()[2:] == ("env-key", "env-secret", "env-token")
    # explicit keys are not paired with another identity's token from the environment
    assert s3_settings(access_key="mine", secret_key="my-secret")[2:] == ("mine", "my-secret", None)


# --- the exact position --------------------------------------------------------------------------


def resume_sequence(volume, tmp_path, before: int, world_before=2, workers_before=2, world_after=2,
                    workers_after=2, epochs=2):
    """Consume ``before`` global batches, checkpoint the position, resume on a new layout, finish."""
    first = [make_loader(volume, tmp_path / "cache", r, world_before, workers_before) for r in range(world_before)]
    seen = []
    iterators = [iter(loader) for loader in first]
    for _ in range(before):
        per_rank = [next(it) for it in iterators]
        seen.append((sum((b.sample_ids.tolist() for b in per_rank), []), torch.cat([b.images for b in per_rank])))
    states = [loader.state_dict() for loader in first]
    second = [make_loader(volume, tmp_path / "cache", r, world_after, workers_after) for r in range(world_after)]
    for loader in second:
        if world_after == world_before:
            loader.load_state_dict(states[loader.volume_dataset.rank])
        else:
            loader.load_resharded_state_dicts(states)
    remaining_epochs = epochs - second[0].epoch
    return seen + global_batches(second, remaining_epochs), states[0]


@pytest.fixture(scope="module")
def uninterrupted(image_dir, tmp_path_factory):
    volume = Volume(image_dir)
    cache = tmp_path_factory.mktemp("cache")
    return global_batches([make_loader(volume, cache, r, 2, 2) for r in range(2)], epochs=2)


@pytest.mark.parametrize(
    ("before", "layout"),
    [
        (0, {}),
        (4, {}),  # mid-epoch
        (11, {}),  # exactly at the end of epoch 0 (11 global batches of 6 in 69 samples)
        (4, {"world_after": 1}),
        (4, {"workers_after": 0}),
        (7, {"world_before": 1, "workers_before": 0, "world_after": 2, "workers_after": 3}),
    ],
)
def test_resume_continues_the_same_global_sequence(image_dir, tmp_path, uninterrupted, before, layout):
    sequence, state = resume_sequence(Volume(image_dir), tmp_path, before, **layout)
    assert [ids for ids, _ in sequence] == [ids for ids, _ in uninterrupted]
    # Augmentation is seeded per (seed, epoch, sample): the same pixels on any layout.
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sequence, uninterrupted))
    if before == 11:
        assert (state["epoch"], state["samples"]) == (1, 0)


def test_resume_twice_in_a_row(image_dir, tmp_path, uninterrupted):
    volume = Volume(image_dir)
    loader = make_loader(volume, tmp_path / "cache")
    position = loader.state_dict()
    ids = []
    for stop in (3, 8, 15):  # resume, take a few batches, checkpoint, resume again ...
        loader = make_loader(volume, tmp_path / "cache")
        loader.load_state_dict(position)
        while len(ids) < stop:
            if loader.epoch == 2:
                break
            for batch in loader:
                ids.append(batch.sample_ids.tolist())
                if len(ids) == stop:
                    break
        position = loader.state_dict()
    reference = [i for i, _ in global_batches([make_loader(volume, tmp_path / "cache2", 0, 1, 2)], epochs=2)]
    assert ids == reference[:15]


def test_survivor_replicas_read_exactly_the_plans_micro_batches_and_a_new_membership_replans_at_its_step(
        image_dir, tmp_path, uninterrupted):
    """Survivor mode's reads: micro-batch k of 3 of each global batch is its k-th third, whichever
    replica reads it. Three replicas (2, 1 and 0 DataLoader workers) train steps 0-4; replica 1
    is lost after reading its part of step 5, which the others then train again as 2 replicas
    (across the epoch's end at step 11); a replacement restored from replica 0's position joins
    at step 15. Every step's micro-batches, in order, are the uninterrupted run's global batch, and
    reading one (starting an epoch's iteration included) leaves torch's RNG as it was."""
    volume, parts = Volume(image_dir), 3
    loaders = [make_loader(volume, tmp_path / "cache", rank, 3, workers) for rank, workers in enumerate((2, 1, 0))]
    served: dict[int, dict[int, tuple[list[int], torch.Tensor]]] = collections.defaultdict(dict)

    def train(step: int, members: list[VolumeDataLoader]) -> None:
        for rank, loader in enumerate(members):
            loader.assign_micro_batches(step, rank, len(members), parts)
            for k in range(rank, parts, len(members)):
                rng = torch.get_rng_state()
                batch = loader.micro_batch(step, k)
                assert torch.equal(torch.get_rng_state(), rng)  # the loss's noise is the micro-batch's own
                assert (batch.global_batch, batch.micro_batch) == (step % 11, k)
                served[step][k] = (batch.sample_ids.tolist(), batch.images)

    for step in range(5):
        train(step, loaders)
    loaders[1].assign_micro_batches(5, 1, 3, parts)
    loaders[1].micro_batch(5, 1)  # read, then lost with the step
    survivors = [loaders[0], loaders[2]]
    for step in range(5, 15):
        train(step, survivors)
    assert survivors[0].state_dict()["epoch"] == 1 and survivors[0].state_dict()["samples"] == 4 * GLOBAL_BATCH
    replacement = make_loader(volume, tmp_path / "cache", 1, 3, 1)
    replacement.load_state_dict(survivors[0].state_dict())
    for step in range(15, 22):
        train(step, [loaders[0], replacement, loaders[2]])
    for step, (ids, images) in enumerate(uninterrupted):
        assert sum((served[step][k][0] for k in range(parts)), []) == ids
        assert torch.equal(torch.cat([served[step][k][1] for k in range(parts)]), images)
    with pytest.raises(RuntimeError, match=r"micro-batch 2 of step 22 was asked for where \(22, 0\) is due"):
        loaders[0].micro_batch(22, 2)
    with pytest.raises(ValueError, match="global batch size 6 is not divisible into 4 micro-batches"):
        loaders[0].assign_micro_batches(22, 0, 2, 4)
    with pytest.raises(ValueError, match="replica 3 of 4 cannot share 3 micro-batches"):
        loaders[0].assign_micro_batches(22, 3, 4, 3)


def test_position_of_another_volume_is_refused(image_dir, tmp_path):
    loader = make_loader(Volume(image_dir), tmp_path / "cache")
    state = loader.state_dict()
    smaller = make_loader(Volume(image_dir, pattern="class_[01]*"), tmp_path / "cache")
    with pytest.raises(ValueError, match="another volume listing"):
        smaller.load_state_dict(state)


# --- the cache -----------------------------------------------------------------------------------


def cached_bytes(cache_dir) -> int:
    """Bytes of complete cached files, read under the cache's insert lock for a consistent view."""
    with open(cache_dir / ".evict.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        return sum(f.stat().st_size for f in cache_dir.rglob("*.jpg") if f.is_file())


def test_cache_never_exceeds_its_limit(image_dir, tmp_path):
    volume = Volume(image_dir)
    limit = sum(f.size for f in volume.files) // 3
    cache_dir = tmp_path / "cache"
    loader = make_loader(volume, cache_dir, workers=2, cache_limit=limit, prefetch_files=4, prefetch_bytes=limit // 3)
    peak = 0
    for _ in range(2):
        for _batch in loader:
            peak = max(peak, cached_bytes(cache_dir))
    assert 0 < peak <= limit
    assert loader.metrics.cache.misses > len(volume.files)  # evicted files were downloaded again


KIB = 1024


def _insert_files(cache_dir: str, keys: list[str], limit: int) -> int:
    """Insert 1 KiB files under ``keys`` into a limited cache; returns how often it walked the cache."""
    cache = FileCache(cache_dir, limit_bytes=limit)

    def write(dest: str) -> int:
        with open(dest, "wb") as out:
            out.write(os.urandom(KIB))
        return KIB

    for key in keys:
        cache.fetch(key, KIB, write)
    return cache.stats.eviction_walks


def test_a_full_cache_walks_once_per_headroom_of_misses_and_its_shared_counter_stays_true(tmp_path):
    """Two processes insert 1,000 files of 1 KiB, interleaved, into one 100 KiB cache: the limit
    holds, the node's byte counter matches the disk, and the cache is walked about once per 10 KiB
    (its 10% headroom) of misses instead of at every miss once full (900 walks)."""
    cache_dir = tmp_path / "cache"
    keys = [f"d{i % 7}/f{i:04d}.bin" for i in range(1000)]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:  # local files only
        walks = sum(pool.map(_insert_files, [str(cache_dir)] * 2, [keys[0::2], keys[1::2]], [100 * KIB] * 2))
    on_disk = sum(f.stat().st_size for f in cache_dir.rglob("*.bin"))
    assert 90 * KIB <= on_disk <= 100 * KIB
    assert int((cache_dir / ".bytes").read_text()) == on_disk
    assert 0 < walks <= 900 // 10 + 2, walks


def test_any_key_is_cached_pinned_and_evicted_inside_the_cache_directory(tmp_path):
    """Volume paths longer than a file name may be (a lock was named by the flattened key:
    ENAMETOOLONG), and S3 keys that climb out with ``..`` or start at ``/``: each is cached under
    the cache directory and nowhere else, read back whole, pinned, and evicted within the limit."""
    cache_dir = tmp_path / "cache"
    cache = FileCache(str(cache_dir), limit_bytes=2 * KIB)
    keys = ["/".join(["d" * 100] * 3) + "/f.jpg", "x" * 1000, "../../outside.bin", "/tmp/absolute.bin",
            "a/../../../b.bin"]
    for number, key in enumerate(keys):
        def write(dest: str, content: bytes = bytes([number]) * KIB) -> int:
            Path(dest).write_bytes(content)
            return KIB

        handle = cache.pin(key)
        path = Path(cache.fetch(key, KIB, write))
        assert path.resolve().is_relative_to(cache_dir.resolve()), (key, path)
        assert path.read_bytes() == bytes([number]) * KIB and cache.lookup(key, KIB) == str(path)
        cache.unpin(handle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # nothing written outside it
    assert not Path("/tmp/absolute.bin").exists()
    cached = [p for p in cache_dir.rglob("*") if p.is_file() and not p.name.startswith(".") and
              ".locks" not in p.parts]
    assert sum(p.stat().st_size for p in cached) <= 2 * KIB  # evicted within the limit
    assert cache.lookup(keys[-1], KIB) is not None  # the newest stays


def test_restarted_job_reuses_the_cache(image_dir, tmp_path):
    volume = Volume(image_dir)
    first = make_loader(volume, tmp_path / "cache")
    list(first)
    again = make_loader(volume, tmp_path / "cache")
    list(again)
    assert again.metrics.cache.misses == 0 and again.metrics.cache.hits > 0


def test_a_cached_file_changed_at_the_same_size_is_caught_by_the_next_process_and_downloaded_again(
        tmp_path, caplog):
    cache_dir = str(tmp_path / "cache")

    def write(dest: str) -> int:
        return Path(dest).write_bytes(b"a" * KIB)

    cached = Path(FileCache(cache_dir).fetch("f.bin", KIB, write))
    cached.write_bytes(b"b" * KIB)  # changed on the node's disk, same size
    assert FileCache(cache_dir).lookup("f.bin", KIB) is None  # a cache opened anew (another process) hashes it
    assert f"cached f.bin ({cached}) differs from its digest" in caplog.text
    again = FileCache(cache_dir)
    assert again.fetch("f.bin", KIB, write) == str(cached) and cached.read_bytes() == b"a" * KIB
    assert (again.stats.hits, again.stats.misses) == (0, 1)
    assert FileCache(cache_dir).lookup("f.bin", KIB) == str(cached)  # verified anew by the next process


def test_a_restarted_loader_serves_the_volumes_bytes_not_a_cached_file_changed_since(image_dir, tmp_path):
    volume = Volume(image_dir)
    first = make_loader(volume, tmp_path / "cache")
    expected = [batch.images for batch in first]
    victim = Path(FileCache(str(tmp_path / "cache")).path(volume.files[0].path))
    victim.write_bytes(bytes(victim.stat().st_size))  # zeroed: it no longer decodes
    again = make_loader(volume, tmp_path / "cache")
    assert all(torch.equal(a.images, b) for a, b in zip(again, expected, strict=True))
    assert again.metrics.cache.misses >= 1
    assert victim.read_bytes() == (Path(image_dir) / volume.files[0].path).read_bytes()  # downloaded again


def test_the_default_cache_directory_is_private_to_the_user(image_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "ray-resilient").mkdir(mode=0o777)
    (tmp_path / "ray-resilient").chmod(0o777)  # open to every local user, as a umask of 0 leaves it
    cache_dir = Path(default_cache_dir(Volume(image_dir)))
    assert cache_dir.parent.parent == tmp_path / "ray-resilient"
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in (cache_dir, cache_dir.parent, cache_dir.parent.parent)} == {
        oct(0o700)}


def test_a_file_evicted_from_the_window_by_another_process_is_downloaded_again(image_dir, tmp_path):
    """An unlimited cache takes no pins; a process sharing its directory with a limit may evict."""
    volume = Volume(image_dir)
    cache = FileCache(str(tmp_path / "cache"))
    for file in volume.files[:8]:
        cache.fetch(file.path, file.size, lambda dest, path=file.path: volume.download(path, dest))
    prefetcher = Prefetcher(volume, cache, threads=2, max_files=8, max_bytes=1 << 30)
    prefetcher.restart(iter(range(8)))  # all eight are cache hits in the window
    for file in volume.files[1:8]:
        os.remove(cache.path(file.path))  # what another process's eviction does
    read = [prefetcher.read(sample, read_bytes) for sample in range(8)]
    prefetcher.close()
    expected = [(Path(image_dir) / f.path).read_bytes() for f in volume.files[:8]]
    assert [bytes(t.numpy()) for t in read] == expected
    assert (cache.stats.hits, cache.stats.misses) == (8, 8 + 7)


def test_a_failed_download_in_the_download_process_names_the_file(image_dir, tmp_path):
    root = tmp_path / "volume"
    for file in Volume(image_dir).files[:4]:
        (root / file.path).parent.mkdir(parents=True, exist_ok=True)
        (root / file.path).write_bytes((Path(image_dir) / file.path).read_bytes())
    volume = Volume(str(root))
    gone = volume.files[2]
    (root / gone.path).unlink()  # after the listing: the download fails in the child (not retried: it is gone)
    prefetcher = Prefetcher(volume, FileCache(str(tmp_path / "cache")), threads=2, max_files=4, max_bytes=1 << 30)
    prefetcher.restart(iter(range(4)))
    assert [bytes(prefetcher.read(i, read_bytes).numpy()) for i in (0, 1)] == [
        (root / f.path).read_bytes() for f in volume.files[:2]]
    with pytest.raises(VolumeError, match=f"{gone.path} failed: .*No such file"):
        prefetcher.read(2, read_bytes)
    prefetcher.close()


def test_the_download_process_exits_with_its_worker(image_dir, tmp_path):
    """SIGKILL the process that owns a Prefetcher: its download process sees the socket close and exits."""
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys
        from ray_resilient.data import FileCache, Volume
        from ray_resilient.data.prefetch import Prefetcher
        volume = Volume({image_dir!r})
        prefetcher = Prefetcher(volume, FileCache({str(cache_dir)!r}), threads=2, max_files=8, max_bytes=1 << 30)
        prefetcher.restart(iter(range(len(volume.files))))
        prefetcher.read(0, lambda path: None)
        print("read", flush=True)
        sys.stdin.read()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "read\n"
        (download_process,) = psutil.Process(owner.pid).children()
        assert download_process.nice() > psutil.Process(owner.pid).nice()  # decoding comes first
    finally:
        owner.kill()
        owner.wait()
    download_process.wait(timeout=30)  # raises psutil.TimeoutExpired if it outlives its worker
    leftovers = [p.name for p in cache_dir.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def test_a_download_killed_midway_leaves_no_corrupt_cached_file(tmp_path):
    """SIGKILL a process while it streams a file into the cache (from a FIFO it blocks on)."""
    source = tmp_path / "volume"
    source.mkdir()
    fifo = source / "big.bin"
    os.mkfifo(fifo)
    cache_dir = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import shutil
        from ray_resilient.data import FileCache
        def download(dest):
            with open({str(fifo)!r}, "rb") as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1024)
                return dst.tell()
        FileCache({str(cache_dir)!r}).fetch("big.bin", 1 << 20, download)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    cached = cache_dir / entry_name("big.bin")
    with open(fifo, "wb") as writer:
        writer.write(b"x" * 300_000)
        writer.flush()
        while not any(p.stat().st_size >= 200_000 for p in cached.parent.glob(f"{cached.name}.tmp-*")):
            assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not cached.exists()
    assert list(cached.parent.glob(f"{cached.name}.tmp-*"))  # the leftover, until the next cache opens
    cache = FileCache(str(cache_dir))
    assert not list(cached.parent.glob(f"{cached.name}.tmp-*"))

    def download(dest: str) -> int:
        with open(dest, "wb") as out:
            return out.write(b"y" * 1000)

    assert open(cache.fetch("big.bin", 1000, download), "rb").read() == b"y" * 1000


# --- bad input -----------------------------------------------------------------------------------


def test_missing_and_empty_volumes_are_named(tmp_path):
    with pytest.raises(VolumeError, match=f"volume {tmp_path / 'nope'} does not exist"):
        Volume(str(tmp_path / "nope"))
    (tmp_path / "empty" / "class_a").mkdir(parents=True)
    (tmp_path / "empty" / "class_a" / "notes.txt").write_text("not an image")
    with pytest.raises(VolumeError, match="has no files matching"):
        Volume(str(tmp_path / "empty"))


def test_corrupt_image_raises_naming_the_file_or_is_skipped_and_counted(image_dir, tmp_path):
    broken = tmp_path / "broken"
    pafs.copy_files(image_dir, str(broken))
    victim = sorted((broken / "class_1_square").iterdir())[4]
    victim.write_bytes(b"\xff\xd8 this is not a jpeg")
    with pytest.raises(CorruptSampleError, match=f"cannot decode .*{victim.name}"):
        list(make_loader(Volume(str(broken)), tmp_path / "cache", workers=0))
    loader = make_loader(Volume(str(broken)), tmp_path / "cache2", workers=2, skip_corrupt=True)
    served = [i for batch in loader for i in batch.sample_ids.tolist()]
    victim_index = next(i for i, f in enumerate(loader.volume_dataset.volume.files) if f.path.endswith(
        f"class_1_square/{victim.name}"))
    in_epoch = victim_index in loader.volume_dataset.plan.permutation(0)  # not in the dropped tail
    assert loader.metrics.skipped_samples == int(in_epoch)
    assert len(served) == 66 - int(in_epoch) and victim_index not in served


def test_unusable_cache_settings_are_refused(image_dir, tmp_path):
    volume = Volume(image_dir)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(VolumeError, match="is not writable"):
        make_loader(volume, blocker / "cache")
    with pytest.raises(ValueError, match="smaller than the prefetch window"):
        make_loader(volume, tmp_path / "cache", cache_limit=1000, prefetch_bytes=5000)
    with pytest.raises(ValueError, match="only 11 batches per epoch"):
        make_loader(volume, tmp_path / "cache", workers=12)


@pytest.mark.parametrize("bad, named", [
    ({"cache_limit": -1}, "cache_limit must be a positive number of bytes, or None.*got -1"),
    ({"cache_limit": 0}, "cache_limit must be a positive.*got 0"),
    ({"prefetch_files": 0}, "prefetch_files must be a positive number of files; got 0"),
    ({"prefetch_bytes": -5}, "prefetch_bytes must be a positive number of bytes; got -5"),
    ({"prefetch_threads": 0}, "prefetch_threads must be a positive.*got 0"),
    ({"prefetch_threads": 2.5}, "prefetch_threads must be a positive.*got 2.5"),
    ({"cache_dir": ""}, "cache_dir is empty"),
])
def test_a_bad_streaming_value_is_refused_at_construction_naming_it(bad, named):
    with pytest.raises(ValueError, match=named):
        StreamingConfig(**bad)


def test_loader_logs_fetch_seconds_and_cache_metrics_to_mlflow(image_dir, tmp_path):
    from ray_resilient.tracking import MlflowMetrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    volume = Volume(image_dir)
    dataset = VolumeImageDataset(volume, global_batch=GLOBAL_BATCH, seed=1,
                                 streaming=StreamingConfig(str(tmp_path / "cache")))
    mlflow_metrics, reported = MlflowMetrics("data-run", tracking_uri=uri, prefix="data/"), []

    def log(metrics: dict[str, float], step: int) -> None:
        reported.append(metrics)
        mlflow_metrics(metrics, step)

    # An attempt killed after 5 batches, and the restarted one resuming from its position: the
    # steps continue where the first attempt's ended instead of starting again at 1.
    first = VolumeDataLoader(dataset, num_workers=2, log_every=2, metrics_logger=log)
    batches = iter(first)
    for _ in range(5):
        next(batches)
    position = first.state_dict()
    del batches
    loader = VolumeDataLoader(dataset, num_workers=2, log_every=2, metrics_logger=log)
    loader.load_state_dict(position)
    list(loader)
    assert (loader.epoch, loader.global_batches) == (1, dataset.batches_per_epoch(0))
    again = MlflowMetrics("data-run", tracking_uri=uri)  # a restarted attempt finds the same run
    history = again.client.get_metric_history(again.run_id, "data/fetch_seconds")
    assert [m.step for m in history] == list(range(2, dataset.batches_per_epoch(0) + 1, 2))
    assert all(m.value >= 0 for m in history)
    misses = again.client.get_metric_history(again.run_id, "data/cache_misses")
    assert [m.value for m in misses] == [r["cache_misses"] for r in reported]
    assert misses[0].value > 0 and misses[-1].value <= loader.metrics.cache.misses  # each attempt its own counts


def test_an_mlflow_outage_neither_blocks_nor_fails_the_loop(image_dir, tmp_path, monkeypatch, caplog):
    """The tracking server is down (a closed port): its client retries for minutes, then raises."""
    from ray_resilient.tracking import BackgroundMetrics

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    dataset = VolumeImageDataset(Volume(image_dir), global_batch=4, seed=1,
                                 streaming=StreamingConfig(str(tmp_path / "cache")))
    loader = VolumeDataLoader(dataset, num_workers=0, log_every=1)
    batches = sum(1 for _ in loader)  # 17 batches, each logged, while the client is stuck retrying
    background = loader.metrics_logger
    assert isinstance(background, BackgroundMetrics) and batches == 69 // 4
    assert background.delivered == 0  # every call returned while the first delivery still hung
    # Flooded past the bounded queue: dropped, counted, warned once.
    flood = BackgroundMetrics(background._make_logger, "flood", max_queued=4)
    for step in range(50):
        flood({"x": 1.0}, step)
    assert flood.dropped >= 50 - 4 - 1 and caplog.text.count("not being delivered fast enough") == 1
    # A client that gives up at once: the failures are counted and warned about once, nothing raises.
    # (Another MLflow run: the loader's logger is still retrying its run's find-or-create.)
    from ray_resilient.tracking import MlflowMetrics

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    failing = BackgroundMetrics(lambda: MlflowMetrics("failing"), "failing")
    for step in range(3):
        failing({"x": 1.0}, step)
    assert failing.flush(timeout=120) and failing.failed == 3 and failing.delivered == 0
    assert caplog.text.count("logging failing metrics failed") == 1


def test_loggers_of_one_run_that_start_at_once_share_one_mlflow_run(tmp_path):
    """The job's, the loader's and the goodput recorder's loggers each find-or-create the run's MLflow
    run from their own thread, at the same moment: one run, and it is the one each logs to."""
    from ray_resilient.tracking import RUN_TAG, MlflowMetrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowMetrics("another-run", uri)  # creates the store and the experiment: only the run is raced for
    start = threading.Barrier(4)

    def logger(_) -> MlflowMetrics:
        start.wait()
        return MlflowMetrics("at-once", uri)

    with ThreadPoolExecutor(4) as pool:
        loggers = list(pool.map(logger, range(4)))
    client = loggers[0].client
    experiment = client.get_experiment_by_name("ray_resilient").experiment_id
    runs = client.search_runs([experiment], f"tags.`{RUN_TAG}` = 'at-once'")
    assert [run.info.run_id for run in runs] == [loggers[0].run_id]
    assert {one.run_id for one in loggers} == {loggers[0].run_id}


def test_fsspec_url_volume(image_dir, tmp_path):
    """A volume inside a zip archive, through fsspec's chained URLs (pyarrow knows neither)."""
    archive = tmp_path / "shapes.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for file in Volume(image_dir).files[:12]:
            zipped.write(os.path.join(image_dir, file.path), f"shapes/{file.path}")
    volume = Volume(f"zip://shapes::file://{archive}")
    assert [f.path for f in volume.files] == [f.path for f in Volume(image_dir).files[:12]]
    dataset = VolumeImageDataset(volume, global_batch=4, seed=1, streaming=StreamingConfig(str(tmp_path / "cache")))
    ids = [i for b in VolumeDataLoader(dataset, num_workers=0) for i in b.sample_ids.tolist()]
    assert sorted(ids) == list(range(12))
    cached = [(tmp_path / "cache" / entry_name(f.path)).read_bytes() for f in volume.files]
    assert cached == [(Path(image_dir) / f.path).read_bytes() for f in volume.files]


def test_loader_logs_to_mlflow_on_rank_0_by_default(image_dir, tmp_path):
    volume = Volume(image_dir)
    streaming = StreamingConfig(str(tmp_path / "cache"))
    ranks = [VolumeDataLoader(VolumeImageDataset(volume, global_batch=GLOBAL_BATCH, rank=r, world_size=2,
                                                 streaming=streaming), num_workers=1) for r in range(2)]
    from ray_resilient.tracking import BackgroundMetrics, MlflowMetrics

    background = ranks[0].metrics_logger
    assert isinstance(background, BackgroundMetrics) and ranks[1].metrics_logger is None
    ranks[0].log_every = 5
    list(ranks[0])  # 11 batches: logs twice, into the session's MLflow store (MLFLOW_TRACKING_URI)
    assert background.flush(timeout=60)
    assert isinstance(background.logger, MlflowMetrics) and background.delivered == 2
    history = background.logger.client.get_metric_history(background.logger.run_id, "data/fetch_seconds")
    assert [m.step for m in history][-2:] == [5, 10]


def test_a_misspelt_metrics_logger_is_refused_when_the_loader_is_built(image_dir, tmp_path):
    dataset = VolumeImageDataset(Volume(image_dir), global_batch=GLOBAL_BATCH, rank=1, world_size=2,
                                 streaming=StreamingConfig(str(tmp_path / "cache")))
    with pytest.raises(ValueError, match="'mlflow', a callable .* got 'mlfow'"):
        VolumeDataLoader(dataset, num_workers=0, metrics_logger="mlfow")
