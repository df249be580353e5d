"""Queue lag (API and CLI) and Prometheus metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from broker.natsserver import EmbeddedNats
from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls
from kvgate.cli import COMMAND
from tests.calls import MODEL, make_call
from tests.conftest import Stack
from tests.polling import poll_until
from tests.procs import start_api
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker

TOKEN = "test-admin-token"

SETTLE_BOUND_S = 15.0
"""For what moves within a couple of seconds (a worker draining three calls, a lag refresh every
2 s, the ledger's writer): generous for a loaded 2-core machine."""


@pytest.fixture
def admin_api(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[str]:
    proc, base = start_api(nats_server.url, tmp_path, KVGATE_ADMIN_TOKEN=TOKEN)
    try:
        yield base
    finally:
        proc.stop()


def kvgate_lag(url: str, *args: str) -> str:
    return subprocess.run(
        [*COMMAND, "lag", "--nats-url", url, *args], check=True, capture_output=True, text=True
    ).stdout


def kvgate_top(base_url: str) -> dict[str, list[str] | str]:
    """``kvgate top --once``: its rows by their first cell, and the whole text."""
    text = subprocess.run(
        [*COMMAND, "top", "--once", "--url", base_url],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN, "COLUMNS": "150"},
    ).stdout
    rows: dict[str, list[str] | str] = {"text": text}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").replace("┃", "│").split("│")]
        if len(cells) > 1:
            rows[cells[0]] = cells
    return rows


def standard(rows: list[dict[str, object]]) -> dict[str, object]:
    (row,) = [r for r in rows if r["tier"] == "standard"]
    return row


async def test_lag_reports_pending_calls_then_drains(
    admin_api: str, nats_server: EmbeddedNats, nc: NATS
) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    publisher = CallPublisher(js)
    for i in range(3):
        call = make_call(f"lag{i}")
        await publisher.publish(call, f"_INBOX.lag.{i}", now_ms=call.created_ms)

    async with httpx.AsyncClient(base_url=admin_api) as client:
        assert (await client.get("/v1/admin/lag")).status_code == 401
        wrong = await client.get("/v1/admin/lag", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "unauthorized"
        auth = {"Authorization": f"Bearer {TOKEN}"}

        async def lag() -> dict[str, object]:
            return standard((await client.get("/v1/admin/lag", headers=auth)).json()["tiers"])

        first = await lag()
        assert first["pending"] == 3
        # The oldest pending call ages (a TimeoutError here: it did not).
        second = await poll_until(
            lag,
            lambda row: row["oldest_pending_age_s"] > first["oldest_pending_age_s"],  # type: ignore[operator]
            timeout_s=SETTLE_BOUND_S,
        )
        assert second["pending"] == 3

        cli = await asyncio.to_thread(kvgate_lag, nats_server.url, "--json")
        assert standard(json.loads(cli))["pending"] == 3
        table = await asyncio.to_thread(kvgate_lag, nats_server.url)
        assert table.splitlines()[0].split()[:2] == ["TIER", "PENDING"]
        frame = await asyncio.to_thread(kvgate_top, admin_api)
        assert frame["standard"][:4] == ["standard", "3", "0", "0"], frame
        assert "workers (0 live)" in frame["text"]

        worker = Worker(
            SimEngine(SimEngineConfig(served_model_name=MODEL, step_s=0.001)),
            WorkerSettings(nats_url=nats_server.url, worker_id="sim-lag", pull_expires_s=2),
        )
        task = asyncio.create_task(worker.run())
        try:
            row = await poll_until(
                lag,
                lambda row: row["pending"] == 0 and row["ack_pending"] == 0,
                timeout_s=SETTLE_BOUND_S,
                interval_s=0.2,
            )
            assert row["oldest_pending_age_s"] is None
            live = (await client.get("/v1/admin/workers", headers=auth)).json()["workers"]
            assert [w["worker_id"] for w in live] == ["sim-lag"]
            frame = await asyncio.to_thread(kvgate_top, admin_api)
            assert frame["standard"][:3] == ["standard", "0", "0"], frame
            assert frame["sim-lag"][-2] == "serving", frame
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, SETTLE_BOUND_S)


async def test_admin_tokens_that_are_not_ascii_are_a_401(admin_api: str) -> None:
    # Header values arrive as Latin-1 text: compared as text, one past ASCII raised (a 500).
    async with httpx.AsyncClient(base_url=admin_api) as client:
        for given in ("Bearer clé-ü".encode(), f"Bearer {TOKEN}é".encode("latin-1")):
            for path in ("/v1/admin/lag", "/v1/admin/workers"):
                resp = await client.get(path, headers={b"Authorization": given})
                assert resp.status_code == 401, (path, resp.text)
                assert resp.json()["error"]["code"] == "unauthorized"
        ok = await client.get("/v1/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_parse_and_move_when_calls_are_made(stack: Stack) -> None:
    def value(
        s: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
    ) -> float:
        return s.get((name, tuple(sorted(labels.items()))), 0.0)

    done = {"worker": "w1", "outcome": "completed"}

    async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return samples((await client.get("/metrics")).text)

    def settled(s: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> bool:
        """The calls' ends counted, a lag reading taken, the two decisions written to the ledger
        (its queue empty is not enough: a batch being written is in neither count)."""
        ok = {"tier": "standard", "outcome": "ok"}
        written = "kvgate_ledger_written_total"
        return (
            value(s, "kvgate_calls_total", **ok) >= value(before, "kvgate_calls_total", **ok) + 2
            and ("kvgate_queue_pending", (("tier", "guaranteed"),)) in s
            and value(s, written) >= value(before, written) + 2
            and value(s, "kvgate_worker_calls_total", **done)
            >= value(before, "kvgate_worker_calls_total", **done) + 2
        )

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        before = await scrape()
        for stream in (False, True):
            resp = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "kvgate-dev",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "ignore_eos": True,
                    "stream": stream,
                },
            )
            assert resp.status_code == 200
        after = await poll_until(scrape, settled, timeout_s=SETTLE_BOUND_S)

    ok = {"tier": "standard", "outcome": "ok"}
    assert value(after, "kvgate_calls_total", **ok) == value(before, "kvgate_calls_total", **ok) + 2
    tokens = "kvgate_tokens_streamed_total"
    assert value(after, tokens, tier="standard") == value(before, tokens, tier="standard") + 10
    ttft = "kvgate_ttft_seconds_count"
    assert value(after, ttft, tier="standard") == value(before, ttft, tier="standard") + 2
    wait = "kvgate_queue_wait_seconds_count"
    assert value(after, wait, tier="standard") == value(before, wait, tier="standard") + 2
    admitted = {"tier": "standard", "decision": "admit", "reason": "admitted"}
    decisions = "kvgate_admission_decisions_total"
    assert value(after, decisions, **admitted) == value(before, decisions, **admitted) + 2
    latency = "kvgate_admission_latency_seconds_count"
    assert value(after, latency, scope="call") == value(before, latency, scope="call") + 2
    assert value(after, "kvgate_ledger_queued") == 0
    assert value(after, "kvgate_ledger_dropped_total") == 0
    assert value(after, "kvgate_workers_live") == 1
    assert ("kvgate_worker_running", (("worker", "w1"),)) in after
    assert value(after, "kvgate_worker_max_sequences", worker="w1") >= 1
    assert value(after, "kvgate_worker_draining", worker="w1") == 0
    assert ("kvgate_worker_staged", (("worker", "w1"),)) in after
    assert ("kvgate_worker_preemptions_total", (("worker", "w1"),)) in after
    # The worker's heartbeats count its calls' ends and output: both moved by the two calls.
    worker_calls = "kvgate_worker_calls_total"
    assert value(after, worker_calls, **done) >= value(before, worker_calls, **done) + 2
    generated = "kvgate_worker_generated_tokens_total"
    assert value(after, generated, worker="w1") >= value(before, generated, worker="w1") + 10
    assert ("kvgate_worker_rescued_total", (("worker", "w1"),)) in after
    assert (worker_calls, (("outcome", "faulted"), ("worker", "w1"))) in after
    assert 0 <= value(after, "kvgate_worker_heartbeat_age_seconds", worker="w1") < SETTLE_BOUND_S
    assert ("kvgate_queue_pending", (("tier", "guaranteed"),)) in after
    assert ("kvgate_queue_redelivered", (("tier", "guaranteed"),)) in after
    objective = "kvgate_tier_objective_seconds"
    assert value(after, objective, tier="standard", objective="ttft") > 0
    assert value(after, objective, tier="guaranteed", objective="tpot") > 0


def test_the_front_door_logs_its_nats_url_without_credentials(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # A server with no accounts takes any credentials: the URL below connects.
    with_secret = nats_server.url.replace("nats://", "nats://kvuser:s3cret-pw@")
    proc, _ = start_api(with_secret, tmp_path)
    proc.stop()
    assert proc.log_path is not None
    log = proc.log_path.read_text()
    host = nats_server.url.removeprefix("nats://")
    assert f"connected to nats://***@{host}" in log
    assert "s3cret-pw" not in log and "kvuser" not in log
