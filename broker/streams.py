"""Provision the JetStream layout kvgate needs; safe to run from every process at start-up.

- Stream ``KVGATE_CALLS`` on ``kvgate.calls.<tier>``: work-queue retention (a call is removed
  once acked), per-message TTL (the server drops a call whose deadline passed before anyone
  fetched it), discard-new when full (a publisher learns at once that the queue is full instead
  of silently pushing out older calls).
- One durable pull consumer per tier, shared by every worker; explicit ack.
- KV bucket ``KVGATE_WORKERS`` for worker heartbeats, with a TTL.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from broker.settings import StreamSettings
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import CALL_SUBJECT_PREFIX, STREAM_NAME, WORKERS_BUCKET

log = logging.getLogger(__name__)


def stream_config(settings: StreamSettings) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=STREAM_NAME,
        description="kvgate agent calls, one subject per service tier",
        subjects=[f"{CALL_SUBJECT_PREFIX}*"],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        discard=js_api.DiscardPolicy.NEW,
        storage=js_api.StorageType.FILE,
        max_msgs=settings.max_msgs,
        max_bytes=settings.max_bytes,
        num_replicas=settings.replicas,
        allow_msg_ttl=True,
        duplicate_window=settings.duplicate_window_s,
    )


def consumer_config(tier: Tier, settings: StreamSettings) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(
        durable_name=tier.consumer,
        description=f"kvgate workers, tier {tier.value}",
        filter_subject=tier.subject,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
        num_replicas=settings.replicas,
    )


async def provision_calls(js: JetStreamContext, settings: StreamSettings) -> None:
    """Create the stream and tier consumers, or bring existing ones to ``settings``."""
    config = stream_config(settings)
    try:
        await js.stream_info(STREAM_NAME)
    except NotFoundError:
        await js.add_stream(config)
        log.info("created stream %s", STREAM_NAME)
    else:
        await js.update_stream(config)
    for tier in TIERS_BY_PRIORITY:
        # Creating a durable with the same name acts as create-or-update on the server.
        await js.add_consumer(STREAM_NAME, consumer_config(tier, settings))


async def workers_bucket(js: JetStreamContext, settings: StreamSettings) -> KeyValue:
    try:
        return await js.key_value(WORKERS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            bucket=WORKERS_BUCKET,
            description="kvgate worker heartbeats",
            history=1,
            ttl=settings.worker_ttl_s,
            storage=js_api.StorageType.MEMORY,
            replicas=settings.replicas,
        )
