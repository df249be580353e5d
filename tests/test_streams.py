"""Stream and consumer provisioning, publishing and the server-side TTL, on a real NATS."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError

from broker.errors import DeadlineExceeded, QueueFull
from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls, workers_bucket
from schemas.vocab import TIERS_BY_PRIORITY, Endpoint, Tier
from schemas.wire import STREAM_NAME, CallEnvelope, Header


def make_call(
    call_id: str, *, tier: Tier = Tier.STANDARD, deadline_in_s: float = 30
) -> CallEnvelope:
    now_ms = int(time.time() * 1000)
    return CallEnvelope(
        call_id=call_id,
        session_id="s1",
        tier=tier,
        model="kvgate-dev",
        endpoint=Endpoint.CHAT_COMPLETIONS,
        body=json.dumps(
            {"model": "kvgate-dev", "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
        stream=False,
        max_tokens=4,
        deadline_ms=now_ms + int(deadline_in_s * 1000),
        created_ms=now_ms,
    )


async def test_provisioning_is_idempotent_and_matches_the_design(nc: NATS) -> None:
    js = nc.jetstream()
    settings = StreamSettings()
    await provision_calls(js, settings)
    await provision_calls(js, settings)  # a second process starting up
    info = await js.stream_info(STREAM_NAME)
    assert info.config.subjects == ["kvgate.calls.*"]
    assert info.config.retention == js_api.RetentionPolicy.WORK_QUEUE
    assert info.config.discard == js_api.DiscardPolicy.NEW
    assert info.config.allow_msg_ttl is True
    for tier in TIERS_BY_PRIORITY:
        consumer = await js.consumer_info(STREAM_NAME, tier.consumer)
        assert consumer.config.durable_name == f"kvgate-{tier.value}"
        assert consumer.config.filter_subject == f"kvgate.calls.{tier.value}"
        assert consumer.config.ack_policy == js_api.AckPolicy.EXPLICIT
        assert consumer.config.max_deliver == settings.max_deliver


async def test_provisioning_updates_changed_limits(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    await provision_calls(js, StreamSettings(max_msgs=7, max_deliver=5))
    assert (await js.stream_info(STREAM_NAME)).config.max_msgs == 7
    consumer = await js.consumer_info(STREAM_NAME, Tier.GUARANTEED.consumer)
    assert consumer.config.max_deliver == 5


async def test_published_call_carries_the_wire_headers(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings())
    call = make_call("c1", tier=Tier.GUARANTEED)
    await CallPublisher(js).publish(call, "_INBOX.test.c1", now_ms=call.created_ms)
    sub = await js.pull_subscribe_bind(Tier.GUARANTEED.consumer, stream=STREAM_NAME)
    (msg,) = await sub.fetch(1, timeout=2)
    assert msg.headers is not None
    assert msg.headers[Header.CALL] == "c1"
    assert msg.headers[Header.MSG_ID] == "c1"
    assert msg.headers[Header.TIER] == "guaranteed"
    assert msg.headers[Header.REPLY] == "_INBOX.test.c1"
    assert msg.headers[Header.DEADLINE] == str(call.deadline_ms)
    assert msg.headers[Header.TTL] == "30"


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
    for _ in range(60):
        if (await js.stream_info(STREAM_NAME)).state.messages == 0:
            break
        await asyncio.sleep(0.1)
    assert (await js.stream_info(STREAM_NAME)).state.messages == 0


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
    await asyncio.sleep(1.6)
    with pytest.raises(KeyNotFoundError):
        await kv.get("w1")
