"""The dashboard's history: every few seconds, a snapshot of what the front door already keeps
current, in a ring that holds the last hour.

Why a sampler and a ring rather than a query per page view: the page must never make the front
door wait on NATS, and an hour of history cannot be read back from anywhere else (Prometheus may
not be running). Everything sampled is read from objects kept current off the request path:
``FleetSignals`` (queue lag, refreshed in the background; the workers' heartbeats, from a KV
watch), the ``Admitter`` (pressure, its learned windows) and the front door's Prometheus
metrics (admission decisions, TTFT and TPOT histograms). Taking a sample awaits nothing.

Call latencies are read from the histograms ``api/calls.py`` already observes: a percentile is
interpolated within the buckets of the last ``LATENCY_WINDOW_S``, as Prometheus'
``histogram_quantile`` does. It is only as fine as the buckets, and it costs the call path
nothing. The metrics are read through ``collect()``, never ``labels()``, which would create a
series for every tier in ``/metrics`` as a side effect.

Invariant: an unknown reading stays unknown. A lag reading older than ``LAG_MAX_AGE_S`` is
sampled as ``None`` (drawn as a gap), a stale worker is marked stale, not shown as idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping

import msgspec
from prometheus_client import Counter, Histogram

from api.metrics import FrontDoorMetrics
from broker.admission.admitter import Admitter
from broker.admission.signals import LAG_MAX_AGE_S, FleetSignals
from broker.lag import TierLag
from schemas.vocab import TIERS_BY_PRIORITY, Decision, Reason, Tier
from schemas.wire import WorkerHeartbeat

log = logging.getLogger(__name__)

HISTORY_S = 3600.0
"""How far back the ring reaches."""
LATENCY_WINDOW_S = 60.0
"""The trailing window the latency percentiles are taken over."""

Buckets = list[tuple[float, float]]
"""A histogram's cumulative counts, ``(upper bound, calls at or below it)``, bound ascending,
the last one ``inf``."""


class WorkerState(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    """Finishing what it holds, taking no new calls."""
    STALE = "stale"
    """Its last heartbeat is older than ``heartbeat_max_age_s``: unknown, not idle."""


class WorkerRow(msgspec.Struct, frozen=True):
    worker_id: str
    model: str
    state: WorkerState
    kv_cache_usage: float | None
    num_running: int
    max_num_seqs: int
    num_waiting: int
    staged: int
    num_preemptions: int
    draining: bool
    heartbeat_age_s: float


class DecisionRate(msgspec.Struct, frozen=True):
    decision: Decision
    reason: Reason
    per_s: float
    """Decisions per second since the previous sample, over every tier."""


class TierLatency(msgspec.Struct, frozen=True):
    """A tier's calls over the last ``LATENCY_WINDOW_S``; a percentile is None with no call."""

    tier: Tier
    ttft_calls: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_calls: int
    tpot_p50_s: float | None
    tpot_p99_s: float | None


class Sample(msgspec.Struct, frozen=True):
    seq: int
    """Grows by one per sample; a page asks for the samples after the last one it has."""
    t: float
    """Unix seconds."""
    lag: list[TierLag] | None
    """The rows ``/v1/admin/lag`` serves, as last read; None when that reading is too old."""
    lag_age_s: float | None
    pressure: str
    """``normal``, ``elevated`` or ``saturated`` (``broker.admission.policy.Pressure``)."""
    overcommit: float
    """The fleet's learned KV over-commit factor (the highest tier group's)."""
    windows: dict[Tier, float]
    sessions: dict[Tier, dict[str, int]]
    """Live sessions per tier and tenant, fleet-wide, as admission last read them."""
    decisions: list[DecisionRate]
    latency: list[TierLatency]
    worker_kv: dict[str, float | None]
    """Each worker's KV cache usage, for its history; the full rows are kept for the latest
    sample only (``DashboardSampler.workers``)."""


# -- pure: readings into sample fields ---------------------------------------------------------


def quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile of a histogram's cumulative ``buckets``, interpolated linearly within
    the bucket it falls in (the first bucket starts at 0); in the ``inf`` bucket, the highest
    finite bound. None for an empty histogram."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return bound if inside <= 0 else lower + (bound - lower) * (rank - below) / inside
        lower, below = bound, count
    return lower


def bucket_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """The observations between two readings of one histogram series."""
    if before is None or len(before) != len(now):
        return now
    return [(bound, count - then) for (bound, count), (_, then) in zip(now, before, strict=True)]


def decision_rates(
    now: dict[tuple[Decision, Reason], float],
    before: dict[tuple[Decision, Reason], float],
    elapsed_s: float,
) -> list[DecisionRate]:
    """Rates of every (decision, reason) seen so far, zero ones included so a series that
    stops is drawn falling to zero rather than ending."""
    if elapsed_s <= 0:
        return []
    return [
        DecisionRate(
            decision, reason, max(0.0, total - before.get((decision, reason), 0.0)) / elapsed_s
        )
        for (decision, reason), total in sorted(now.items())
    ]


def worker_rows(
    heartbeats: Iterable[WorkerHeartbeat], now_ms: int, max_age_ms: int
) -> list[WorkerRow]:
    rows = []
    for hb in sorted(heartbeats, key=lambda h: h.worker_id):
        age_ms = max(0, now_ms - hb.sent_ms)
        if age_ms > max_age_ms:
            state = WorkerState.STALE
        else:
            state = WorkerState.DRAINING if hb.draining else WorkerState.SERVING
        rows.append(
            WorkerRow(
                worker_id=hb.worker_id,
                model=hb.model,
                state=state,
                kv_cache_usage=hb.kv_cache_usage,
                num_running=hb.num_running,
                max_num_seqs=hb.max_num_seqs,
                num_waiting=hb.num_waiting,
                staged=hb.staged,
                num_preemptions=hb.num_preemptions,
                draining=hb.draining,
                heartbeat_age_s=age_ms / 1000,
            )
        )
    return rows


# -- reading the front door's Prometheus metrics (read-only) -----------------------------------


def sessions_by_tier(active: Mapping[tuple[Tier, str], int]) -> dict[Tier, dict[str, int]]:
    found: dict[Tier, dict[str, int]] = {tier: {} for tier in TIERS_BY_PRIORITY}
    for (tier, tenant), count in active.items():
        found[tier][tenant] = count
    return found


