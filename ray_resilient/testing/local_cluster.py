"""A multi-node Ray cluster on one machine: a head and worker nodes, each its own ``ray start`` processes.

Every node runs ``ray start --block`` in a process group of its own, so a node can be lost for
real (:meth:`LocalNode.kill` SIGKILLs every process of it, the raylet included) and the cluster
is stopped without touching other Ray processes on the machine (``ray stop`` would stop them all).
Nodes join one at a time: raylets starting together can race for the same port.

The head runs with fast node-failure detection (:data:`FAST_NODE_FAILURE_DETECTION`): the GCS
declares a node dead after about 3 s without a heartbeat instead of about 15 s, which is how long
the resources of a lost node otherwise still look available to a restarting job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ray_resilient._ray_internals import FAST_NODE_FAILURE_DETECTION, NO_API_SERVER, alive_node_ids
from ray_resilient.testing.ports import LOOPBACK, free_port, port_open
from ray_resilient.testing.waiting import wait_until

_POLL_SECONDS = 0.2


def gcs_alive_node_ids(gcs_address: str) -> list[str]:
    """The ids of the nodes the GCS at ``host:port`` counts alive; empty while it does not listen yet
    (a GCS client would wait half a minute for it)."""
    host, port = gcs_address.rsplit(":", 1)
    if not port_open(host, int(port)):
        return []
    return alive_node_ids(gcs_address)


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class LocalNode:
    """One node's ``ray start --block`` process (the leader of the node's process group)."""

    process: subprocess.Popen
    cpus: int
    node_id: str = ""

    def kill(self) -> None:
        """SIGKILL every process of the node, as a lost machine would: nothing shuts down cleanly."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop(self, timeout: float = 5) -> None:
        """Stop the node (SIGTERM to its group; SIGKILL after ``timeout``)."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class LocalRayCluster:
    """A head node (``head_cpus`` CPUs, no dashboard) on loopback plus the nodes :meth:`add_node` adds.

    Token authentication is off (loopback only). Use as a context manager, or call
    :meth:`start` and :meth:`stop`. Keep ``temp_dir`` short: Ray's socket paths under it must
    fit in 107 characters. ``env`` is the environment of every node and of drivers that connect
    (:attr:`address`); without a dashboard it points Ray's state API nowhere
    (:data:`ray_resilient._ray_internals.NO_API_SERVER`).
    """

    temp_dir: Path
    head_cpus: int = 0
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    nodes: list[LocalNode] = field(default_factory=list)
    address: str = ""

    def __post_init__(self) -> None:
        self.env = {**self.env, **FAST_NODE_FAILURE_DETECTION, **NO_API_SERVER, "RAY_AUTH_MODE": "disabled"}
        self.env.pop("RAY_ADDRESS", None)

    def __enter__(self) -> "LocalRayCluster":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        """Start the head node and wait until the GCS counts it alive."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.address = f"{LOOPBACK}:{port}"
        self._start_node(timeout, "--head", f"--port={port}", f"--num-cpus={self.head_cpus}",
                         "--include-dashboard=false", f"--temp-dir={self.temp_dir}", "--disable-usage-stats")

    def add_node(self, cpus: int, timeout: float = 60) -> LocalNode:
        """Start a worker node with ``cpus`` CPUs and wait until the cluster counts it alive."""
        return self._start_node(timeout, f"--address={self.address}", f"--num-cpus={cpus}", cpus=cpus)

    def _start_node(self, timeout: float, *args: str, cpus: int | None = None) -> LocalNode:
        known = {n.node_id for n in self.nodes}
        log = self.temp_dir / f"node-{len(self.nodes)}.log"
        with open(log, "w") as out:
            process = subprocess.Popen([_ray_cli(), "start", "--block", f"--node-ip-address={LOOPBACK}", *args],
                                       env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = LocalNode(process, self.head_cpus if cpus is None else cpus)
        self.nodes.append(node)

        def joined() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"`ray start {' '.join(args)}` exited; see {log}")
            node.node_id = next((i for i in gcs_alive_node_ids(self.address) if i not in known), "")
            return bool(node.node_id)

        wait_until(joined, timeout, f"the node of `ray start {' '.join(args)}` to join (log: {log})",
                   poll_s=_POLL_SECONDS)
        return node

    def alive_nodes(self) -> list[LocalNode]:
        """The nodes the GCS counts alive (a killed node stays until its health checks fail)."""
        alive = set(gcs_alive_node_ids(self.address)) if self.address else set()
        return [n for n in self.nodes if n.node_id in alive]

    def ray(self, *args: str) -> subprocess.CompletedProcess:
        """Run the ``ray`` CLI against this cluster's environment (e.g. ``drain-node``); raises on failure."""
        return subprocess.run([_ray_cli(), *args], env=self.env, capture_output=True, text=True, timeout=120,
                              check=True)

    def stop(self) -> None:
        """Stop the worker nodes, then the head."""
        for node in reversed(self.nodes):
            node.stop()
        self.nodes.clear()
