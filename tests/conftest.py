from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from broker.natsserver import EmbeddedNats
from broker.procs import Proc, wait_http
from kvgate.cli import COMMAND
from tests.otlp import OtlpHttpReceiver, SpanStore
from tests.procs import start_api, start_worker
from tests.servers import RedisServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A fresh NATS server on a random port with its own store, per test."""
    with EmbeddedNats(tmp_path / "nats", log_file=tmp_path / "nats.log") as server:
        yield server


@pytest.fixture
def lonely_api(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[str]:
    """A front door on the test's own NATS with no worker: its base URL."""
    proc, base = start_api(nats_server.url, tmp_path)
    try:
        yield base
    finally:
        proc.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own on a free port, which the test may stop and start again
    (never the shared one on 6379)."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(scope="session")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The development model, built once per test session through the CLI."""
    directory = tmp_path_factory.mktemp("model") / "kvgate-dev"
    subprocess.run([*COMMAND, "model", "build", str(directory)], check=True, capture_output=True)
    return directory


# The pull-policy tests overload the worker on purpose (40 calls for 3 KV caches' worth) and
# name the guaranteed tier without a key: admission here admits 16 caches' worth of one-call
# sessions, so that what they test is the worker's pull gate. Admission itself is tested with
# front doors configured as in production (tests/test_sessions*.py).
PULL_TEST_ADMISSION = {
    "KVGATE_DEV_TENANT_TIER": "guaranteed",
    "KVGATE_ADMISSION_KV_OVERCOMMIT": "16",
    # The batch tests run front doors of their own (with databases of their own) on this
    # stack's NATS; this one must not collect their results into its database.
    "KVGATE_BATCH_RUNNER": "false",
}


@dataclass
class Stack:
    nats: EmbeddedNats
    worker: Proc
    api: Proc
    base_url: str
    log_dir: Path
    traces: SpanStore
    """Every span the stack's front door and worker exported over OTLP/HTTP."""


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, dev_model: Path) -> Iterator[Stack]:
    """NATS, one real vLLM CPU worker and the front door, shared by the end-to-end tests (the
    engine takes ~30 s to start, so it starts once per session). Both export their spans to
    an OTLP receiver in this process."""
    root = tmp_path_factory.mktemp("stack")
    receiver = OtlpHttpReceiver().start()
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    server = EmbeddedNats(root / "nats", log_file=root / "nats.log").start()
    worker = start_worker(server.url, dev_model, root, "w1", **otel)
    api, base = start_api(server.url, root, **PULL_TEST_ADMISSION, **otel)
    try:
        wait_http(base + "/readyz", worker, timeout=240)
        yield Stack(server, worker, api, base, root, receiver.store)
    finally:
        api.stop()
        worker.stop()
        server.stop()
        receiver.stop()
