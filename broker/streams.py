"""Provision the JetStream layout kvgate needs; safe to run from every process at start-up.

- Stream ``KVGATE_CALLS`` on ``kvgate.calls.<tier>.<model token>``: work-queue retention (a call
  is removed once acked), per-message TTL (the server drops a call whose deadline passed before
  anyone fetched it), discard-new when full (a publisher learns at once that the queue is full
  instead of silently pushing out older calls).
- One durable pull consumer per tier and model, shared by every worker serving that model;
  explicit ack. Workers create their model's consumers; front doors only publish.
- KV bucket ``KVGATE_WORKERS`` for worker heartbeats, with a TTL.
- Stream ``KVGATE_RESULTS`` on ``kvgate.results.<batch id>``: batch call results, work-queue
  retention (removed once the collector has written them to the database and acked), file
  storage, deduplicated by ``Nats-Msg-Id``; kept at most 7 days if never collected.
- Durable pull consumer ``kvgate-collector`` on it, shared by every front door.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from broker.settings import StreamSettings
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import (
    CALL_SUBJECT_PREFIX,
    RESULT_SUBJECT_PREFIX,
    RESULTS_STREAM,
    STREAM_NAME,
    WORKERS_BUCKET,
    call_subject,
    consumer_name,
)

log = logging.getLogger(__name__)


def _work_queue(
    settings: StreamSettings, name: str, description: str, subjects: list[str], **extra: Any
) -> js_api.StreamConfig:
    """Both of kvgate's streams: a message is removed once acked, kept on file, replicated
    and de-duplicated as the settings say."""
    return js_api.StreamConfig(
        name=name,
        description=description,
        subjects=subjects,
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.FILE,
        num_replicas=settings.replicas,
        duplicate_window=settings.duplicate_window_s,
        placement=placement(settings),
        **extra,
    )


def placement(settings: StreamSettings) -> js_api.Placement | None:
    if not settings.placement_tags and settings.placement_cluster is None:
        return None
    tags = settings.placement_tags or None
    return js_api.Placement(cluster=settings.placement_cluster, tags=tags)


def _explicit_ack(
    settings: StreamSettings, durable: str, description: str, **extra: Any
) -> js_api.ConsumerConfig:
    """Both kinds of durable consumer: every message acked by hand, redelivered after the
    settings' ``ack_wait_s`` unless its holder says it is still working on it."""
    return js_api.ConsumerConfig(
        durable_name=durable,
        description=description,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_ack_pending=settings.max_ack_pending,
        # 0: as many as the stream, now and after the stream is scaled (a consumer may not
        # have more, and the server scales one that follows its stream along with it).
        num_replicas=0,
        **extra,
    )


def stream_config(settings: StreamSettings) -> js_api.StreamConfig:
    return _work_queue(
        settings,
        STREAM_NAME,
        "kvgate agent calls, one subject per service tier and model",
        [f"{CALL_SUBJECT_PREFIX}>"],
        discard=js_api.DiscardPolicy.NEW,
        max_msgs=settings.max_msgs,
        max_bytes=settings.max_bytes,
        allow_msg_ttl=True,
    )


def consumer_config(tier: Tier, model: str, settings: StreamSettings) -> js_api.ConsumerConfig:
    return _explicit_ack(
        settings,
        consumer_name(tier, model),
        f"kvgate workers serving {model}, tier {tier.value}",
        filter_subject=call_subject(tier, model),
        max_deliver=settings.max_deliver,
        max_waiting=settings.max_waiting_pulls,
    )


async def _ensure_stream(js: JetStreamContext, config: js_api.StreamConfig) -> None:
    try:
        await js.stream_info(str(config.name))
    except NotFoundError:
        await js.add_stream(config)
        log.info("created stream %s", config.name)
    else:
        await js.update_stream(config)


async def provision_calls(
    js: JetStreamContext, settings: StreamSettings, model: str | None = None
) -> None:
    """Create the stream, and ``model``'s tier consumers when a worker serving it starts, or
    bring existing ones to ``settings``."""
    await _ensure_stream(js, stream_config(settings))
    if model is None:
        return
    for tier in TIERS_BY_PRIORITY:
        config = consumer_config(tier, model, settings)
        # Creating a durable with the same name acts as create-or-update on the server.
        try:
            await js.add_consumer(STREAM_NAME, config)
        except APIError as exc:
            if exc.err_code != _MAX_WAITING_FIXED:
                raise
            kept = (await js.consumer_info(STREAM_NAME, str(config.durable_name))).config
            log.warning(
                "consumer %s keeps max_waiting %s (the server does not change it in place, "
                "asked %d): to apply it, stop this model's workers, delete its tier consumers "
                "and start the workers again (docs/scale.md)",
                config.durable_name,
                kept.max_waiting,
                settings.max_waiting_pulls,
            )
            await js.add_consumer(
                STREAM_NAME, dataclasses.replace(config, max_waiting=kept.max_waiting)
            )


_MAX_WAITING_FIXED = 10012
"""The server's ``err_code`` for "max waiting can not be updated" (nats-server 2.15)."""

COLLECTOR = "kvgate-collector"


def results_config(settings: StreamSettings) -> js_api.StreamConfig:
    return _work_queue(
        settings,
        RESULTS_STREAM,
        "kvgate batch call results, until collected into the database",
        [f"{RESULT_SUBJECT_PREFIX}*"],
        max_age=7 * 24 * 3600.0,
    )


async def provision_results(js: JetStreamContext, settings: StreamSettings) -> None:
    await _ensure_stream(js, results_config(settings))
    await js.add_consumer(
        RESULTS_STREAM,
        _explicit_ack(
            settings, COLLECTOR, "kvgate front doors writing batch results to the database"
        ),
    )


async def workers_bucket(js: JetStreamContext, settings: StreamSettings) -> KeyValue:
    """The heartbeats bucket, created if missing, and brought to the settings' replicas and
    placement (heartbeats are rewritten every few seconds, so nothing is lost when the
    servers move it); its TTL and history stay as whoever created it set them."""
    try:
        bucket = await js.key_value(WORKERS_BUCKET)
    except BucketNotFoundError:
        bucket = await js.create_key_value(
            bucket=WORKERS_BUCKET,
            description="kvgate worker heartbeats",
            history=1,
            ttl=settings.worker_ttl_s,
            storage=js_api.StorageType.MEMORY,
            replicas=settings.replicas,
            # nats.py (2.16) leaves this out of the stream it creates: set below.
            placement=placement(settings),
        )
    stream = f"KV_{WORKERS_BUCKET}"
    config = (await js.stream_info(stream)).config
    wanted = placement(settings)
    if config.num_replicas != settings.replicas or config.placement != wanted:
        await js.update_stream(
            dataclasses.replace(config, num_replicas=settings.replicas, placement=wanted)
        )
        log.info("workers bucket now on %d replicas", settings.replicas)
    return bucket
