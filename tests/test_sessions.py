"""The sessions API and session admission through a real front door (subprocess), real NATS and
an in-process worker on the simulated engine, with a tenants file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from broker.natsserver import EmbeddedNats
from kvgate.client import GaveUp, SessionNotOpened, kvgate_session
from loadtests.heartbeats import stuck_worker_heartbeat
from tests.calls import chat_body
from tests.polling import poll_until, wait_ready
from tests.procs import start_api
from tests.simworker import sim_worker
from tests.tenants import tenant, write_tenants_file
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
ACME, SMALL, CHEAP, STRICT, TIGHT = "acme-key", "small-key", "cheap-key", "strict-key", "tight"
KV_TOKENS = 4096

SETTLE_BOUND_S = 10.0
"""For what the front door does off the request path within a second (ledger rows written, the
pace refreshed twice a second); generous for a loaded 2-core machine."""
WINDOW_GROWTH_BOUND_S = 40.0
"""For the admission window to grow until a turned-away session fits (it learns in steps)."""
WINDOW_CUT_BOUND_S = 20.0
"""For twenty missed objectives to cut the window (judged as the calls end)."""
SAMPLE_INTERVAL_S = 0.002
"""How often a test samples the engine's running calls: far below a call's length (60 tokens
at 4 ms a step), so that a peak is not missed."""


@dataclass
class Door:
    base: str
    engine: SimEngine
    ledger: Path

    def client(self, key: str | None = ACME) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.base, headers=headers, timeout=30)


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    return write_tenants_file(
        tmp_path,
        tenant("acme", ACME, max_tier="guaranteed"),
        tenant("small", SMALL, max_tier="standard", max_sessions=1),
        tenant("cheap", CHEAP, max_tier="besteffort"),
        # Asks for a first token within 10 microseconds: every one of its calls misses.
        tenant("strict", STRICT, objectives={"standard": {"ttft_ms": 0.01}}),
        tenant("tight", TIGHT, tokens_per_minute=TIGHT_TOKENS_PER_MINUTE),
        tiers={
            "standard": {"share": 0.8, "ttft_ms": 2000, "tpot_ms": 100, "default_deadline_s": 60}
        },
    )


@contextlib.asynccontextmanager
async def open_door(
    nats_url: str, tmp_path: Path, tenants_file: Path, **env: str
) -> AsyncIterator[Door]:
    """A front door (subprocess) and a simulated worker; ``env`` adds settings."""
    ledger = tmp_path / "decisions.db"
    proc, base = start_api(
        nats_url,
        tmp_path,
        KVGATE_TENANTS_FILE=str(tenants_file),
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_DATABASE_URL=f"sqlite:///{ledger}",
        **env,
    )
    engine = SimEngine(SimEngineConfig(step_s=0.004, kv_capacity_tokens=KV_TOKENS))
    try:
        async with sim_worker(engine, nats_url, "sim-1", ready_at=base):
            yield Door(base, engine, ledger)
    finally:
        proc.stop()


@pytest.fixture
async def door(
    nats_server: EmbeddedNats, tmp_path: Path, tenants_file: Path
) -> AsyncIterator[Door]:
    async with open_door(nats_server.url, tmp_path, tenants_file) as door:
        yield door


@pytest.fixture
async def fixed_door(
    nats_server: EmbeddedNats, tmp_path: Path, tenants_file: Path
) -> AsyncIterator[Door]:
    """A front door whose admission windows are fixed at 1 (no learning), so that only a
    release makes room."""
    env = {"KVGATE_ADMISSION_KV_OVERCOMMIT_MAX": "1", "KVGATE_ADMISSION_MAX_WAIT_S": "10"}
    async with open_door(nats_server.url, tmp_path, tenants_file, **env) as door:
        yield door


def chat(max_tokens: int = 20) -> dict[str, Any]:
    return chat_body("plan the refactor", max_tokens, model=MODEL)


TIGHT_TOKENS_PER_MINUTE = 400
"""Room for a session declared at 100 tokens and a few hundred tokens of calls past it."""


def session_body(**extra: Any) -> dict[str, Any]:
    return {
        "tier": "standard",
        "max_parallel": 2,
        "expected_calls": 6,
        "est_prompt_tokens": 100,
        "est_output_tokens": 50,
        **extra,
    }


async def test_a_missing_or_unknown_key_is_a_401(door: Door) -> None:
    for key in (None, "wrong"):
        async with door.client(key) as client:
            for resp in (
                await client.post("/v1/sessions", json=session_body()),
                await client.post("/v1/chat/completions", json=chat()),
            ):
                assert resp.status_code == 401
                assert resp.json()["error"]["code"] == "unauthorized"
                assert resp.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("key", "body", "status", "code", "param"),
    [
        (ACME, session_body(max_parallel=-1), 400, "invalid_parameter", "max_parallel"),
        (ACME, session_body(max_parallel=0), 400, "invalid_parameter", "max_parallel"),
        (ACME, session_body(tier="gold"), 400, "invalid_tier", "tier"),
        (ACME, {"max_parallel": 2}, 400, "invalid_tier", "tier"),
        (ACME, session_body(deadline_s=-5), 400, "invalid_parameter", "deadline_s"),
        (ACME, session_body(surprise=1), 400, "invalid_parameter", "surprise"),
        (ACME, session_body(max_parallel=100_000), 400, "invalid_parameter", "max_parallel"),
        (ACME, session_body(idle_timeout_s=1e308), 400, "invalid_parameter", "idle_timeout_s"),
        (ACME, session_body(metadata={"note": "x" * 513}), 400, "invalid_parameter", "metadata"),
        (ACME, session_body(metadata={"k" * 65: 1}), 400, "invalid_parameter", "metadata"),
        (
            ACME,
            session_body(metadata={str(i): i for i in range(33)}),
            400,
            "invalid_parameter",
            "metadata",
        ),
        (SMALL, session_body(tier="guaranteed"), 403, "tier_not_allowed", "tier"),
        (CHEAP, session_body(tier="standard"), 403, "tier_not_allowed", "tier"),
    ],
)
async def test_bad_session_requests_get_4xx_codes(
    door: Door, key: str, body: dict[str, Any], status: int, code: str, param: str
) -> None:
    async with door.client(key) as client:
        resp = await client.post("/v1/sessions", json=body)
    assert resp.status_code == status, resp.text
    assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, param)


async def test_invalid_json_is_a_400(door: Door) -> None:
    async with door.client() as client:
        resp = await client.post("/v1/sessions", content=b"{nope")
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_json")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_numbers_json_does_not_have_are_invalid_json(door: Door, value: str) -> None:
    # Python's json reads all four (the last as infinity); a body carries them unchanged to
    # the engine, so the front door refuses them as RFC 8259 does.
    def with_value(body: dict[str, Any]) -> bytes:
        return json.dumps(body).replace('"VALUE"', value).encode()

    async with door.client() as client:
        resp = await client.post(
            "/v1/sessions", content=with_value(session_body(metadata={"x": "VALUE"}))
        )
        call = await client.post(
            "/v1/chat/completions", content=with_value({**chat(4), "temperature": "VALUE"})
        )
    for answer in (resp, call):
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_json")
        assert value.lstrip("-") in answer.json()["error"]["message"]


OUT_OF_RANGE = [
    # (field, the integer as JSON text, the code): 5,000 digits is past the digits Python
    # converts at all; 2**70 is past the 64 bits vLLM reads a seed (or any integer) in.
    ("max_tokens", "9" * 5000, "invalid_max_tokens"),
    ("max_completion_tokens", "-" + "9" * 5000, "invalid_max_tokens"),
    ("seed", str(2**70), "invalid_parameter"),
    ("n", "9" * 4000, "invalid_parameter"),
    ("logit_bias", '{"42": ' + "9" * 5000 + "}", "invalid_parameter"),
]


async def test_integers_past_64_bits_are_a_400_naming_the_field(door: Door) -> None:
    async with door.client() as client:
        for field, number, code in OUT_OF_RANGE:
            body = json.dumps({**chat(4), field: "VALUE"}).replace('"VALUE"', number)
            resp = await client.post("/v1/chat/completions", content=body.encode())
            assert resp.status_code == 400, (field, resp.text[:300])
            error = resp.json()["error"]
            assert (error["code"], error["param"]) == (code, field)
            assert field in error["message"] and len(error["message"]) < 300
        deep = b'{"model": "kvgate-sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = await client.post("/v1/chat/completions", content=deep)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_json")
        ok = await client.post("/v1/chat/completions", json={**chat(4), "seed": 2**63 - 1})
        assert ok.status_code == 200, ok.text


async def test_a_key_that_is_not_ascii_is_a_401(door: Door) -> None:
    async with door.client(key=None) as client:
        resp = await client.post(
            "/v1/sessions",
            json=session_body(),
            headers={b"Authorization": "Bearer clé-ü".encode()},
        )
    assert (resp.status_code, resp.json()["error"]["code"]) == (401, "unauthorized")


async def test_session_lifecycle_create_get_call_close(door: Door) -> None:
    async with door.client() as client:
        created = await client.post("/v1/sessions", json=session_body(metadata={"agent": "a1"}))
        assert created.status_code == 201, created.text
        session = created.json()
        sid = session["id"]
        assert session["tier"] == "standard" and session["state"] == "active"
        assert session["lease"]["reserved_tokens"] == 2 * 150
        assert session["admission"] == {
            "decision": "admit",
            "reason": "admitted",
            "requested_parallel": 2,
        }
        assert session["metadata"] == {"agent": "a1"}
        assert session["lease"]["expires_at"] <= session["lease"]["deadline_at"]

        call = await client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Session": sid}
        )
        assert call.status_code == 200, call.text
        assert call.headers["x-kvgate-session"] == sid
        assert call.json()["usage"]["completion_tokens"] == 20

        got = (await client.get(f"/v1/sessions/{sid}")).json()
        assert got["calls_started"] == 1 and got["admission"] is None

        # Another tenant cannot see it, or call in it.
        async with door.client(SMALL) as other:
            assert (await other.get(f"/v1/sessions/{sid}")).status_code == 404
            foreign = await other.post(
                "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Session": sid}
            )
            assert foreign.json()["error"]["code"] == "session_not_found"

        closed = await client.delete(f"/v1/sessions/{sid}")
        assert closed.status_code == 200 and closed.json()["state"] == "closed"
        late = await client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Session": sid}
        )
        assert (late.status_code, late.json()["error"]["code"]) == (409, "session_closed")
        unknown = await client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Session": "sess_nope"}
        )
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (
            404,
            "session_not_found",
        )
        mismatch = await client.post("/v1/sessions", json=session_body())
        wrong_tier = await client.post(
            "/v1/chat/completions",
            json=chat(),
            headers={"X-Kvgate-Session": mismatch.json()["id"], "X-Kvgate-Tier": "guaranteed"},
        )
        assert (wrong_tier.status_code, wrong_tier.json()["error"]["code"]) == (
            400,
            "invalid_tier",
        )


async def test_an_idempotency_key_makes_a_retried_create_return_the_same_session(
    door: Door,
) -> None:
    async with door.client() as client:
        headers = {"Idempotency-Key": "agent-7-run-1"}
        first = await client.post("/v1/sessions", json=session_body(), headers=headers)
        again = await client.post("/v1/sessions", json=session_body(), headers=headers)
        fresh = await client.post("/v1/sessions", json=session_body())
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] != fresh.json()["id"]


async def test_calls_beyond_max_parallel_wait_for_their_own_session(door: Door) -> None:
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(door.engine._running))
            await asyncio.sleep(SAMPLE_INTERVAL_S)  # sampling: a peak is no event to await

    async with door.client() as client:
        sid = (await client.post("/v1/sessions", json=session_body(max_parallel=2))).json()["id"]
        watcher = asyncio.create_task(watch())
        try:
            calls = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json=chat(60),
                        headers={"X-Kvgate-Session": sid},
                    )
                    for _ in range(6)
                )
            )
        finally:
            watcher.cancel()
        record = (await client.get(f"/v1/sessions/{sid}")).json()
    assert [c.status_code for c in calls] == [200] * 6
    assert peak == 2, peak
    assert record["calls_started"] == 6


LONG_CALL_TOKENS = 600
"""2.4 s of decoding at 4 ms a step: long enough for every call of a burst to arrive while the
first still runs, on a loaded machine."""


async def test_calls_beyond_the_waiting_bound_get_429_at_once(
    nats_server: EmbeddedNats, tmp_path: Path, tenants_file: Path
) -> None:
    env = {"KVGATE_SESSION_MAX_WAITING_CALLS": "1"}
    async with (
        open_door(nats_server.url, tmp_path, tenants_file, **env) as door,
        door.client() as client,
    ):
        sid = (await client.post("/v1/sessions", json=session_body(max_parallel=1))).json()["id"]
        calls = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    json=chat(LONG_CALL_TOKENS),
                    headers={"X-Kvgate-Session": sid},
                )
                for _ in range(4)
            )
        )
    # One runs, one waits for its slot, and the other two are refused without waiting.
    assert sorted(c.status_code for c in calls) == [200, 200, 429, 429]
    for refused in (c for c in calls if c.status_code == 429):
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("too_many_waiting_calls", "rate_limit_error")
        assert refused.json()["retry_after"] == int(refused.headers["retry-after"]) == 1


IDLE_TIMEOUT_S = 0.5
IDLE_OUT_S = 1.2
"""Left idle this long, past its idle timeout: the idling out is the behaviour under test."""


async def test_an_idle_session_expires_and_its_calls_get_410(door: Door) -> None:
    async with door.client() as client:
        body = session_body(idle_timeout_s=IDLE_TIMEOUT_S)
        sid = (await client.post("/v1/sessions", json=body)).json()["id"]
        await asyncio.sleep(IDLE_OUT_S)
        got = (await client.get(f"/v1/sessions/{sid}")).json()
        call = await client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Session": sid}
        )
    assert got["state"] == "expired" and got["ended_at"] is not None
    assert (call.status_code, call.json()["error"]["code"]) == (410, "session_expired")


async def test_a_tenant_over_its_quota_gets_429_with_retry_after(door: Door) -> None:
    async with door.client(SMALL) as client:
        first = await client.post("/v1/sessions", json=session_body())
        second = await client.post("/v1/sessions", json=session_body())
        await client.delete(f"/v1/sessions/{first.json()['id']}")
        third = await client.post("/v1/sessions", json=session_body())
    assert first.status_code == 201
    assert second.status_code == 429
    body = second.json()
    assert (body["error"]["code"], body["decision"], body["error"]["type"]) == (
        "tenant_quota",
        "reject",
        "rate_limit_error",
    )
    assert 1 <= body["retry_after"] == int(second.headers["retry-after"]) <= 60
    assert third.status_code == 201  # closing released the quota at once


async def test_a_call_larger_than_its_session_may_hold_is_refused_by_name(door: Door) -> None:
    async with door.client() as client:
        # Declared: one call at a time of 20 + 10 tokens; with the default overrun of 2 a call
        # of its session may weigh 60.
        body = session_body(max_parallel=1, est_prompt_tokens=20, est_output_tokens=10)
        sid = (await client.post("/v1/sessions", json=body)).json()["id"]
        headers = {"X-Kvgate-Session": sid}
        small = await client.post("/v1/chat/completions", json=chat(10), headers=headers)
        large = await client.post(
            "/v1/chat/completions",
            json=chat_body("plan the refactor " * 100, 10, model=MODEL),
            headers=headers,
        )
        record = (await client.get(f"/v1/sessions/{sid}")).json()
    assert small.status_code == 200, small.text
    assert large.status_code == 400, large.text
    error = large.json()["error"]
    assert (error["code"], error["type"]) == ("call_exceeds_session", "invalid_request_error")
    assert "est_prompt_tokens" in error["message"]
    assert record["calls_started"] == 1  # the refused call took no slot


async def test_calls_past_the_declaration_are_charged_to_the_tenants_tokens_per_minute(
    door: Door,
) -> None:
    """A session declared small cannot be a way around its tenant's tokens per minute: what
    its calls use past the declaration is charged there, and refused once it is spent."""
    async with door.client(TIGHT) as client:
        body = session_body(
            max_parallel=1, expected_calls=1, est_prompt_tokens=90, est_output_tokens=10
        )
        created = await client.post("/v1/sessions", json=body)
        assert created.status_code == 201, created.text
        headers = {"X-Kvgate-Session": created.json()["id"]}
        answers = []
        for _ in range(60):  # each call weighs 40-100 tokens: the minute's 400 run out well
            # before, even if a new minute starts on the way
            call = await client.post("/v1/chat/completions", json=chat(10), headers=headers)
            answers.append(call)
            if call.status_code != 200:
                break
    refused = answers[-1]
    assert refused.status_code == 429, refused.text
    assert all(a.status_code == 200 for a in answers[:-1]) and len(answers) > 2
    error = refused.json()
    assert (error["error"]["code"], error["decision"]) == ("tenant_quota", "reject")
    assert 1 <= error["retry_after"] == int(refused.headers["retry-after"]) <= 60


async def test_a_session_the_fleet_cannot_hold_now_is_deferred_with_an_honest_retry_after(
    door: Door,
) -> None:
    # Standard may hold 80% of 4,096 tokens; each session takes 8 x 150 = 1,200.
    async with door.client() as client:
        admitted = [
            await client.post("/v1/sessions", json=session_body(max_parallel=8)) for _ in range(2)
        ]
        deferred = await client.post(
            "/v1/sessions", json=session_body(max_parallel=8, min_parallel=8, max_wait_s=0)
        )
        guaranteed = await client.post(
            "/v1/sessions", json=session_body(max_parallel=4, tier="guaranteed")
        )
        for resp in admitted:
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
        after_release = await client.post("/v1/sessions", json=session_body(max_parallel=8))
    assert [r.status_code for r in admitted] == [201, 201]
    assert deferred.status_code == 503
    body = deferred.json()
    assert (body["error"]["code"], body["decision"]) == ("tier_capacity", "defer")
    assert 1 <= body["retry_after"] == int(deferred.headers["retry-after"]) <= 60
    assert guaranteed.status_code == 201  # the top of the fleet is kept for guaranteed
    assert after_release.status_code == 201


HELD_FOR_S = 1.0
"""How long a held session is watched not being answered: that it is not answered within this
window is what is asserted."""
HOLD_S = 1.5
"""The hold that runs out (``max_wait_s``)."""
RELEASE_WAKE_BOUND_S = 5.0
"""How soon a release wakes a held session: generous for a loaded machine, it says only "not
the hold's end" (8 s)."""


