"""Admission state in Redis, shared by every front-door replica.

Every operation is one call of one Lua script (``store.lua``, beside this module), so it is
atomic: it first sweeps expired leases (any replica's traffic releases a dead replica's
sessions), then reads or changes the state. The script is given the tiers with every call, so
the vocabulary lives only in ``schemas.vocab``. Keys, all under one hash-tagged prefix
(``{kvgate}`` by default) so that they share a cluster slot:

- ``P:s:<id>``          session hash; TTL = until its deadline plus the retention time
- ``P:leases``          hash id -> "tier tenant tokens parallel" for every live reservation
- ``P:expiry``          sorted set id -> lease expiry (ms); what the sweep reads
- ``P:totals``          hash: ``tier:<tier>`` tokens, ``sessions:<tenant>``, ``parallel:<tenant>``,
                        ``tokens:<tenant>`` (reserved), ``active:<tier>:<tenant>`` sessions
- ``P:slots:<id>``      sorted set call id -> call deadline (the session's calls in flight)
- ``P:weights:<id>``    hash call id -> its charge's tokens, for the same calls
- ``P:released:<b>``    tokens released in 10 s bucket ``b`` (TTL 80 s)
- ``P:tpm:<tenant>:<m>`` tokens charged in minute ``m`` (TTL 2 min)
- ``P:idem:<tenant>:<key>`` session id of an idempotent create (TTL 24 h)

One pub/sub channel, ``P:freed``, carries ``call|session <origin> <id>`` when a call slot or a
whole session of a contended session (one whose calls were ever told ``busy``: the ``contended``
field of its hash) is freed, so that the calls other front doors hold waiting for a slot wake
at once instead of polling (``follow_releases``); and when a session is closed by another front
door than the one that admitted it (the ``origin`` field of its hash), which follows its open
sessions to learn how slow they are (``broker.admission.objectives.SessionPace``).

A lease lives in ``P:leases``/``P:expiry`` (no TTL: they are removed exactly when the lease
ends, so totals never drift), while everything else carries a TTL, so nothing outlives its use.

Three things keep the replicas' shared state true when the world is not:
- **One clock: Redis's.** Every time this store sends (``now``, deadlines, expiries) is moved
  onto the Redis server's clock (``TIME``, measured every ``CLOCK_REFRESH_S``), and every time
  it reads back is moved onto this replica's. A replica whose clock runs minutes fast then
  neither expires everyone's leases nor keeps its own alive too long.
- **``noeviction`` is required** (``require_noeviction``, at start-up): a lease key evicted
  under memory pressure would leak its tokens or negate a total.
- **Totals are healed from the leases** (``heal``, once a minute): the totals are recomputed
  from ``P:leases``, a lease whose expiry entry is lost gets one back, an expiry entry whose
  lease is lost is dropped. Nothing drifts for longer than a heal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from broker.admission.policy import Holdings
from broker.admission.state import (
    DEFAULT_RETENTION_MS,
    RELEASE_BUCKET_MS,
    RELEASE_WINDOW_BUCKETS,
    CallCharge,
    ReleaseListener,
    ReserveOutcome,
    ReserveRequest,
    SessionRecord,
    SlotStatus,
    minute_window,
)
from broker.errors import AdmissionUnavailable
from broker.settings import redacted_url
from schemas.vocab import TIERS_BY_PRIORITY, Reason, SessionState, Tier

log = logging.getLogger(__name__)

IDEMPOTENCY_TTL_MS = 24 * 3_600_000
FEED_HEALTH_S = 5.0
"""How long the release feed waits on a quiet channel before it pings Redis (redis-py's health
check). A connection Redis closed is seen at once; the waiting calls poll regardless."""
CLOCK_REFRESH_S = 30.0
"""How often the offset between this replica's clock and Redis's is measured again: clocks
drift by milliseconds a minute, a step (an NTP correction) is caught within this."""
FEED_BACKOFF_S = (0.5, 10.0)
"""The release feed's first and longest wait before it connects again after losing Redis."""

