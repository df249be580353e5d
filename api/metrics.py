"""Prometheus metrics of one front door, in a registry of its own (one per app instance).

Call metrics are observed where a call's events are followed (``api.calls``), admission's where
it decides (``broker.admission.metrics``); queue lag and worker readings are read at scrape time
from what admission's ``FleetSignals`` keeps current in the background, so a scrape never waits
on NATS.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from api.replies import ReplyRouter
from broker.admission.metrics import AdmissionMetrics
from broker.admission.signals import FleetSignals
from broker.admission.tenants import TierPolicy
from broker.ledger import Ledger
from schemas.vocab import Tier

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
_WORKER_OUTCOMES = (
    "completed",
    "failed",
    "deadline_dropped",
    "cancelled",
    "handed_back",
    "faulted",
)
"""How a worker's calls ended: ``WorkerHeartbeat`` fields, each its own ``outcome`` label."""


class _FleetCollector(Collector):
    def __init__(self, signals: FleetSignals) -> None:
        self._signals = signals

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now_ms = int(time.time() * 1000)
        live = self._signals.fleet.live(now_ms)
        workers = GaugeMetricFamily("kvgate_workers_live", "Workers with a fresh heartbeat")
        workers.add_metric([], len(live))
        yield workers
        usage = GaugeMetricFamily(
            "kvgate_worker_kv_cache_usage", "Engine KV cache usage (0-1)", labels=["worker"]
        )
        running = GaugeMetricFamily(
            "kvgate_worker_running", "Requests the engine is running", labels=["worker"]
        )
        waiting = GaugeMetricFamily(
            "kvgate_worker_waiting", "Requests waiting in the engine", labels=["worker"]
        )
        max_seqs = GaugeMetricFamily(
            "kvgate_worker_max_sequences", "Sequences the engine may run at once", labels=["worker"]
        )
        staged = GaugeMetricFamily(
            "kvgate_worker_staged",
            "Calls the worker fetched and holds until its KV cache has room",
            labels=["worker"],
        )
        draining = GaugeMetricFamily(
            "kvgate_worker_draining",
            "1 while the worker drains (takes no new calls)",
            labels=["worker"],
        )
        # The engine's own count since the worker started: a restart resets it, which rate()
        # and increase() take as a counter reset.
        preemptions = CounterMetricFamily(
            "kvgate_worker_preemptions",
            "Sequences the engine preempted (KV cache full), since the worker started",
            labels=["worker"],
        )
        # The worker's own counts of how its calls ended, since it started (as preemptions).
        calls = CounterMetricFamily(
            "kvgate_worker_calls",
            "Calls the worker ended, by how, since the worker started",
            labels=["worker", "outcome"],
        )
        rescued = CounterMetricFamily(
            "kvgate_worker_rescued",
            "Calls started by the rescue rule (due by their first-token objective), since the"
            " worker started",
            labels=["worker"],
        )
        generated = CounterMetricFamily(
            "kvgate_worker_generated_tokens",
            "Output tokens the engine generated for the worker's calls, since the worker started",
            labels=["worker"],
        )
        for hb in live:
            for outcome in _WORKER_OUTCOMES:
                calls.add_metric([hb.worker_id, outcome], getattr(hb, outcome))
            rescued.add_metric([hb.worker_id], hb.rescued)
            generated.add_metric([hb.worker_id], hb.generated_tokens)
            if hb.kv_cache_usage is not None:
                usage.add_metric([hb.worker_id], hb.kv_cache_usage)
            running.add_metric([hb.worker_id], hb.num_running)
            waiting.add_metric([hb.worker_id], hb.num_waiting)
            max_seqs.add_metric([hb.worker_id], hb.max_num_seqs)
            staged.add_metric([hb.worker_id], hb.staged)
            draining.add_metric([hb.worker_id], int(hb.draining))
            preemptions.add_metric([hb.worker_id], hb.num_preemptions)
        yield from (usage, running, waiting, max_seqs, staged, draining, preemptions)
        yield from (calls, rescued, generated)
        # Every worker heard from in the last ten minutes, stale ones included: a worker that
        # stopped heartbeating shows here as an age that grows (where the gauges above simply
        # lose it), until it is forgotten.
        age = GaugeMetricFamily(
            "kvgate_worker_heartbeat_age_seconds",
            "Seconds since the worker's last heartbeat",
            labels=["worker"],
        )
        for hb in self._signals.fleet.recent(now_ms):
            age.add_metric([hb.worker_id], max(0.0, now_ms - hb.sent_ms) / 1000)
        yield age
        pending = GaugeMetricFamily(
            "kvgate_queue_pending", "Calls queued, not yet delivered", labels=["tier"]
        )
        ack_pending = GaugeMetricFamily(
            "kvgate_queue_ack_pending", "Calls delivered, not yet acked", labels=["tier"]
        )
        oldest = GaugeMetricFamily(
            "kvgate_queue_oldest_pending_age_seconds",
            "Age of the oldest undelivered call (0 when none)",
            labels=["tier"],
        )
        redelivered = GaugeMetricFamily(
            "kvgate_queue_redelivered",
            "Calls delivered more than once and not yet acked (a worker lost or handed back)",
            labels=["tier"],
        )
        for row in self._signals.lag:
            pending.add_metric([row.tier.value], row.pending)
            ack_pending.add_metric([row.tier.value], row.ack_pending)
            oldest.add_metric([row.tier.value], row.oldest_pending_age_s or 0.0)
            redelivered.add_metric([row.tier.value], row.redelivered)
        yield from (pending, ack_pending, oldest, redelivered)