async def test_a_session_that_does_not_fit_now_is_held_until_room_frees(
    fixed_door: Door,
) -> None:
    # Standard may hold 3,276 tokens of 4,096 and the window never grows: two sessions of
    # 8 x 150 leave no room for a third, until one of them closes.
    wide = session_body(max_parallel=8, min_parallel=8)
    async with fixed_door.client() as client:
        admitted = [await client.post("/v1/sessions", json=wide) for _ in range(2)]
        loop = asyncio.get_running_loop()
        asked = loop.time()
        held = asyncio.create_task(client.post("/v1/sessions", json={**wide, "max_wait_s": 8}))
        await asyncio.sleep(HELD_FOR_S)
        assert not held.done()  # held, not answered 503
        closed = loop.time()
        await client.delete(f"/v1/sessions/{admitted[0].json()['id']}")
        third = await held
        answered = loop.time()
        # Nothing closes now: the hold runs out and the answer is the deferral, as without one.
        timed_out = await client.post("/v1/sessions", json={**wide, "max_wait_s": HOLD_S})
        gave_up = loop.time()
        too_long = await client.post("/v1/sessions", json={**wide, "max_wait_s": 11})
        for resp in (admitted[1], third):
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
    assert [r.status_code for r in admitted] == [201, 201]
    assert third.status_code == 201, third.text
    # Admitted because of the release (woken by it on this replica), not by a retry.
    assert closed - asked >= HELD_FOR_S and answered - closed < RELEASE_WAKE_BOUND_S
    assert (timed_out.status_code, timed_out.json()["error"]["code"]) == (503, "tier_capacity")
    assert 1 <= int(timed_out.headers["retry-after"]) <= 60
    assert gave_up - answered >= HOLD_S
    assert (too_long.status_code, too_long.json()["error"]["param"]) == (400, "max_wait_s")

    def held_for() -> list[float | None]:
        with contextlib.closing(sqlite3.connect(fixed_door.ledger)) as db:
            rows = db.execute(
                "select signals from admission_decisions where scope = 'session' order by id"
            ).fetchall()
        return [json.loads(signals).get("held_s") for (signals,) in rows]

    # One row per answer: the two admitted at once, the held one, the one that timed out.
    held_s = await poll_until(
        lambda: asyncio.to_thread(held_for), lambda r: len(r) >= 4, timeout_s=SETTLE_BOUND_S
    )
    assert len(held_s) == 4 and held_s[:2] == [None, None]
    assert (held_s[2] or 0) >= HELD_FOR_S and (held_s[3] or 0) >= HOLD_S