_SCRIPT = (resources.files("broker.admission") / "store.lua").read_text(encoding="utf-8")
_TIERS = " ".join(tier.value for tier in TIERS_BY_PRIORITY)
"""The tiers the script reads, highest priority first: the vocabulary is declared once, in
``schemas.vocab``, and the script takes it as an argument."""

_INT_FIELDS = (
    "max_parallel",
    "expected_calls",
    "est_prompt_tokens",
    "est_output_tokens",
    "reserved_tokens",
    "created_ms",
    "deadline_ms",
    "idle_timeout_ms",
    "expires_ms",
    "calls_started",
    "tokens_used",
)


class RedisAdmissionState:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "{kvgate}",
        retention_ms: int = DEFAULT_RETENTION_MS,
        timeout_s: float = 0.5,
        max_connections: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``timeout_s`` bounds every wait on Redis: a connection from the pool, connecting,
        a reply. At most ``max_connections`` are open; a call beyond them waits for one.

        redis-py's default pool fails a call at once ("Too many connections") when more than
        its 100 connections are in use: a burst of concurrent decisions on one front door then
        read as Redis being unreachable (seen: a 300-request burst on three replicas admitted
        in degraded mode). The blocking pool queues them instead, bounded by ``timeout_s``.

        ``clock`` is the clock the callers' times come from (a test gives a replica a wrong
        one); every time is moved between it and Redis's clock here (the module's docstring).
        """
        self.prefix = prefix
        self.retention_ms = retention_ms
        self.origin = uuid.uuid4().hex[:12]
        """Names this store's releases on the feed, which it does not announce to itself."""
        self._url = url
        self._timeout_s = timeout_s
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            retry_on_timeout=False,
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._script = self._redis.register_script(_SCRIPT)
        self._clock = clock
        self._offset_ms = 0
        self._offset_at = float("-inf")

    async def _call(self, op: str, now_ms: int, *args: str | int) -> Any:
        """Run ``op``; ``now_ms`` and every time in ``args`` on Redis's clock already."""
        try:
            return await self._script(
                keys=[self.prefix], args=[op, now_ms, self.retention_ms, _TIERS, *args]
            )
        except (RedisError, OSError) as exc:
            raise AdmissionUnavailable(f"admission state (Redis) unavailable: {exc}") from exc

    async def _offset(self) -> int:
        """Redis's clock minus the callers' (ms), measured again every ``CLOCK_REFRESH_S``
        (half the round trip is the error: well under a millisecond on a LAN)."""
        if self._clock() - self._offset_at >= CLOCK_REFRESH_S:
            try:
                before = self._clock()
                seconds, micros = await self._redis.time()
                after = self._clock()
            except (RedisError, OSError) as exc:
                raise AdmissionUnavailable(f"admission state (Redis) unavailable: {exc}") from exc
            self._offset_ms = round(seconds * 1000 + micros / 1000 - (before + after) * 500)
            self._offset_at = after
        return self._offset_ms

    async def require_noeviction(self) -> None:
        """Raise ``ValueError`` unless Redis's ``maxmemory-policy`` is ``noeviction``: an
        evicted lease would leak its tokens or negate a total. Read from ``INFO memory``, which
        managed services that disable ``CONFIG`` still answer."""
        try:
            policy = (await self._redis.info("memory")).get("maxmemory_policy", "noeviction")
        except (RedisError, OSError) as exc:
            raise AdmissionUnavailable(f"admission state (Redis) unavailable: {exc}") from exc
        if policy != "noeviction":
            raise ValueError(
                f"Redis at {redacted_url(self._url)} evicts keys (maxmemory-policy {policy}):"
                " admission's leases would be lost under memory pressure; set"
                " maxmemory-policy noeviction"
            )

    async def heal(self, now_ms: int) -> int:
        """Recompute the totals from the leases and mend the expiry index (the module's
        docstring); returns how many entries were wrong."""
        return int(await self._call("heal", now_ms + await self._offset()))

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def holdings(self, tenant: str, now_ms: int) -> Holdings:
        now_ms += await self._offset()
        window, left_s = minute_window(now_ms)
        out = await self._call("holdings", now_ms, tenant, window, RELEASE_WINDOW_BUCKETS)
        window_s = RELEASE_BUCKET_MS * RELEASE_WINDOW_BUCKETS / 1000
        n = len(TIERS_BY_PRIORITY)
        return Holdings(
            reserved_by_tier={t: int(out[i]) for i, t in enumerate(TIERS_BY_PRIORITY)},
            tenant_sessions=int(out[n]),
            tenant_parallel=int(out[n + 1]),
            tenant_tokens_this_minute=int(out[n + 2]),
            released_tokens_per_s=int(out[n + 3]) / window_s,
            seconds_to_next_minute=left_s,
        )

    async def reserve(self, request: ReserveRequest, now_ms: int) -> ReserveOutcome:
        record = request.record
        limits = request.tenant_limits
        offset = await self._offset()
        window, _ = minute_window(now_ms + offset)
        out = await self._call(
            "reserve",
            now_ms + offset,
            record.id,
            record.tenant,
            TIERS_BY_PRIORITY.index(record.tier) + 1,
            record.reserved_tokens,
            record.max_parallel,
            record.expires_ms + offset,
            record.deadline_ms + offset,
            limits.max_sessions,
            limits.max_parallel_calls,
            limits.tokens_per_minute,
            request.tokens_charged,
            window,
            request.idempotency_key or "",
            IDEMPOTENCY_TTL_MS,
            json.dumps({**_to_fields(record, offset), "origin": self.origin}),
            -1 if limits.max_reserved_tokens is None else limits.max_reserved_tokens,
            *request.tier_limits,
        )
        status, value = out[0], out[1]
        if status == "admitted":
            return ReserveOutcome(Reason.ADMITTED, record)
        if status == "existing":
            existing = await self.get(value, now_ms)
            if existing is not None:
                return ReserveOutcome(Reason.ADMITTED, existing, existing=True)
            return ReserveOutcome(Reason.FLEET_SATURATED)
        return ReserveOutcome(Reason(status), shortfall_tokens=int(value))

    async def get(self, session_id: str, now_ms: int) -> SessionRecord | None:
        offset = await self._offset()
        return _from_fields(await self._call("get", now_ms + offset, session_id), offset)

    async def release(
        self, session_id: str, state: SessionState, now_ms: int
    ) -> SessionRecord | None:
        offset = await self._offset()
        out = await self._call("release", now_ms + offset, session_id, state.value, self.origin)
        return _from_fields(out, offset)

    async def acquire_call(
        self,
        session_id: str,
        call_id: str,
        call_deadline_ms: int,
        now_ms: int,
        charge: CallCharge,
    ) -> tuple[SlotStatus, SessionRecord | None]:
        offset = await self._offset()
        window, _ = minute_window(now_ms + offset)
        out = await self._call(
            "acquire",
            now_ms + offset,
            session_id,
            call_id,
            call_deadline_ms + offset,
            charge.tokens,
            charge.in_flight_limit,
            charge.tokens_per_minute,
            window,
        )
        return SlotStatus(out[0]), _from_fields(out[1:], offset)

    async def release_call(self, session_id: str, call_id: str, now_ms: int) -> None:
        now_ms += await self._offset()
        await self._call("release_call", now_ms, session_id, call_id, self.origin)

    async def touch(self, session_id: str, now_ms: int) -> None:
        await self._call("touch", now_ms + await self._offset(), session_id)

    async def sweep(self, now_ms: int) -> int:
        return int(await self._call("sweep", now_ms + await self._offset()))

    async def reserved_tokens(self) -> int:
        return int(await self._call("reserved", 0))

    async def active_sessions(self) -> dict[tuple[Tier, str], int]:
        out = await self._call("active", 0)
        return {(Tier(out[i]), str(out[i + 1])): int(out[i + 2]) for i in range(0, len(out), 3)}

    async def follow_releases(self, listener: ReleaseListener) -> None:
        """Tell ``listener`` of every call slot and session freed by another store on this
        prefix (another front door), until cancelled. Losing Redis never ends it: it connects
        again, backing off, and then tells ``listener`` that releases may have been missed.

        Its connection is its own, outside the pool: a subscribed connection cannot run
        scripts, and it waits for messages with no ``timeout_s``."""
        channel = f"{self.prefix}:freed"
        backoff_s = FEED_BACKOFF_S[0]
        lost = False
        while True:
            client = aioredis.Redis.from_url(
                self._url,
                socket_connect_timeout=self._timeout_s,
                socket_keepalive=True,
                health_check_interval=FEED_HEALTH_S,
                decode_responses=True,
                # redis-py would reconnect and subscribe again by itself, silently: what was
                # freed meanwhile would go unheard, and nobody told.
                retry=Retry(NoBackoff(), 0),
            )
            feed = client.pubsub(ignore_subscribe_messages=True)
            try:
                await feed.subscribe(channel)
                if lost:
                    log.info("release feed on Redis subscribed again")
                lost, backoff_s = False, FEED_BACKOFF_S[0]
                # Whatever was freed before this subscription was not heard.
                listener.releases_missed()
                while True:
                    message = await feed.get_message(timeout=FEED_HEALTH_S)
                    if message is not None:
                        self._announce(listener, message["data"])
            except (RedisError, OSError) as exc:
                if not lost:  # once per outage
                    log.warning(
                        "release feed cannot reach Redis (%s); calls waiting for a slot poll "
                        "until it can",
                        exc,
                    )
                lost = True
            finally:
                # Closing a broken connection may fail too: nothing is left to close then.
                with contextlib.suppress(RedisError, OSError):
                    await feed.aclose()
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
            await asyncio.sleep(backoff_s * random.uniform(0.5, 1.0))
            backoff_s = min(backoff_s * 2, FEED_BACKOFF_S[1])

    def _announce(self, listener: ReleaseListener, data: str) -> None:
        kind, origin, session_id = data.split(" ", 2)
        if origin == self.origin:  # this front door woke its own waiters already
            return
        if kind == "session":
            listener.session_ended(session_id)
        else:
            listener.call_ended(session_id)

    async def delete_all(self) -> None:
        """Remove every key under the prefix (tests and ``kvgate`` resets)."""
        async for key in self._redis.scan_iter(match=f"{self.prefix}*", count=500):
            await self._redis.delete(key)

    async def close(self) -> None:
        await self._redis.aclose()


