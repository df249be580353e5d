"""JetStream consumer lag per tier: is the queue backing up?

Read from the server (consumer info, plus the oldest undelivered call's timestamp), so every
front door and the CLI see the same numbers.
"""

from __future__ import annotations

import time

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from broker.tables import text_table
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import STREAM_NAME


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


async def tier_lag(js: JetStreamContext, tier: Tier, *, now_s: float | None = None) -> TierLag:
    info = await js.consumer_info(STREAM_NAME, tier.consumer)
    pending = int(info.num_pending or 0)
    age: float | None = None
    if pending:
        start = (info.delivered.stream_seq if info.delivered else 0) + 1
        try:
            oldest = await js.get_msg(STREAM_NAME, seq=start, subject=tier.subject, next=True)
        except NotFoundError:
            oldest = None  # delivered or expired since the consumer info was read
        if oldest is not None and oldest.time is not None:
            now = time.time() if now_s is None else now_s
            age = max(0.0, now - oldest.time.timestamp())
    return TierLag(
        tier=tier,
        pending=pending,
        ack_pending=int(info.num_ack_pending or 0),
        redelivered=int(info.num_redelivered or 0),
        waiting_pulls=int(info.num_waiting or 0),
        oldest_pending_age_s=age,
    )


async def fleet_lag(js: JetStreamContext) -> list[TierLag]:
    return [await tier_lag(js, tier) for tier in TIERS_BY_PRIORITY]


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