async def held_now(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["kvgate_admission_held_sessions"].samples[0].value


async def until_held(client: httpx.AsyncClient, count: int) -> None:
    await poll_until(lambda: held_now(client), lambda n: n == count, timeout_s=SETTLE_BOUND_S)


async def test_held_sessions_get_the_room_that_frees_in_order_of_their_deadlines(
    fixed_door: Door,
) -> None:
    # Two sessions of 8 x 150 fill standard's 3,276 tokens; two more are held, the one with
    # the later deadline first. Room for one frees: the earlier deadline gets it.
    wide = session_body(max_parallel=8, min_parallel=8, max_wait_s=8)
    async with fixed_door.client() as client:
        admitted = [await client.post("/v1/sessions", json=wide) for _ in range(2)]
        late = asyncio.create_task(client.post("/v1/sessions", json={**wide, "deadline_s": 60}))
        await until_held(client, 1)
        early = asyncio.create_task(client.post("/v1/sessions", json={**wide, "deadline_s": 40}))
        await until_held(client, 2)
        await client.delete(f"/v1/sessions/{admitted[0].json()['id']}")
        first = await early
        await until_held(client, 1)
        assert not late.done()  # still held: the room went to the earlier deadline
        await client.delete(f"/v1/sessions/{first.json()['id']}")
        second = await late
        for resp in (admitted[1], second):
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
    assert [r.status_code for r in (*admitted, first, second)] == [201] * 4, second.text


async def test_a_session_behind_a_held_one_that_does_not_fit_is_admitted_if_it_fits(
    fixed_door: Door,
) -> None:
    # 2 x 1,200 reserved leaves 876 tokens: a held session of 1,200 does not fit, and a new one
    # of 2 x 150 that goes behind it (a later deadline) is still admitted at the next pass.
    wide = session_body(max_parallel=8, min_parallel=8, max_wait_s=8, deadline_s=30)
    narrow = session_body(max_parallel=2, min_parallel=2, max_wait_s=8, deadline_s=60)
    async with fixed_door.client() as client:
        admitted = [await client.post("/v1/sessions", json=wide) for _ in range(2)]
        big = asyncio.create_task(client.post("/v1/sessions", json=wide))
        await until_held(client, 1)
        small = await client.post("/v1/sessions", json=narrow)
        assert not big.done()
        await client.delete(f"/v1/sessions/{admitted[0].json()['id']}")
        bigger = await big
        for resp in (admitted[1], small, bigger):
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
    assert [r.status_code for r in (*admitted, small, bigger)] == [201] * 4, small.text


SESSION_LENGTH_S = 0.5
"""How long the sessions the pace learns from stay open: their length is what it learns."""


async def test_sessions_that_took_long_make_a_session_left_too_little_deadline_a_reject(
    door: Door,
) -> None:
    # One call of 50 output tokens: one round. 20 sessions (the fewest the pace learns from)
    # each take at least 0.5 s (SESSION_LENGTH_S), at least 10 ms per token: a session left
    # 0.3 s cannot finish.
    one = session_body(max_parallel=1, expected_calls=1, max_wait_s=0)
    short = {**one, "deadline_s": 0.3}
    async with door.client() as client:
        before = await client.post("/v1/sessions", json=short)
        assert before.status_code == 201, before.text  # nothing learned: no guess
        await client.delete(f"/v1/sessions/{before.json()['id']}")
        opened = [await client.post("/v1/sessions", json=one) for _ in range(20)]
        assert [r.status_code for r in opened] == [201] * 20
        await asyncio.sleep(SESSION_LENGTH_S)
        for resp in opened:
            await client.delete(f"/v1/sessions/{resp.json()['id']}")

        async def ask() -> httpx.Response:
            return await client.post("/v1/sessions", json=short)

        # The pace is refreshed twice a second off the request path.
        after = await poll_until(ask, lambda r: r.status_code == 503, timeout_s=SETTLE_BOUND_S)
        longer = await client.post("/v1/sessions", json={**one, "deadline_s": 30})
        # kvgate's client gives up at once, saying why.
        async with AsyncOpenAI(base_url=door.base + "/v1", api_key=ACME) as agents:
            with pytest.raises(SessionNotOpened) as refused:
                async with kvgate_session(agents, **short):
                    pytest.fail("admitted")
    assert after.json()["error"]["code"] == "deadline_infeasible"
    assert after.json()["decision"] == "reject" and "retry-after" not in after.headers
    assert after.headers["x-should-retry"] == "false"
    assert longer.status_code == 201, longer.text
    assert (refused.value.why, refused.value.code) == (
        GaveUp.WAITING_WILL_NOT_HELP,
        "deadline_infeasible",
    )
    assert refused.value.attempts == 1


async def test_sessions_still_open_make_a_session_left_too_little_deadline_a_reject(
    door: Door,
) -> None:
    """Before any session has ended, the sessions still open bound the pace from below (8 of
    them are enough for a first pace): a front door's first burst has one. Plain calls, whose
    one-call sessions end without a ``DELETE``, never count as open."""
    one = session_body(max_parallel=1, expected_calls=1, max_wait_s=0)
    short = {**one, "deadline_s": 0.3}
    async with door.client() as client:
        for _ in range(10):
            plain = await client.post("/v1/chat/completions", json=chat())
            assert plain.status_code == 200, plain.text
        await asyncio.sleep(SESSION_LENGTH_S)
        before = await client.post("/v1/sessions", json=short)
        assert before.status_code == 201, before.text  # plain calls taught nothing
        await client.delete(f"/v1/sessions/{before.json()['id']}")
        opened = [await client.post("/v1/sessions", json=one) for _ in range(8)]
        assert [r.status_code for r in opened] == [201] * 8
        # Open for 0.5 s, 50 tokens each: at least 10 ms a token, more than a session left
        # 0.3 s for 50 tokens can afford; none of them closed.
        await asyncio.sleep(SESSION_LENGTH_S)

        async def ask() -> httpx.Response:
            return await client.post("/v1/sessions", json=short)

        after = await poll_until(ask, lambda r: r.status_code == 503, timeout_s=SETTLE_BOUND_S)
        longer = await client.post("/v1/sessions", json={**one, "deadline_s": 30})
        for resp in opened:
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
    assert after.json()["error"]["code"] == "deadline_infeasible"
    assert longer.status_code == 201, longer.text


async def window(client: httpx.AsyncClient, tier: str = "standard") -> float:
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["kvgate_admission_window"].samples
    return next(float(s.value) for s in samples if s.labels["tier"] == tier)


async def test_admission_window_grows_while_turned_away_and_shrinks_on_missed_objectives(
    door: Door,
) -> None:
    # Two sessions hold most of the standard share (2 x 1,200 of 3,276 tokens). A third that
    # will not be shaped is deferred at first: the window starts at the static over-commit
    # (1). While sessions keep being turned away and no admitted call misses its objective,
    # the window grows, and the same request is admitted.
    wide = session_body(max_parallel=8, min_parallel=8, max_wait_s=0)
    async with door.client() as client:
        held = [await client.post("/v1/sessions", json=wide) for _ in range(2)]
        first = await client.post("/v1/sessions", json=wide)

        async def ask() -> httpx.Response:
            return await client.post("/v1/sessions", json=wide)

        later = await poll_until(
            ask, lambda r: r.status_code == 201, timeout_s=WINDOW_GROWTH_BOUND_S
        )
        grown = await window(client)
        for resp in [*held, later]:
            await client.delete(f"/v1/sessions/{resp.json()['id']}")
    assert [r.status_code for r in held] == [201, 201]
    assert (first.status_code, first.json()["error"]["code"]) == (503, "tier_capacity")
    assert 1.0 < grown <= 16.0  # KVGATE_ADMISSION_KV_OVERCOMMIT_MAX
    # A tenant whose own standard objective no call can meet: twenty calls (min_calls) of two
    # sessions (min_missed: one missed session is not a trend) that all miss cut the standard
    # window, and best-effort's below it, by 0.7.
    async with door.client(STRICT) as strict:
        sids = [
            (await strict.post("/v1/sessions", json=session_body(max_parallel=4))).json()["id"]
            for _ in range(2)
        ]
        before = await window(strict)
        calls = await asyncio.gather(
            *(
                strict.post(
                    "/v1/chat/completions", json=chat(4), headers={"X-Kvgate-Session": sids[n % 2]}
                )
                for n in range(20)
            )
        )
        cut = await poll_until(
            lambda: window(strict),
            lambda v: v < before,
            timeout_s=WINDOW_CUT_BOUND_S,
            interval_s=0.2,
        )
        text = (await strict.get("/metrics")).text
    assert [c.status_code for c in calls] == [200] * 20
    assert cut == pytest.approx(max(1.0, before * 0.7), rel=0.05)
    judged = {
        (s.labels["tier"], s.labels["met"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvgate_calls_judged"
        for s in f.samples
        if s.name == "kvgate_calls_judged_total"
    }
    assert judged[("standard", "no")] >= 20


async def test_a_session_that_does_not_fit_is_admitted_with_fewer_calls_in_flight(
    door: Door,
) -> None:
    # Standard may hold 3,276 tokens of 4,096: 21 calls of 150, not 30. Admitted with 21,
    # unless it asks for at least 22.
    async with door.client() as client:
        shaped = await client.post("/v1/sessions", json=session_body(max_parallel=30))
        refused = await client.post(
            "/v1/sessions", json=session_body(max_parallel=30, min_parallel=22)
        )
        bad = await client.post("/v1/sessions", json=session_body(max_parallel=3, min_parallel=4))
    assert shaped.status_code == 201, shaped.text
    body = shaped.json()
    assert body["lease"]["max_parallel"] == 21
    assert body["lease"]["reserved_tokens"] == 21 * 150
    assert body["admission"]["requested_parallel"] == 30
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "exceeds_capacity")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "min_parallel")


async def test_a_call_with_no_session_is_a_one_call_session(door: Door) -> None:
    async with door.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat())
        assert resp.status_code == 200, resp.text
        sid = resp.headers["x-kvgate-session"]
        record = (await client.get(f"/v1/sessions/{sid}")).json()
        too_big = await client.post("/v1/chat/completions", json=chat(4000))
        above = await client.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Tier": "guaranteed"}
        )
    assert record["state"] == "closed" and record["calls_started"] == 1
    # 4,000 output tokens is more than standard may ever hold of a 4,096-token fleet.
    assert (too_big.status_code, too_big.json()["error"]["code"]) == (503, "exceeds_capacity")
    assert above.status_code == 200  # acme may use guaranteed
    async with door.client(CHEAP) as cheap:
        resp = await cheap.post("/v1/chat/completions", json=chat())  # defaults to besteffort
        refused = await cheap.post(
            "/v1/chat/completions", json=chat(), headers={"X-Kvgate-Tier": "standard"}
        )
    assert resp.status_code == 200
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "tier_not_allowed")