def decision_totals(counter: Counter) -> dict[tuple[Decision, Reason], float]:
    """Admission's decisions so far by (decision, reason), summed over tiers."""
    totals: dict[tuple[Decision, Reason], float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = (Decision(s.labels["decision"]), Reason(s.labels["reason"]))
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def histogram_buckets(histogram: Histogram) -> dict[Tier, Buckets]:
    """Each tier's cumulative bucket counts, for the tiers with a series (one observation)."""
    found: dict[Tier, Buckets] = {}
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                found.setdefault(Tier(s.labels["tier"]), []).append(
                    (float(s.labels["le"]), s.value)
                )
    return {tier: sorted(buckets) for tier, buckets in found.items()}


class _Reading(msgspec.Struct, frozen=True):
    t: float
    ttft: dict[Tier, Buckets]
    tpot: dict[Tier, Buckets]


def tier_latencies(now: _Reading, before: _Reading | None) -> list[TierLatency]:
    rows = []
    for tier in TIERS_BY_PRIORITY:
        ttft = bucket_delta(now.ttft.get(tier, []), before.ttft.get(tier) if before else None)
        tpot = bucket_delta(now.tpot.get(tier, []), before.tpot.get(tier) if before else None)
        rows.append(
            TierLatency(
                tier=tier,
                ttft_calls=int(ttft[-1][1]) if ttft else 0,
                ttft_p50_s=quantile(ttft, 0.5),
                ttft_p99_s=quantile(ttft, 0.99),
                tpot_calls=int(tpot[-1][1]) if tpot else 0,
                tpot_p50_s=quantile(tpot, 0.5),
                tpot_p99_s=quantile(tpot, 0.99),
            )
        )
    return rows


class History:
    """The ring of samples: the last ``span_s`` of them, at one per ``interval_s``."""

    def __init__(self, span_s: float, interval_s: float) -> None:
        self.samples: deque[Sample] = deque(maxlen=max(1, math.ceil(span_s / interval_s)))

    def append(self, sample: Sample) -> None:
        """Keep ``sample``; its ``seq`` must be one more than the last one's."""
        self.samples.append(sample)

    def after(self, seq: int) -> list[Sample]:
        """The samples newer than ``seq``, oldest first (every one kept, for ``seq`` < 0 or
        one that fell out of the ring)."""
        ring = self.samples
        if not ring or seq >= ring[-1].seq:
            return []
        start = max(0, len(ring) - (ring[-1].seq - seq))
        return [ring[i] for i in range(start, len(ring))]


# -- the sampler: a thin task around the above -------------------------------------------------


class DashboardSampler:
    """Takes a ``Sample`` every ``interval_s`` into a ``History`` of ``HISTORY_S``; the
    dashboard's routes read ``history`` and ``workers`` and never wait on anything."""

    def __init__(
        self,
        signals: FleetSignals,
        admitter: Admitter,
        metrics: FrontDoorMetrics,
        *,
        interval_s: float,
    ) -> None:
        self.signals = signals
        self.admitter = admitter
        self.metrics = metrics
        self.interval_s = interval_s
        self.epoch = time.time()
        """When this ring began: a page that saw another epoch starts its history again."""
        self.history = History(HISTORY_S, interval_s)
        self.workers: list[WorkerRow] = []
        self._seq = 0
        self._readings: deque[_Reading] = deque()
        self._decisions = decision_totals(metrics.admission.decisions)
        self._decisions_t = self.epoch
        self._task: asyncio.Task[None] | None = None

    @property
    def objectives(self) -> dict[Tier, dict[str, float]]:
        """Each tier's objectives in seconds (a tenant's own objectives aside)."""
        return {
            tier: {"ttft_s": policy.ttft_ms / 1000, "tpot_s": policy.tpot_ms / 1000}
            for tier, policy in self.admitter.tenancy.tiers.items()
        }

    def sample(self, now_s: float | None = None) -> Sample:
        """Take one sample now and keep it."""
        now = time.time() if now_s is None else now_s
        now_ms = int(now * 1000)
        signals = self.signals
        lag_age = now - signals.lag_read_s if signals.lag else None
        fresh = lag_age is not None and lag_age <= LAG_MAX_AGE_S
        decisions = decision_totals(self.metrics.admission.decisions)
        rates = decision_rates(decisions, self._decisions, now - self._decisions_t)
        self._decisions, self._decisions_t = decisions, now
        reading = _Reading(
            now,
            histogram_buckets(self.metrics.ttft),
            histogram_buckets(self.metrics.tpot),
        )
        self._readings.append(reading)
        while len(self._readings) > 1 and self._readings[1].t <= now - LATENCY_WINDOW_S:
            self._readings.popleft()
        oldest = self._readings[0]
        self.workers = worker_rows(signals.fleet.recent(now_ms), now_ms, signals.fleet.max_age_ms)
        self._seq += 1
        sample = Sample(
            seq=self._seq,
            t=now,
            lag=list(signals.lag) if fresh else None,
            lag_age_s=lag_age,
            pressure=self.admitter.pressure.state.name.lower(),
            overcommit=self.admitter.windows.group_factors()[0],
            windows=dict(self.admitter.windows.windows),
            sessions=sessions_by_tier(self.admitter.active_sessions),
            decisions=rates,
            latency=tier_latencies(reading, oldest if oldest is not reading else None),
            worker_kv={row.worker_id: row.kv_cache_usage for row in self.workers},
        )
        self.history.append(sample)
        return sample

    def start(self) -> None:
        try:
            self.sample()
        except Exception:  # the front door starts without its first sample, not at all
            log.exception("the dashboard's first sample failed; sampling goes on")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        failing: str | None = None
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sample()
                failing = None
            except Exception as exc:  # one bad reading must not end the history
                if repr(exc) != failing:
                    log.exception("the dashboard's sample failed; sampling goes on")
                failing = repr(exc)
