"""Batches through a real front door (subprocess) and real NATS, with an in-process worker on
the simulated engine: validation, tenancy, ordering, exactly one result per line."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.batches.request import ParsedLine
from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from tests.batches import batch_results, wait_for_batch, write_batch
from tests.calls import chat_body
from tests.procs import start_api
from tests.simworker import sim_worker
from tests.tenants import tenant, write_tenants_file
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
ACME, OTHER, CHEAP = "acme-key", "other-key", "cheap-key"

BATCH_END_BOUND_S = 60.0
"""For a batch of up to twenty calls to end on the simulated engine: generous for a loaded
2-core machine."""


def line(custom_id: str, session: str, *, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "session": session,
        "body": chat_body(f"step {custom_id}", max_tokens, model=MODEL),
        **extra,
    }


class Door:
    def __init__(self, base: str, db: Path, restart: Any) -> None:
        self.base = base
        self.db = db
        self.restart = restart

    def client(self, key: str = ACME) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )


@pytest.fixture
async def door(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Door]:
    tenants = write_tenants_file(
        tmp_path,
        tenant("acme", ACME, max_tier="guaranteed"),
        tenant("other", OTHER),
        tenant("cheap", CHEAP, max_tier="besteffort"),
    )
    db = tmp_path / "kvgate.db"

    def start() -> tuple[Proc, str]:
        return start_api(
            nats_server.url,
            tmp_path,
            KVGATE_TENANTS_FILE=str(tenants),
            KVGATE_SERVED_MODEL_NAME=MODEL,
            KVGATE_DATABASE_URL=f"sqlite:///{db}",
            KVGATE_BATCH_TICK_S="0.1",
        )

    procs = [start()]

    def restart() -> str:
        procs[-1][0].stop()
        procs.append(start())
        return procs[-1][1]

    base = procs[0][1]
    engine = SimEngine(SimEngineConfig(step_s=0.002, kv_capacity_tokens=8192))
    try:
        async with sim_worker(engine, nats_server.url, "sim-b", ready_at=base):
            yield Door(base, db, restart)
    finally:
        procs[-1][0].stop()


async def test_a_batch_of_sessions_completes_with_one_result_per_line_in_session_order(
    door: Door,
) -> None:
    lines = [line(f"s{s}-c{c}", f"s{s}") for s in range(5) for c in range(3)]
    lines.append(line("s9-a", "s9"))
    lines.append(line("s9-b", "s9", parallel=True))
    async with door.client() as client:
        resp = await client.post("/v1/batches", json={"completion_window": "1h", "requests": lines})
        assert resp.status_code == 201, resp.text
        batch = resp.json()
        assert (batch["status"], batch["tier"], batch["completion_window"]) == (
            "in_progress",
            "besteffort",
            "1h",
        )
        assert batch["request_counts"]["total"] == 17 and batch["errors"] == []
        done = await wait_for_batch(client, batch["id"], timeout_s=BATCH_END_BOUND_S)
        out = await batch_results(client, batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 17
    assert [r["custom_id"] for r in out] == [x["custom_id"] for x in lines]
    assert all(r["status"] == "completed" and r["status_code"] == 200 for r in out)
    assert all(r["body"]["usage"]["completion_tokens"] == 6 for r in out)
    with sqlite3.connect(door.db) as conn:
        rows = conn.execute(
            "SELECT custom_id, started_at, finished_at FROM batch_lines ORDER BY line_no"
        ).fetchall()
    times = {cid: (started, ended) for cid, started, ended in rows}
    for s in range(5):  # each call of a session started after the one before it finished
        for c in range(1, 3):
            assert times[f"s{s}-c{c}"][0] >= times[f"s{s}-c{c - 1}"][1]


async def test_bad_lines_are_reported_and_answered_and_a_bad_batch_is_a_400(door: Door) -> None:
    good = line("ok-1", "a")
    lines: list[Any] = [
        good,
        {"session": "a", "body": good["body"]},  # no custom_id
        line("ok-1", "a"),  # duplicate custom_id
        {"custom_id": "no-body", "session": "a"},
        {**line("bad-model", "b"), "body": {**good["body"], "model": "gpt-9"}},
        {**line("bad-tokens", "b"), "body": {**good["body"], "max_tokens": -3}},
        {**line("streamy", "b"), "body": {**good["body"], "stream": True}},
    ]
    async with door.client() as client:
        resp = await client.post("/v1/batches", json={"requests": lines})
        assert resp.status_code == 201, resp.text
        body = resp.json()
        errors = {(e["line"], e["custom_id"], e["code"]) for e in body["errors"]}
        assert errors == {
            (2, None, "invalid_parameter"),
            (3, "ok-1", "invalid_parameter"),
            (4, "no-body", "invalid_request"),
            (5, "bad-model", "model_not_found"),
            (6, "bad-tokens", "invalid_max_tokens"),
            (7, "streamy", "unsupported_parameter"),
        }
        await wait_for_batch(client, body["id"], timeout_s=BATCH_END_BOUND_S)
        out = await batch_results(client, body["id"])
        assert len(out) == 7  # one result per input line, bad ones included
        assert [r["status"] for r in out].count("completed") == 1
        assert {r["error"]["code"] for r in out if r["status"] == "failed"} >= {"model_not_found"}

        all_bad = await client.post("/v1/batches", json={"requests": lines[1:2]})
        not_a_list = await client.post("/v1/batches", json={"requests": "x"})
        window = await client.post(
            "/v1/batches", json={"requests": [good], "completion_window": "30m"}
        )
        jsonl = await client.post(
            "/v1/batches?completion_window=2h",
            content=("\n".join(json.dumps(x) for x in [good, line("j2", "j")]) + "\n{oops\n"),
            headers={"content-type": "application/jsonl"},
        )
    assert (all_bad.status_code, all_bad.json()["error"]["code"]) == (400, "invalid_request")
    assert not_a_list.status_code == 400
    assert (window.status_code, window.json()["error"]["param"]) == (400, "completion_window")
    assert jsonl.status_code == 201
    assert [(e["line"], e["code"]) for e in jsonl.json()["errors"]] == [(3, "invalid_json")]
    assert jsonl.json()["completion_window"] == "2h"


async def test_a_seed_past_vllms_64_bit_range_is_refused_by_name_for_a_call_and_a_line(
    door: Door,
) -> None:
    big = 1 << 70  # vLLM reads seed as a signed 64-bit integer, msgpack cannot carry it
    seeded = line("big-seed", "b")
    seeded["body"] = {**seeded["body"], "seed": big}
    jsonl = "\n".join(json.dumps(x) for x in (line("ok", "a"), seeded)).encode()
    async with door.client() as client:
        call = await client.post(
            "/v1/chat/completions", json={**line("c", "c")["body"], "seed": big}
        )
        # Inline, the batch is one JSON body: refused whole, with the line's path named.
        inline = await client.post("/v1/batches", json={"requests": [line("ok", "a"), seeded]})
        # As JSONL, each line is its own: that line fails alone.
        resp = await client.post(
            "/v1/batches", content=jsonl, headers={"content-type": "application/jsonl"}
        )
        assert resp.status_code == 201, resp.text
        done = await wait_for_batch(client, resp.json()["id"], timeout_s=BATCH_END_BOUND_S)
        out = await batch_results(client, resp.json()["id"])
    assert call.status_code == 400, call.text
    assert (call.json()["error"]["code"], call.json()["error"]["param"]) == (
        "invalid_parameter",
        "seed",
    )
    assert (inline.status_code, inline.json()["error"]["code"]) == (400, "invalid_parameter")
    assert "requests[1].body.seed" in inline.json()["error"]["message"]
    assert [(e["line"], e["code"]) for e in resp.json()["errors"]] == [(2, "invalid_parameter")]
    assert "seed" in resp.json()["errors"][0]["message"]
    assert done["request_counts"]["completed"] == 1
    assert [(r["custom_id"], r["status"]) for r in out] == [
        ("ok", "completed"),
        ("big-seed", "failed"),
    ]


async def test_a_stored_line_that_can_no_longer_be_sent_fails_alone(door: Door) -> None:
    # As if stored before the seed was checked on submit: the runner must fail that line by
    # itself, not stop on it every tick (which stalled its batch and every batch after it).
    bad_body = {**line("x", "x")["body"], "seed": 1 << 70}
    stored = store_batch(
        door.db,
        [
            ParsedLine(1, "bad", "s1", False, bad_body),
            ParsedLine(2, "ok-1", "s2", False, line("x", "x")["body"]),
        ],
    )
    after = store_batch(door.db, [ParsedLine(1, "ok-2", "s3", False, line("x", "x")["body"])])
    async with door.client() as client:
        done = await wait_for_batch(client, stored, timeout_s=BATCH_END_BOUND_S)
        other = await wait_for_batch(client, after, timeout_s=BATCH_END_BOUND_S)
        out = await batch_results(client, stored)
    assert done["status"] == other["status"] == "completed"
    assert [(r["custom_id"], r["status"]) for r in out] == [
        ("bad", "failed"),
        ("ok-1", "completed"),
    ]
    assert out[0]["error"]["code"] == "invalid_parameter" and "seed" in out[0]["error"]["message"]


def store_batch(db: Path, lines: list[ParsedLine]) -> str:
    """A batch of acme's written straight to the database: its lines are not checked."""
    return write_batch(f"sqlite:///{db}", "acme", lines)


