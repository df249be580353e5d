"""A three-server NATS JetStream cluster of a test's own, on loopback ports, each server with a
store of its own: the tests kill one (SIGKILL), start it again on the same ports and store,
and find which server leads a stream. The shared NATS on 4222 is never touched."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import APIError, ServiceUnavailableError

from broker import natsconn
from broker.natsauth import NatsRole, NatsUsers
from broker.natsserver import ClusterMember, EmbeddedNats
from broker.procs import free_port
from tests.polling import poll_until

CLUSTER_NAME = "kvgate-test"
READY_BOUND_S = 60.0
"""For the cluster to elect its JetStream meta leader after a start (a few seconds alone; a
loaded 2-core machine, three servers and their elections, is given more)."""


class NatsCluster:
    def __init__(
        self,
        root: Path,
        *,
        size: int = 3,
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
                cluster_name=CLUSTER_NAME,
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

    def start(self) -> NatsCluster:
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

    def index(self, server_name: str) -> int:
        return int(server_name.removeprefix("n"))

    def kill(self, i: int) -> None:
        """SIGKILL server ``i``: no lame-duck mode, no flush, its sockets closed by the kernel."""
        node = self.nodes[i]
        assert node.pid is not None, f"n{i} is not running"
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        node.stop()

    def restart(self, i: int) -> None:
        self.nodes[i].start()

    def log_tail(self, i: int, lines: int = 30) -> str:
        log = self.nodes[i].log_file
        assert log is not None
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[NATS]:
        """An admin connection (every server listed; with users, the front door's user, which
        may read stream and consumer state)."""
        nc = await natsconn.connect(self.url_for(NatsRole.FRONT_DOOR), max_reconnect_attempts=-1)
        try:
            yield nc
        finally:
            await nc.close()

    async def wait_ready(self, timeout_s: float = READY_BOUND_S) -> None:
        """Until JetStream answers through the cluster: its meta leader is elected."""
        async with self.client() as nc:
            js = nc.jetstream(timeout=2)

            async def ask() -> bool:
                try:
                    await js.account_info()
                except (APIError, ServiceUnavailableError, nats.errors.TimeoutError):
                    return False
                return True

            await poll_until(ask, bool, timeout_s=timeout_s, interval_s=0.2)

    async def leader(self, stream: str) -> int:
        """The index of the server leading ``stream`` now (waits while it elects one)."""
        async with self.client() as nc:
            js = nc.jetstream(timeout=2)

            async def ask() -> str | None:
                try:
                    info = await js.stream_info(stream)
                except (APIError, ServiceUnavailableError, nats.errors.TimeoutError):
                    return None
                return info.cluster.leader if info.cluster else None

            name = await poll_until(ask, bool, timeout_s=READY_BOUND_S, interval_s=0.1)
            assert name is not None
            return self.index(name)


@contextlib.contextmanager
def nats_cluster(root: Path, **options: object) -> Iterator[NatsCluster]:
    cluster = NatsCluster(root, **options)  # type: ignore[arg-type]
    try:
        yield cluster.start()
    finally:
        cluster.stop()
