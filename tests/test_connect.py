"""Connecting a driver: never to a stopped cluster's leftovers, and a gone cluster fails in seconds."""

from __future__ import annotations

import socket
import time

import pytest

from ray_resilient.connect import RayUnreachableError, _host_port, connect_ray, ray_address


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)),
    ("ray://head:10001", ("head", 10001)),
    ("http://127.0.0.1:8265", ("127.0.0.1", 8265)),
    ("local", None),
    ("auto", None),
    ("head", None),
])
def test_the_probed_host_and_port_of_an_address(address, expected):
    assert _host_port(address) == expected


def test_the_address_is_the_argument_else_ray_address_else_a_new_local_instance(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(None) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_address(None) == "127.0.0.1:6379" and ray_address("ray://h:1") == "ray://h:1"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("given", ["argument", "environment"])
def test_a_cluster_that_is_gone_fails_within_seconds_saying_what_to_do(monkeypatch, given):
    import ray

    address = f"http://127.0.0.1:{closed_port()}"  # what `cluster/local.sh up` exports, after `down`
    if given == "environment":
        monkeypatch.setenv("RAY_ADDRESS", address)
    connected_before = ray.is_initialized()  # the session's own cluster, when an earlier test started it
    started = time.monotonic()
    with pytest.raises(RayUnreachableError) as error:
        connect_ray(address if given == "argument" else None)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert address in message and ("--ray-address" if given == "argument" else "from RAY_ADDRESS") in message
    assert "unset RAY_ADDRESS and leave out --ray-address" in message
    assert ray.is_initialized() == connected_before  # the probe failed before any ray.init