class _ObjectivesCollector(Collector):
    """The tiers' objectives, so that dashboards and alert rules compare against what this
    front door is configured with (a tenant's own objectives aside)."""

    def __init__(self, tiers: Mapping[Tier, TierPolicy]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        objective = GaugeMetricFamily(
            "kvgate_tier_objective_seconds",
            "A tier's objective: time to first token (ttft) and per output token (tpot)",
            labels=["tier", "objective"],
        )
        for tier, policy in self._tiers.items():
            objective.add_metric([tier.value, "ttft"], policy.ttft_ms / 1000)
            objective.add_metric([tier.value, "tpot"], policy.tpot_ms / 1000)
        yield objective


class _LedgerCollector(Collector):
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        dropped = CounterMetricFamily(
            "kvgate_ledger_dropped", "Decisions dropped from the ledger (queue full or DB error)"
        )
        dropped.add_metric([], self._ledger.dropped)
        written = CounterMetricFamily("kvgate_ledger_written", "Decisions written to the ledger")
        written.add_metric([], self._ledger.written)
        queued = GaugeMetricFamily("kvgate_ledger_queued", "Decisions waiting to be written")
        queued.add_metric([], self._ledger.queued)
        yield from (dropped, written, queued)


class _OpenCallsCollector(Collector):
    def __init__(self, replies: ReplyRouter) -> None:
        self._replies = replies

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # Zero once the traffic stops, whatever ended the calls (their last event, an error,
        # a disconnected caller): a call still followed then is a leak.
        open_calls = GaugeMetricFamily(
            "kvgate_calls_open", "Calls this front door is following (open reply streams)"
        )
        open_calls.add_metric([], self._replies.open_calls)
        yield open_calls


class FrontDoorMetrics:
    def __init__(self, signals: FleetSignals) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "kvgate_calls",
            "Calls ended, by tier and outcome (ok or an error code)",
            ["tier", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds",
            "Time from the request to its first token, as the front door sees it",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvgate_tpot_seconds",
            "Mean time per output token after the first, per call",
            ["tier"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.first_event = Histogram(
            "kvgate_publish_to_first_event_seconds",
            "From publishing a call to its first reply event: queue wait plus prefill",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "From publishing a call to its engine start, as the worker measured it",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvgate_tokens_streamed",
            "Output tokens relayed to callers",
            ["tier"],
            registry=self.registry,
        )
        self.admission = AdmissionMetrics(self.registry)
        self.objective_met = Counter(
            "kvgate_calls_judged",
            "Ended calls of admitted sessions judged against their objectives, by tier and "
            "whether they met them",
            ["tier", "met"],
            registry=self.registry,
        )
        self.registry.register(_FleetCollector(signals))

    def watch_objectives(self, tiers: Mapping[Tier, TierPolicy]) -> None:
        self.registry.register(_ObjectivesCollector(tiers))

    def watch_ledger(self, ledger: Ledger) -> None:
        self.registry.register(_LedgerCollector(ledger))

    def watch_replies(self, replies: ReplyRouter) -> None:
        self.registry.register(_OpenCallsCollector(replies))
