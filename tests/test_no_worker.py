"""The front door with no worker running: calls are deferred at once (``no_workers``); with a
worker that heartbeats but never pulls, calls end with a timeout error at their deadline."""

from __future__ import annotations

import time

import httpx
import pytest

from broker.natsserver import EmbeddedNats
from loadtests.heartbeats import stuck_worker_heartbeat
from tests.polling import wait_ready

AT_ONCE_BOUND_S = 1.0
"""A deferral waits on nothing: well under a second even on a loaded 2-core machine."""
CALL_TIMEOUT_S = 1.5
"""The call's own deadline (``X-Kvgate-Timeout``)."""
DEADLINE_LATE_BOUND_S = 5.0
"""When the timeout answer must have come, on a loaded machine: at the call's deadline, not when
the client gives up (30 s)."""


BODY = {"model": "kvgate-dev", "messages": [{"role": "user", "content": "anyone?"}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_with_no_worker_a_call_is_deferred_at_once(lonely_api: str, stream: bool) -> None:
    async with httpx.AsyncClient(base_url=lonely_api, timeout=30) as client:
        started = time.monotonic()
        resp = await client.post("/v1/chat/completions", json={**BODY, "stream": stream})
        elapsed = time.monotonic() - started
    assert resp.status_code == 503
    body = resp.json()
    assert (body["error"]["code"], body["decision"]) == ("no_workers", "defer")
    assert 1 <= body["retry_after"] == int(resp.headers["retry-after"]) <= 60
    assert elapsed < AT_ONCE_BOUND_S, elapsed


@pytest.mark.parametrize("stream", [False, True])
async def test_call_times_out_at_its_deadline(
    lonely_api: str, nats_server: EmbeddedNats, stream: bool
) -> None:
    await stuck_worker_heartbeat(nats_server.url)
    await wait_ready(lonely_api)  # the front door's KV watch saw it
    async with httpx.AsyncClient(base_url=lonely_api, timeout=30) as client:
        started = time.monotonic()
        resp = await client.post(
            "/v1/chat/completions",
            json={**BODY, "stream": stream},
            headers={"X-Kvgate-Timeout": str(CALL_TIMEOUT_S)},
        )
        elapsed = time.monotonic() - started
    assert resp.status_code == 504
    body = resp.json()
    assert body["error"]["code"] == "deadline_exceeded"
    assert body["retry_after"] == int(resp.headers["retry-after"])
    # Not before its deadline (less 0.1 s of slack between the two processes' timers).
    assert CALL_TIMEOUT_S - 0.1 <= elapsed < DEADLINE_LATE_BOUND_S, elapsed


async def test_readyz_is_503_without_workers(lonely_api: str) -> None:
    async with httpx.AsyncClient(base_url=lonely_api) as client:
        resp = await client.get("/readyz")
        live = await client.get("/healthz")
    assert resp.status_code == 503
    assert resp.json()["checks"]["workers"] == 0
    assert resp.json()["checks"]["nats"] is True
    assert live.status_code == 200


@pytest.mark.parametrize("value", ["0", "-1", "abc", "99999999"])
async def test_bad_timeout_header_is_a_400(lonely_api: str, value: str) -> None:
    async with httpx.AsyncClient(base_url=lonely_api) as client:
        resp = await client.post(
            "/v1/chat/completions", json=BODY, headers={"X-Kvgate-Timeout": value}
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "X-Kvgate-Timeout"


async def test_unknown_tier_is_a_400(lonely_api: str) -> None:
    async with httpx.AsyncClient(base_url=lonely_api) as client:
        resp = await client.post(
            "/v1/chat/completions", json=BODY, headers={"X-Kvgate-Tier": "gold"}
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_tier"
