"""Stream and consumer provisioning, publishing and the server-side TTL, on a real NATS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError

from broker.errors import DeadlineExceeded, QueueFull
from broker.lag import fleet_lag
from broker.natsserver import EmbeddedNats
from broker.procs import free_port
from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls, stream_config, workers_bucket
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import STREAM_NAME, Header, consumer_name, model_token
from tests.calls import MODEL, make_call
from tests.polling import poll_until

EXPIRY_BOUND_S = 10.0
"""For the server to drop a message or a key past its TTL (0.5 to 1 s here): generous for a
loaded machine."""


async def test_provisioning_is_idempotent_and_matches_the_design(nc: NATS) -> None:
    js = nc.jetstream()
    settings = StreamSettings()
    await provision_calls(js, settings, MODEL)
    await provision_calls(js, settings, MODEL)  # a second worker starting up
    await provision_calls(js, settings)  # a front door
    info = await js.stream_info(STREAM_NAME)
    assert info.config.subjects == ["kvgate.calls.>"]
    assert info.config.retention == js_api.RetentionPolicy.WORK_QUEUE
    assert info.config.discard == js_api.DiscardPolicy.NEW
    assert info.config.allow_msg_ttl is True
    for tier in TIERS_BY_PRIORITY:
        consumer = await js.consumer_info(STREAM_NAME, consumer_name(tier, MODEL))
        token = model_token(MODEL)
        assert consumer.config.durable_name == f"kvgate-{tier.value}-{token}"
        assert consumer.config.filter_subject == f"kvgate.calls.{tier.value}.{token}"
        assert consumer.config.ack_policy == js_api.AckPolicy.EXPLICIT
        assert consumer.config.max_deliver == settings.max_deliver


async def test_provisioning_updates_changed_limits(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    await provision_calls(js, StreamSettings(max_msgs=7, max_deliver=5), MODEL)
    assert (await js.stream_info(STREAM_NAME)).config.max_msgs == 7
    consumer = await js.consumer_info(STREAM_NAME, consumer_name(Tier.GUARANTEED, MODEL))
    assert consumer.config.max_deliver == 5


async def test_published_call_carries_the_wire_headers(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    call = make_call("c1", tier=Tier.GUARANTEED)
    await CallPublisher(js).publish(call, "_INBOX.test.c1", now_ms=call.created_ms)
    sub = await js.pull_subscribe_bind(consumer_name(Tier.GUARANTEED, MODEL), stream=STREAM_NAME)
    (msg,) = await sub.fetch(1, timeout=2)
    assert msg.headers is not None
    assert msg.headers[Header.CALL] == "c1"
    assert msg.headers[Header.MSG_ID] == "c1"
    assert msg.headers[Header.TIER] == "guaranteed"
    assert msg.headers[Header.REPLY] == "_INBOX.test.c1"
    assert msg.headers[Header.DEADLINE] == str(call.deadline_ms)
    assert msg.headers[Header.TTL] == "30"


def test_model_tokens_are_subject_safe_and_distinct() -> None:
    names = ["meta-llama/Llama-3.1-8B", "meta-llama.Llama-3.1-8B", "Qwen/Qwen3 0.6B", "*", ""]
    tokens = [model_token(name) for name in names]
    assert len(set(tokens)) == len(names)
    for token in tokens:
        assert token and all(c.isalnum() or c in "_-" for c in token), token
    assert model_token("meta-llama/Llama-3.1-8B").startswith("meta-llama_Llama-3_1-8B-")


async def test_each_model_has_its_own_queue(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    await provision_calls(js, StreamSettings(), "org/other.model")
    publisher = CallPublisher(js)
    for call in (make_call("a"), make_call("b", model="org/other.model")):
        await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    for model, expected in ((MODEL, "a"), ("org/other.model", "b")):
        sub = await js.pull_subscribe_bind(consumer_name(Tier.STANDARD, model), stream=STREAM_NAME)
        (msg,) = await sub.fetch(1, timeout=2)
        assert msg.headers is not None and msg.headers[Header.CALL] == expected
        await msg.ack()
        with pytest.raises(TimeoutError):
            await sub.fetch(1, timeout=0.3)


async def test_a_stream_of_the_previous_layout_is_brought_to_this_one(nc: NATS) -> None:
    js = nc.jetstream()
    old = stream_config(StreamSettings())
    old.subjects = ["kvgate.calls.*"]
    await js.add_stream(old)
    await provision_calls(js, StreamSettings(), MODEL)
    assert (await js.stream_info(STREAM_NAME)).config.subjects == ["kvgate.calls.>"]


async def test_duplicate_publish_is_deduplicated_by_call_id(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    call = make_call("same")
    publisher = CallPublisher(js)
    await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    assert (await js.stream_info(STREAM_NAME)).state.messages == 1


async def test_server_drops_a_call_nobody_fetched_before_its_deadline(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    call = make_call("short", deadline_in_s=0.5)
    await CallPublisher(js).publish(call, "_INBOX.x", now_ms=call.created_ms)
    assert (await js.stream_info(STREAM_NAME)).state.messages == 1
    # A TimeoutError here: the server kept it.
    await poll_until(
        lambda: js.stream_info(STREAM_NAME),
        lambda info: info.state.messages == 0,
        timeout_s=EXPIRY_BOUND_S,
    )


async def test_full_queue_is_a_retryable_queue_full(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(max_msgs=2))
    publisher = CallPublisher(js)
    for i in range(2):
        call = make_call(f"c{i}")
        await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    call = make_call("c-over")
    with pytest.raises(QueueFull) as caught:
        await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    assert caught.value.retry_after >= 1


async def test_publishing_past_the_deadline_is_refused(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    call = make_call("late", deadline_in_s=-1)
    with pytest.raises(DeadlineExceeded):
        await CallPublisher(js).publish(call, "_INBOX.x", now_ms=int(time.time() * 1000))


async def test_workers_bucket_expires_entries(nc: NATS) -> None:
    js = nc.jetstream()
    kv = await workers_bucket(js, StreamSettings(worker_ttl_s=1))
    again = await workers_bucket(js, StreamSettings(worker_ttl_s=1))
    await kv.put("w1", b"beat")
    entry = await again.get("w1")
    assert entry.value == b"beat"

    async def present() -> bool:
        try:
            await kv.get("w1")
        except KeyNotFoundError:
            return False
        return True

    # A TimeoutError here: the entry outlived its TTL.
    await poll_until(present, lambda there: not there, timeout_s=EXPIRY_BOUND_S)


async def test_lag_sums_every_models_queue_at_a_tier(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)  # model b has no worker yet
    publisher = CallPublisher(js)
    calls = [make_call("a1"), make_call("a2"), make_call("b1", model="org/b")]
    calls.append(make_call("g1", tier=Tier.GUARANTEED, model="org/b"))
    for call in calls:
        await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    sub = await js.pull_subscribe_bind(consumer_name(Tier.STANDARD, MODEL), stream=STREAM_NAME)
    (delivered,) = await sub.fetch(1, timeout=2)  # a1: delivered, not acked
    rows = {row.tier: row for row in await fleet_lag(js, now_s=time.time() + 10)}
    standard = rows[Tier.STANDARD]
    assert (standard.pending, standard.ack_pending) == (2, 1)
    assert standard.oldest_pending_age_s is not None and standard.oldest_pending_age_s >= 9
    assert (rows[Tier.GUARANTEED].pending, rows[Tier.BESTEFFORT].pending) == (1, 0)
    assert rows[Tier.BESTEFFORT].oldest_pending_age_s is None
    await delivered.ack()


DOWN_S = 2.5
"""Longer than the publisher's wait for one acknowledgement (2 s): the first attempt times out."""


async def test_a_call_published_while_the_server_restarts_lands_once(tmp_path: Path) -> None:
    port = free_port()
    store = tmp_path / "nats"
    server = EmbeddedNats(store, port=port, log_file=tmp_path / "nats.log").start()
    nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        await provision_calls(js, StreamSettings(), MODEL)
        server.stop()
        call = make_call("across-restart")
        publish = asyncio.create_task(
            CallPublisher(js).publish(call, "_INBOX.x", now_ms=call.created_ms)
        )
        await asyncio.sleep(DOWN_S)
        server = EmbeddedNats(store, port=port, log_file=tmp_path / "nats-2.log").start()
        seq = await publish
        info = await js.stream_info(STREAM_NAME)
        assert (info.state.messages, info.state.last_seq) == (1, seq)
    finally:
        await nc.close()
        server.stop()
