"""What admission reads of the fleet, as one ``FleetSnapshot`` per decision.

Two sources, both kept current off the request path, so that a decision never waits on NATS:
the workers' readings (``FleetView``, which a KV watch keeps current) and the queue lag per
tier (``broker.lag.fleet_lag``, read from JetStream every couple of seconds). The front door's
metrics export the same lag from here: admission does not read it from the metrics.

The workers' readings are built once and serve the decisions of the next ``READINGS_REUSE_MS``:
building them costs about 2 µs a worker, and with a thousand workers that was 2 ms on every
decision, more than the rest of the decision (``loadtests/rehearsal.py``; docs/scale.md). A
heartbeat arrives from each worker every couple of seconds, so readings up to 25 ms older change
little; who is in the fleet must be current, so a worker that joins, leaves, drains or changes
model is seen by the next decision. Invariant: a reused reading is never younger than it is.
Its age is taken at the end of its reuse, so a worker counts as stale up to 25 ms early, never
late (unknown is never idle), and admissions too recent for the readings to show are kept
counted as unseen that much longer (counting twice errs safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.js import JetStreamContext

from broker.admission.policy import FleetSnapshot, WorkerReading
from broker.fleet import FleetView
from broker.lag import TierLag, fleet_lag
from schemas.vocab import Tier

log = logging.getLogger(__name__)

LAG_MAX_AGE_S = 10.0
"""How long a lag reading stays usable; older means "lag unknown", not "no lag"."""
READINGS_REUSE_MS = 25
"""How long one build of the workers' readings serves the decisions that follow it."""


class FleetSignals:
    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self.lag: list[TierLag] = []
        """The last lag reading, one row per tier (empty until the first read)."""
        self.lag_read_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._readings: tuple[WorkerReading, ...] = ()
        self._built_ms = 0
        self._members = -1
        """The fleet view's ``members`` when the readings were built."""

    @property
    def max_age_s(self) -> float:
        """How old a worker's reading may be and still count."""
        return self.fleet.max_age_ms / 1000

    def start(self, js: JetStreamContext, interval_s: float = 2.0) -> None:
        self._task = asyncio.create_task(self._refresh_lag(js, interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _refresh_lag(self, js: JetStreamContext, interval_s: float) -> None:
        while True:
            try:
                self.lag = await fleet_lag(js)
                self.lag_read_s = time.time()
            except Exception as exc:  # a stale reading ages out (LAG_MAX_AGE_S); keep trying
                log.warning("could not read consumer lag: %s", exc)
            await asyncio.sleep(interval_s)

    def pending_by_tier(self, now_ms: int) -> dict[Tier, int] | None:
        """Calls queued per tier, or None when the last reading is missing or too old."""
        if not self.lag or now_ms / 1000 - self.lag_read_s > LAG_MAX_AGE_S:
            return None
        return {row.tier: row.pending for row in self.lag}

    def snapshot(self, now_ms: int) -> FleetSnapshot:
        return FleetSnapshot(self.readings(now_ms), self.pending_by_tier(now_ms))

    def readings(self, now_ms: int) -> tuple[WorkerReading, ...]:
        """Every worker's reading for a decision at ``now_ms``: those built within the last
        ``READINGS_REUSE_MS`` while nobody joined, left, drained or changed model; otherwise
        built anew, each aged as of the end of its reuse (see the module docstring)."""
        if (
            self._members == self.fleet.members
            and self._built_ms <= now_ms < self._built_ms + READINGS_REUSE_MS
        ):
            return self._readings
        aged_at_ms = now_ms + READINGS_REUSE_MS
        speed = self.fleet.seq_tokens_per_s
        self._readings = tuple(
            WorkerReading(
                worker_id=hb.worker_id,
                kv_usage=hb.kv_cache_usage,
                kv_capacity_tokens=hb.kv_capacity_tokens,
                running=hb.num_running,
                waiting=hb.num_waiting,
                max_num_seqs=hb.max_num_seqs,
                seq_tokens_per_s=speed(hb.worker_id),
                age_s=max(0.0, (aged_at_ms - hb.sent_ms) / 1000),
                draining=hb.draining,
                committed_tokens=hb.committed_tokens,
                staged=hb.staged,
            )
            for hb in self.fleet.all()
        )
        self._built_ms = now_ms
        self._members = self.fleet.members
        return self._readings