_TIME_FIELDS = frozenset({"created_ms", "deadline_ms", "expires_ms"})
"""The record's times: on Redis's clock in Redis, on the callers' outside it."""


def _to_fields(record: SessionRecord, offset_ms: int) -> dict[str, str]:
    # Strings only: Lua numbers are doubles and would print large integers in exponent form.
    fields = {
        name: str(getattr(record, name) + (offset_ms if name in _TIME_FIELDS else 0))
        for name in _INT_FIELDS
    }
    fields.update(
        id=record.id,
        tenant=record.tenant,
        tier=record.tier.value,
        state=record.state.value,
        metadata=json.dumps(record.metadata),
    )
    return fields


def _from_fields(flat: list[str], offset_ms: int) -> SessionRecord | None:
    if not flat:
        return None
    raw = dict(zip(flat[::2], flat[1::2], strict=True))
    for name in _TIME_FIELDS & raw.keys():
        raw[name] = str(int(raw[name]) - offset_ms)
    ended = raw.get("ended_ms")
    return SessionRecord(
        id=raw["id"],
        tenant=raw["tenant"],
        tier=Tier(raw["tier"]),
        state=SessionState(raw["state"]),
        ended_ms=None if ended is None else int(ended) - offset_ms,
        metadata=json.loads(raw.get("metadata", "{}")),
        # A record written before a field existed reads it as 0 (``tokens_used``).
        **{name: int(raw.get(name, 0)) for name in _INT_FIELDS},
    )
