"""A NATS server restart under a running front door and worker (issue 14's chaos table): both
reconnect on their own, the front door sees the worker again, and calls are served after it.

Real processes: ``nats-server`` with a file store, restarted on the same port and store; the
front door as a subprocess; a worker on the simulated engine (the engine is not what is under
test)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from broker.natsserver import EmbeddedNats
from broker.procs import free_port
from tests.calls import chat_body
from tests.polling import poll_until, wait_ready
from tests.procs import start_api
from tests.sampler import sample_fleet
from tests.simworker import sim_worker
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker

MODEL = "kvgate-sim"
MAX_AGE_S = 2.0
"""The front door's heartbeat max age here: past it, only heartbeats put after the restart
count."""
RECOVERY_BOUND_S = 60.0
"""How long the front door may take to see the worker again after the server is back: the
clients' reconnect back-off (2 s at most) and the heartbeat age, with room for a loaded host."""


async def _call(base: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        return await client.post("/v1/chat/completions", json=chat_body(max_tokens=4, model=MODEL))


async def test_after_a_nats_restart_the_front_door_sees_the_worker_again(tmp_path: Path) -> None:
    port = free_port()
    store = tmp_path / "nats"
    server = EmbeddedNats(store, port=port, log_file=tmp_path / "nats.log").start()
    proc, base = start_api(
        server.url,
        tmp_path,
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_HEARTBEAT_MAX_AGE_S=str(MAX_AGE_S),
    )
    engine = SimEngine(SimEngineConfig(step_s=0.002))
    try:
        async with sim_worker(engine, server.url, "sim-restart", ready_at=base):
            before = await _call(base)
            assert before.status_code == 200, before.text

            server.stop()
            server = EmbeddedNats(store, port=port, log_file=tmp_path / "nats-2.log").start()
            # Let every heartbeat from before the restart age out of the front door's view:
            # readiness from here on needs heartbeats put since.
            await asyncio.sleep(MAX_AGE_S * 1.5)

            await wait_ready(base, timeout_s=RECOVERY_BOUND_S)
            after = await poll_until(
                lambda: _call(base),
                lambda r: r.status_code == 200,
                timeout_s=RECOVERY_BOUND_S,
                interval_s=0.5,
            )
            assert after.json()["usage"]["completion_tokens"] == 4
        # Leaving the block drained the worker (its last heartbeat, its removal) without error.
    finally:
        proc.stop()
        server.stop()


READYZ_BOUND_S = 2.0
"""How long /readyz may take to answer while the NATS server is away: at once, with a loaded
machine's slack, well under the 5 s a JetStream request waits before it times out."""


async def test_while_the_nats_server_is_away_readyz_answers_503_at_once(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    proc, base = start_api(server.url, tmp_path, KVGATE_SERVED_MODEL_NAME=MODEL)
    try:
        server.stop()
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await poll_until(
                lambda: client.get("/readyz"),
                lambda r: r.json()["checks"]["nats"] is False,
                timeout_s=RECOVERY_BOUND_S,
            )
            started = time.monotonic()
            resp = await client.get("/readyz")
            took_s = time.monotonic() - started
        assert resp.status_code == 503
        assert resp.json()["checks"]["stream"] is False
        assert took_s < READYZ_BOUND_S, took_s
    finally:
        proc.stop()
        server.stop()


STOP_BOUND_S = 30.0
"""For a worker to stop once asked while NATS is away: its drain has nothing running to wait
for; generous for a loaded machine."""


async def test_a_worker_asked_to_stop_while_nats_is_away_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM during a NATS outage: the worker stops without an error (its connection cannot
    drain while reconnecting, and used to raise out of ``run``)."""
    server = EmbeddedNats(tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    settings = WorkerSettings(
        nats_url=server.url, worker_id="w-stop", heartbeat_interval_s=0.3, pull_expires_s=2
    )
    worker = Worker(SimEngine(SimEngineConfig(step_s=0.002)), settings)
    task = asyncio.create_task(worker.run())
    try:
        async with sample_fleet(server.url):
            pass  # the worker serves: its heartbeat was seen
        server.stop()
        # Until its connection has learnt that the server is gone.
        await poll_until(
            lambda: asyncio.sleep(0, worker.nc.is_connected),
            lambda connected: not connected,
            timeout_s=STOP_BOUND_S,
        )
        worker.request_stop()
        await asyncio.wait_for(task, STOP_BOUND_S)
    finally:
        task.cancel()
        server.stop()