def ledger_rows(path: Path) -> list[tuple[str, str, str, str, str]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT tenant, tier, scope, decision, reason FROM admission_decisions ORDER BY id"
        ).fetchall()


async def test_every_decision_is_in_the_ledger_and_the_metrics(door: Door) -> None:
    async with door.client(SMALL) as client:
        await client.post("/v1/sessions", json=session_body())
        await client.post("/v1/sessions", json=session_body())
        metrics = (await client.get("/metrics")).text
    rows = await poll_until(
        lambda: asyncio.to_thread(ledger_rows, door.ledger),
        lambda r: len(r) >= 2,
        timeout_s=SETTLE_BOUND_S,
    )
    assert rows == [
        ("small", "standard", "session", "admit", "admitted"),
        ("small", "standard", "session", "reject", "tenant_quota"),
    ]
    with sqlite3.connect(door.ledger) as conn:
        signals, latency = conn.execute(
            "SELECT signals, latency_us FROM admission_decisions ORDER BY id DESC LIMIT 1"
        ).fetchone()
    assert '"tenant_sessions": 1' in signals and latency > 0
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    key = (
        "kvgate_admission_decisions_total",
        (("decision", "reject"), ("reason", "tenant_quota"), ("tier", "standard")),
    )
    assert values[key] == 1
    assert values[("kvgate_ledger_dropped_total", ())] == 0


