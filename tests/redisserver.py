"""A Redis server of a test's own (fault tests restart or stop it; the machine's own Redis on
6379 is never touched). The ``redis_server`` fixture (``tests/conftest.py``) starts one."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from broker.procs import Proc, free_port
from tests.polling import poll_until

REDIS_START_BOUND_S = 20.0
"""For a Redis server to start on a loaded 2-core machine."""


class RedisServer:
    """A Redis server of the test's own, on a free port, with nothing saved to disk."""

    def __init__(self, directory: Path, *args: str) -> None:
        """``args``: more of ``redis-server``'s options (``--maxmemory-policy allkeys-lru``)."""
        self.directory = directory
        self.args = args
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: Proc | None = None

    async def start(self) -> None:
        self._proc = Proc(
            "redis",
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.directory)),
                *self.args,
            ],
            {},
            self.directory,
        )
        client = aioredis.Redis.from_url(self.url)

        async def ping() -> bool:
            try:
                return bool(await client.ping())
            except (OSError, RedisError):
                return False

        try:
            await poll_until(ping, bool, timeout_s=REDIS_START_BOUND_S)
        finally:
            await client.aclose()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
