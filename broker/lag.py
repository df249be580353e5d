"""JetStream consumer lag per tier, over every model's queue: is the queue backing up?

Read from the server (consumer info, plus the oldest undelivered call's timestamp), so every
front door and the CLI see the same numbers.
"""

from __future__ import annotations

import time

import msgspec
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from broker.text_tables import text_table
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import CALL_SUBJECT_PREFIX, STREAM_NAME


class TierLag(msgspec.Struct, frozen=True):
    tier: Tier
    pending: int
    """Calls queued and not yet delivered to any worker."""
    ack_pending: int
    """Calls delivered to a worker and not yet acked (staged or running)."""
    redelivered: int
    waiting_pulls: int
    """Pull requests open at the server (worker credit waiting for calls)."""
    oldest_pending_age_s: float | None
    """Age of the oldest undelivered call; None when nothing is pending."""


async def fleet_lag(js: JetStreamContext, *, now_s: float | None = None) -> list[TierLag]:
    """Lag per tier, summed over every model's queue at that tier.

    A queue is a model's tier subject: its consumer says what is pending, delivered and open;
    calls for a model whose workers never started (no consumer yet) are all pending.
    """
    now = time.time() if now_s is None else now_s
    queues: dict[str, ConsumerInfo | None] = {}
    for consumer in await _call_consumers(js):
        if consumer.config.filter_subject:
            queues[consumer.config.filter_subject] = consumer
    stored = (
        await js.stream_info(STREAM_NAME, subjects_filter=f"{CALL_SUBJECT_PREFIX}>")
    ).state.subjects or {}
    for subject in stored:
        queues.setdefault(subject, None)
    rows = []
    for tier in TIERS_BY_PRIORITY:
        prefix = f"{CALL_SUBJECT_PREFIX}{tier.value}."
        pending = ack_pending = redelivered = waiting = 0
        oldest_s: float | None = None
        for subject, info in queues.items():
            if not subject.startswith(prefix):
                continue
            if info is None:
                queued, start = stored.get(subject, 0), 1
            else:
                queued = int(info.num_pending or 0)
                start = (info.delivered.stream_seq if info.delivered else 0) + 1
                ack_pending += int(info.num_ack_pending or 0)
                redelivered += int(info.num_redelivered or 0)
                waiting += int(info.num_waiting or 0)
            pending += queued
            if queued:
                stamp = await _first_stamp(js, subject, start)
                if stamp is not None and (oldest_s is None or stamp < oldest_s):
                    oldest_s = stamp
        rows.append(
            TierLag(
                tier=tier,
                pending=pending,
                ack_pending=ack_pending,
                redelivered=redelivered,
                waiting_pulls=waiting,
                oldest_pending_age_s=None if oldest_s is None else max(0.0, now - oldest_s),
            )
        )
    return rows


_CONSUMER_PAGE = 256  # the server's page size for a consumer list


async def _call_consumers(js: JetStreamContext) -> list[ConsumerInfo]:
    infos: list[ConsumerInfo] = []
    while True:
        page = await js.consumers_info(STREAM_NAME, offset=len(infos))
        infos.extend(page)
        if len(page) < _CONSUMER_PAGE:
            return infos


async def _first_stamp(js: JetStreamContext, subject: str, start: int) -> float | None:
    """When the first call on ``subject`` from stream sequence ``start`` was queued."""
    try:
        msg = await js.get_msg(STREAM_NAME, seq=start, subject=subject, next=True)
    except NotFoundError:
        return None  # delivered or expired since the consumer info was read
    return None if msg.time is None else msg.time.timestamp()


def lag_table(rows: list[TierLag]) -> str:
    header = ("TIER", "PENDING", "ACK_PENDING", "REDELIVERED", "WAITING_PULLS", "OLDEST")
    return text_table(
        header,
        [
            (
                row.tier.value,
                str(row.pending),
                str(row.ack_pending),
                str(row.redelivered),
                str(row.waiting_pulls),
                "-" if row.oldest_pending_age_s is None else f"{row.oldest_pending_age_s:.1f}s",
            )
            for row in rows
        ],
    )