@pytest.fixture
def redis_down_door(nats_server: EmbeddedNats, tmp_path: Path, tenants_file: Path) -> Iterator[str]:
    proc, base = start_api(
        nats_server.url,
        tmp_path,
        KVGATE_TENANTS_FILE=str(tenants_file),
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_REDIS_URL="redis://127.0.0.1:1/0",  # nothing listens there
    )
    try:
        yield base
    finally:
        proc.stop()


async def test_with_redis_down_guaranteed_degrades_to_a_local_budget_and_others_wait(
    redis_down_door: str, nats_server: EmbeddedNats
) -> None:
    await stuck_worker_heartbeat(nats_server.url)  # capacity to admit against: 2,048 tokens
    await wait_ready(redis_down_door)  # the front door saw it
    headers = {"Authorization": f"Bearer {ACME}"}
    async with httpx.AsyncClient(base_url=redis_down_door, headers=headers) as client:
        guaranteed = await client.post(
            "/v1/sessions", json=session_body(tier="guaranteed", max_parallel=4)
        )
        # The local budget is half the fleet (KVGATE_DEGRADED_SHARE 0.5): 1,024 tokens.
        too_much = await client.post(
            "/v1/sessions",
            json=session_body(tier="guaranteed", max_parallel=4, min_parallel=4, max_wait_s=0),
        )
        standard = await client.post("/v1/sessions", json=session_body())
        got = await client.get(f"/v1/sessions/{guaranteed.json()['id']}")
    assert guaranteed.status_code == 201, guaranteed.text
    assert guaranteed.json()["admission"]["reason"] == "admitted_degraded"
    assert got.status_code == 200
    assert (too_much.status_code, too_much.json()["error"]["code"]) == (503, "fleet_saturated")
    assert standard.status_code == 503
    body = standard.json()
    assert (body["error"]["code"], body["decision"]) == ("admission_unavailable", "defer")
    assert body["retry_after"] == int(standard.headers["retry-after"])


