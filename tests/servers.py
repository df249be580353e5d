"""Redis and PostgreSQL servers of a test's own, on free ports, that the test may stop and start
again (the shared servers on 6379 and 5432 are never touched): the chaos tests take them away
from a front door under load and bring them back."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import redis

from broker.procs import Proc, free_port

START_BOUND_S = 30.0
"""For a server to accept connections after it was started: generous for a loaded 2-core
machine (each starts in well under a second alone)."""

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class RedisServer:
    """``redis-server`` on a port of its own with its data in ``directory``. Stopped with
    SIGTERM, it saves its data set there (its default save points are on), and a ``start``
    on the same port loads it again: a restart as an operator's ``systemctl restart`` does."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: Proc | None = None
        self._runs = 0

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._runs += 1
        self._proc = Proc(
            f"redis-{self.port}-{self._runs}",
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--save",
                "3600 1 300 100 60 10000",
            ],
            {},
            self.directory,
        )
        deadline = time.monotonic() + START_BOUND_S
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    if not self._proc.alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"redis did not start:\n{self._proc.tail()}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not running"
        return self._proc.pid

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None


class PostgresCluster:
    """A PostgreSQL 15 cluster of its own (``initdb``) on a free port, with trust auth for
    ``postgres`` on 127.0.0.1, started and stopped with ``pg_ctl``. PostgreSQL refuses to run
    as root, so as root its tools run as the ``postgres`` user, in a directory of its own."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
        self.data = self.root / "data"
        self.admin_url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def start(self) -> PostgresCluster:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "postgres.log"),
            "-w",
            "-t",
            str(int(START_BOUND_S)),
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )
        return self

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as when the server goes away."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def remove(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        path = self.root / "postgres.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*as_postgres, str(PG_BIN / tool), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=START_BOUND_S * 2,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
