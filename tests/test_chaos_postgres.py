"""PostgreSQL, the front door's database (ledger, batches, files), down for 30 s under mixed load
(issue 14's chaos suite). Real processes: the front door, NATS, a Redis and a PostgreSQL
cluster of the test's own; one in-process worker on the simulated engine.

What an operator relies on: interactive traffic does not touch the database on its path, so it
goes on unaffected; the decisions that could not be written are dropped and counted
(``kvgate_ledger_dropped_total``), never queued without bound nor blocking a decision; batch
results wait in their JetStream stream (``KVGATE_RESULTS``) and reach the database once it is
back, every line exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from broker.natsserver import EmbeddedNats
from tests.chaos import (
    Kind,
    LoadShape,
    chaos_stack,
    check_answers,
    check_batch,
    jetstream_holdings,
    metrics,
    summary,
    wait_for_zero,
)
from tests.polling import poll_until
from tests.servers import PostgresCluster, RedisServer

WARMUP_S = 4.0
DOWN_S = 30.0
AFTER_S = 4.0
RESULTS_BOUND_S = 75.0
"""For the batch results held in the stream while the database was down to reach it: the
collector leaves a result it could not write unacknowledged, so it comes back after the results
consumer's ack wait (``KVGATE_STREAM_ACK_WAIT_S``, 30 s), plus a loaded machine's slack."""
ALLOWED_REFUSALS = frozenset({"fleet_saturated", "tier_capacity"})
"""What a session may be told under this load with every store up: the fleet is busy."""


@pytest.fixture
def postgres() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster()
    try:
        yield cluster.start()
    finally:
        cluster.remove()


def batch_lines(url: str, batch_id: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT custom_id, status FROM batch_lines WHERE batch_id = %s ORDER BY line_no",
            (batch_id,),
        ).fetchall()
    return [(str(custom_id), str(status)) for custom_id, status in rows]


async def test_postgresql_down_for_30s_leaves_interactive_traffic_alone_and_loses_no_result(
    tmp_path: Path,
    nats_server: EmbeddedNats,
    redis_server: RedisServer,
    postgres: PostgresCluster,
) -> None:
    database = postgres.create_database("kvgate_chaos")
    # Batch lines of 400 tokens (2 s each), four per session one after another: lines are
    # running when the database goes away.
    shape = LoadShape(batch_sessions=3, batch_calls_per_session=4, batch_tokens=400)
    async with chaos_stack(
        tmp_path, nats_server.url, redis_url=redis_server.url, database_url=database
    ) as stack:
        load = stack.load(shape)
        await load.start()
        await load.run_for(WARMUP_S)
        before = await metrics(stack.base_url)
        postgres.stop()
        down_s = time.monotonic()
        # Results of the lines that were running arrive, and wait in their stream.
        held = await poll_until(
            lambda: jetstream_holdings(stack.nats_url),
            lambda h: h["js_results_pending"] > 0,
            timeout_s=DOWN_S,
        )
        await load.run_for(DOWN_S - (time.monotonic() - down_s))
        during_metrics = await metrics(stack.base_url)
        postgres.start()
        up_s = time.monotonic()
        await poll_until(
            lambda: jetstream_holdings(stack.nats_url),
            lambda h: h["js_results_pending"] == 0,
            timeout_s=RESULTS_BOUND_S,
        )
        results_s = time.monotonic() - up_s
        written = await poll_until(
            lambda: metrics(stack.base_url),
            lambda m: (
                m["kvgate_ledger_written_total"] > during_metrics["kvgate_ledger_written_total"]
            ),
            timeout_s=RESULTS_BOUND_S,
        )
        ledger_s = time.monotonic() - up_s
        await load.run_for(AFTER_S)
        await load.stop()
        batch = await check_batch(load)
        settled_s, readings = await wait_for_zero(stack.rest)
        after = await metrics(stack.base_url)
    print(
        f"\npostgresql down 30 s: results held {held['js_results_pending']}, reached the "
        f"database {results_s:.2f} s after it was back, ledger writing again after "
        f"{ledger_s:.2f} s, back to zero {settled_s:.2f} s; ledger dropped "
        f"{after['kvgate_ledger_dropped_total'] - before['kvgate_ledger_dropped_total']:.0f}"
        f"\n{summary(load.outcomes)}"
    )
    assert check_answers(load.outcomes) == []
    # Interactive traffic during the outage: every call answered, every session admitted
    # (or told the fleet is busy, as without the outage).
    during = [o for o in load.outcomes if o.during(down_s, up_s) and not o.disconnected]
    assert any(o.kind is Kind.SESSION_CALL for o in during)
    for o in during:
        if o.kind is Kind.SESSION_OPEN:
            assert o.ok or o.code in ALLOWED_REFUSALS, o
        else:
            assert o.ok, o
    # The decisions of the outage were dropped and counted, and the ledger writes again.
    assert during_metrics["kvgate_ledger_dropped_total"] > before["kvgate_ledger_dropped_total"]
    assert written["kvgate_ledger_written_total"] > during_metrics["kvgate_ledger_written_total"]
    assert after["kvgate_ledger_queued"] == 0
    # Every line's result in the database, once.
    lines = await asyncio.to_thread(batch_lines, database, batch["id"])
    assert [custom_id for custom_id, _ in lines] == load.batch_custom_ids
    assert all(status == "completed" for _, status in lines), lines
    assert readings["js_results_pending"] == 0