async def test_a_front_door_records_its_decisions_in_postgresql(
    nats_server: EmbeddedNats, tmp_path: Path, tenants_file: Path
) -> None:
    from tests.databases import postgres_database

    def rows(url: str) -> list[tuple[str, str, str]]:
        with psycopg.connect(url) as conn:
            return conn.execute(
                "SELECT tenant, decision, reason FROM admission_decisions ORDER BY id"
            ).fetchall()

    with postgres_database() as url:
        proc, base = start_api(
            nats_server.url,
            tmp_path,
            KVGATE_TENANTS_FILE=str(tenants_file),
            KVGATE_SERVED_MODEL_NAME=MODEL,
            KVGATE_DATABASE_URL=url,
        )
        try:
            await stuck_worker_heartbeat(nats_server.url)
            await wait_ready(base)  # the front door saw it
            headers = {"Authorization": f"Bearer {SMALL}"}
            async with httpx.AsyncClient(base_url=base, headers=headers) as client:
                assert (await client.post("/v1/sessions", json=session_body())).status_code == 201
                assert (await client.post("/v1/sessions", json=session_body())).status_code == 429
            written = await poll_until(
                lambda: asyncio.to_thread(rows, url),
                lambda r: len(r) >= 2,
                timeout_s=SETTLE_BOUND_S,
            )
        finally:
            proc.stop()
    assert written == [("small", "admit", "admitted"), ("small", "reject", "tenant_quota")]
