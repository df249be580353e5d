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
from broker.natsauth import NatsRole
from broker.natsserver import LocalCluster
from tests.polling import poll_until

CLUSTER_NAME = "kvgate-test"
READY_BOUND_S = 60.0
"""For the cluster to elect its JetStream meta leader after a start (a few seconds alone; a
loaded 2-core machine, three servers and their elections, is given more)."""


class NatsCluster(LocalCluster):
    """``LocalCluster`` with what the tests do to it: kill a server, start it again, find
    who leads a stream."""

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
    cluster = NatsCluster(root, name=CLUSTER_NAME, **options)  # type: ignore[arg-type]
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
