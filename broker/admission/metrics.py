"""The Prometheus metrics admission observes, registered in the front door's registry."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.vocab import Tier


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvgate_admission_decisions",
            "Admission decisions, by tier, decision and reason",
            ["tier", "decision", "reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "kvgate_admission_latency_seconds",
            "Time to decide (signals, policy, reservation), by scope (session or call)",
            ["scope"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=registry,
        )
        self.held = Histogram(
            "kvgate_admission_held_seconds",
            "How long a session was held for room before its answer (0 when it was answered "
            "at once), by tier and decision",
            ["tier", "decision"],
            buckets=(0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.held_now = Gauge(
            "kvgate_admission_held_sessions",
            "Sessions this replica holds now, waiting for room before their answer",
            registry=registry,
        )
        self.healed = Counter(
            "kvgate_admission_state_healed",
            "Entries of the shared admission state found wrong and mended by the heal (totals "
            "recomputed from the leases, lost expiry entries); any is worth a look",
            registry=registry,
        )
        self.pressure = Gauge(
            "kvgate_admission_pressure",
            "Admission pressure state: 0 normal, 1 elevated, 2 saturated",
            registry=registry,
        )
        self.overcommit = Gauge(
            "kvgate_admission_overcommit",
            "Learned KV over-commit factor of the whole fleet: reservations may add up to this "
            "times capacity",
            registry=registry,
        )
        self.window = Gauge(
            "kvgate_admission_window",
            "Each tier's learned over-commit window (grows while its admitted calls meet their "
            "objectives, shrinks when they do not)",
            ["tier"],
            registry=registry,
        )
        self.sessions_active = Gauge(
            "kvgate_admission_sessions_active",
            "Live sessions (holding a lease) per tier and tenant, fleet-wide, read every few "
            "seconds from the admission state",
            ["tier", "tenant"],
            registry=registry,
        )

    def set_active_sessions(self, active: Mapping[tuple[Tier, str], int]) -> None:
        # Cleared first: a tenant whose last session ended drops out instead of staying at
        # its last count. Both run on the event loop, so a scrape never sees it half-set.
        self.sessions_active.clear()
        for (tier, tenant), count in active.items():
            self.sessions_active.labels(tier.value, tenant).set(count)