async def test_a_tenant_sees_only_its_own_batches(door: Door) -> None:
    async with door.client() as acme, door.client(OTHER) as other, door.client(CHEAP) as cheap:
        batch = (await acme.post("/v1/batches", json={"requests": [line("x", "s")]})).json()
        for path in ("", "/results"):
            resp = await other.get(f"/v1/batches/{batch['id']}{path}")
            assert (resp.status_code, resp.json()["error"]["code"]) == (404, "batch_not_found")
        assert (await other.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 404
        assert (await other.get("/v1/batches")).json()["data"] == []
        listed = (await acme.get("/v1/batches")).json()
        assert [b["id"] for b in listed["data"]] == [batch["id"]]
        above = await cheap.post(
            "/v1/batches", json={"requests": [line("x", "s")], "tier": "standard"}
        )
        assert (above.status_code, above.json()["error"]["code"]) == (403, "tier_not_allowed")


async def test_an_idempotency_key_and_pagination(door: Door) -> None:
    headers = {"Idempotency-Key": "nightly-42"}
    async with door.client() as client:
        first = await client.post(
            "/v1/batches", json={"requests": [line("a", "s")]}, headers=headers
        )
        again = await client.post(
            "/v1/batches", json={"requests": [line("a", "s")]}, headers=headers
        )
        others = [
            (await client.post("/v1/batches", json={"requests": [line("a", "s")]})).json()["id"]
            for _ in range(3)
        ]
        too_long = await client.post(
            "/v1/batches",
            json={"requests": [line("a", "s")]},
            headers={"Idempotency-Key": "k" * 256},
        )
        page1 = (await client.get("/v1/batches", params={"limit": 2})).json()
        page2 = (
            await client.get("/v1/batches", params={"limit": 2, "after": page1["last_id"]})
        ).json()
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    # Refused by name, as for sessions, before the table's 255-character column sees it.
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "invalid_parameter"
    assert too_long.json()["error"]["param"] == "Idempotency-Key"
    assert page1["has_more"] and not page2["has_more"]
    seen = [b["id"] for b in page1["data"] + page2["data"]]
    assert sorted(seen) == sorted([first.json()["id"], *others]) and len(set(seen)) == 4


async def test_results_survive_a_restart_of_the_front_door(door: Door) -> None:
    async with door.client() as client:
        batch = (await client.post("/v1/batches", json={"requests": [line("r1", "s")]})).json()
        await wait_for_batch(client, batch["id"], timeout_s=BATCH_END_BOUND_S)
        before = await batch_results(client, batch["id"])
    door.base = await asyncio.to_thread(door.restart)
    async with door.client() as client:
        after = await batch_results(client, batch["id"])
        status = (await client.get(f"/v1/batches/{batch['id']}")).json()["status"]
    assert after == before and status == "completed"
    assert after[0]["body"]["choices"][0]["finish_reason"] == "length"


async def test_work_left_when_the_window_closes_is_reported_expired_per_line(
    door: Door,
) -> None:
    lines = [line(f"e{s}-c{c}", f"e{s}", max_tokens=200) for s in range(4) for c in range(5)]
    async with door.client() as client:
        batch = (await client.post("/v1/batches", json={"requests": lines})).json()
        # The window closes now (as if 24 hours had passed): written where the runner reads it.
        with sqlite3.connect(door.db) as conn:
            conn.execute(
                "UPDATE batches SET expires_at = '2000-01-01 00:00:00' WHERE id = ?",
                (batch["id"],),
            )
        done = await wait_for_batch(client, batch["id"], timeout_s=BATCH_END_BOUND_S)
        out = await batch_results(client, batch["id"])
    statuses = [r["status"] for r in out]
    assert done["status"] == "expired"
    assert len(out) == 20 and set(statuses) <= {"completed", "expired"}
    assert statuses.count("expired") >= 10  # each session's later calls never started
    assert all(r["error"]["code"] == "deadline_exceeded" for r in out if r["status"] == "expired")
