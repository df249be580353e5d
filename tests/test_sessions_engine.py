"""Session admission end to end on the real vLLM CPU worker (2,048 KV tokens), through a front
door configured as in production (no overcommit, default tier shares)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Stack
from tests.polling import poll_until
from tests.procs import start_api

MODEL = "kvgate-dev"


@pytest.fixture(scope="module")
def admission_api(stack: Stack) -> Iterator[str]:
    proc, base = start_api(stack.nats.url, stack.log_dir)
    try:
        yield base
    finally:
        proc.stop()


def agent_session() -> dict[str, Any]:
    # 10 x (30 + 64) = 940 tokens: one fits the standard tier's 80% of 2,048, two do not (all
    # or nothing: not shaped to fewer calls in flight).
    return {
        "tier": "standard",
        "max_parallel": 10,
        "min_parallel": 10,
        "expected_calls": 10,
        "est_prompt_tokens": 30,
        "est_output_tokens": 64,
        # Answered at once: a held session would be admitted once the window grew.
        "max_wait_s": 0,
    }


async def test_two_sessions_on_a_fleet_with_room_for_one(admission_api: str) -> None:
    async with httpx.AsyncClient(base_url=admission_api, timeout=120) as client:
        # The new front door sees the worker once its KV watch delivers a heartbeat.
        await poll_until(
            lambda: client.get("/readyz"), lambda r: r.status_code == 200, timeout_s=20
        )
        first, second = await asyncio.gather(
            client.post("/v1/sessions", json=agent_session()),
            client.post("/v1/sessions", json=agent_session()),
        )
        answers = sorted([first, second], key=lambda r: r.status_code)
        admitted, deferred = answers
        assert admitted.status_code == 201, admitted.text
        assert deferred.status_code == 503, deferred.text
        body = deferred.json()
        assert body["decision"] == "defer"
        assert body["error"]["code"] in ("tier_capacity", "fleet_saturated")
        assert 1 <= body["retry_after"] == int(deferred.headers["retry-after"]) <= 60

        sid = admitted.json()["id"]
        calls = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"tool call {i}: read file"}],
                        "max_tokens": 64,
                        "ignore_eos": True,
                    },
                    headers={"X-Kvgate-Session": sid},
                )
                for i in range(10)
            )
        )
        assert [c.status_code for c in calls] == [200] * 10, [c.text for c in calls]
        assert all(c.json()["usage"]["completion_tokens"] == 64 for c in calls)

        # The admitted session ends; the deferred one, retried, now fits.
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
        retried = await client.post("/v1/sessions", json=agent_session())
        assert retried.status_code == 201
        await client.delete(f"/v1/sessions/{retried.json()['id']}")
