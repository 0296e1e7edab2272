"""Connect a driver to Ray: the cluster an address names, else a new local instance.

``ray.init()`` with no address follows the address file ``ray start`` leaves in Ray's temp
directory (``ray_current_cluster``), even after that cluster stopped, and then retries the dead
head for minutes. :func:`connect_ray` never reads that file, and probes an address that names a
host and port first, so that a cluster that is gone fails within seconds, saying what to do.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

import ray

PROBE_TIMEOUT_S = 5.0


class RayUnreachableError(ConnectionError):
    """No Ray cluster answers at the address the driver was given."""


def ray_address(address: str | None) -> str:
    """``address``, else ``RAY_ADDRESS``, else ``"local"`` (a new local instance)."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def _host_port(address: str) -> tuple[str, int] | None:
    """The host and port an address names (``host:port``, ``ray://``, ``http://``); None for
    ``"local"``, ``"auto"`` and addresses without a port."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


def connect_ray(address: str | None = None, *, timeout_s: float = PROBE_TIMEOUT_S, **init_kwargs: Any) -> None:
    """``ray.init`` on :func:`ray_address` of ``address``; :class:`RayUnreachableError` within
    ``timeout_s`` when that names a host and port nothing listens on."""
    resolved = ray_address(address)
    target = _host_port(resolved)
    if target is not None:
        source = "--ray-address" if address else "RAY_ADDRESS"
        try:
            socket.create_connection(target, timeout=timeout_s).close()
        except OSError as error:
            raise RayUnreachableError(
                f"no Ray cluster answers at {resolved} (from {source}: {error}). Start that cluster "
                f"(for the local one: cluster/local.sh up) or give its address; to run on a new local Ray "
                f"instance instead, unset RAY_ADDRESS and leave out --ray-address"
            ) from None
    ray.init(address=resolved, **init_kwargs)
