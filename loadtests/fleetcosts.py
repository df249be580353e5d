"""The front door's per-message costs that grow with the fleet, timed in-process with no
server (the rehearsal, ``loadtests/rehearsal.py``, runs this for each source tree it compares):

- a heartbeat applied to the fleet view (``FleetView.update``, its decoding included);
- a decision's fleet readings (``FleetSignals.snapshot``), for decisions 2 ms apart (500 a
  second, one front door busy): the mean, rebuilds included, and the slowest (a rebuild);
- the admission policy's run over those readings (``decide``);
- the model check every call makes (``FleetView.models``).

Microseconds; medians unless said. These extrapolate to other fleet sizes and machines as
per-message costs do; a run's totals on a shared machine do not.

    python -m loadtests.fleetcosts 25 100 1000
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from broker.admission.policy import AdmissionPolicy, Holdings, Pressure, SessionNeed, decide
from broker.admission.signals import FleetSignals
from broker.admission.tenants import DEFAULT_TIERS, Tenant
from broker.fleet import FleetView
from loadtests import stats
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import WorkerHeartbeat, encode

DECISIONS = 500
DECISION_GAP_MS = 2
HEARTBEATS = 20_000
"""Heartbeats applied per fleet size (whole passes through the fleet)."""


def beat(i: int, sent_ms: int, generated: int) -> bytes:
    return encode(
        WorkerHeartbeat(
            worker_id=f"w{i}",
            model="kvgate-sim",
            sent_ms=sent_ms,
            kv_cache_usage=0.3,
            num_running=8,
            num_waiting=0,
            max_num_seqs=16,
            kv_capacity_tokens=8192,
            committed_tokens=2000,
            generated_tokens=generated,
        )
    )


def costs(n: int) -> dict[str, float]:
    """The costs for a fleet of ``n`` workers, each busy and heard from every 2 s."""
    clock = time.perf_counter
    view = FleetView(6.0)
    now = int(time.time() * 1000)
    for sent, generated in ((now - 4000, 0), (now - 2000, 1000)):
        for i in range(n):
            view.update(f"w{i}", beat(i, sent, generated))
    per_beat = []
    passes = max(1, HEARTBEATS // n)
    for p in range(passes):
        payloads = [beat(i, now + 2000 * p, 2000 * (p + 2)) for i in range(n)]
        started = clock()
        for i, payload in enumerate(payloads):
            view.update(f"w{i}", payload)
        per_beat.append((clock() - started) / n * 1e6)
    signals = FleetSignals(view)
    tenant = Tenant(id="rehearsal", key_sha256="a" * 64, max_tier=Tier.GUARANTEED)
    policy = AdmissionPolicy(tiers=DEFAULT_TIERS)
    holdings = Holdings(dict.fromkeys(TIERS_BY_PRIORITY, 0), 0, 0, 0, 0.0)
    need = SessionNeed(Tier.STANDARD, 1, 1, 16, 8, 600.0)
    decided_at = now + 2000 * passes
    snapshot_us, decide_us, models_us = [], [], []
    for d in range(DECISIONS):
        at_ms = decided_at + d * DECISION_GAP_MS
        t0 = clock()
        snapshot = signals.snapshot(at_ms)
        t1 = clock()
        decide(need, tenant, snapshot, holdings, Pressure.NORMAL, policy, max_age_s=6, jitter=0.5)
        t2 = clock()
        view.models(at_ms)
        t3 = clock()
        snapshot_us.append((t1 - t0) * 1e6)
        decide_us.append((t2 - t1) * 1e6)
        models_us.append((t3 - t2) * 1e6)

    def median(values: list[float]) -> float:
        return round(stats.percentile(values, 50) or 0.0, 2)

    return {
        "heartbeat_update_us": median(per_beat),
        "snapshot_mean_us": round(statistics.fmean(snapshot_us), 1),
        "snapshot_max_us": round(max(snapshot_us), 1),
        "decide_us": median(decide_us),
        "models_us": median(models_us),
    }


def all_costs(sizes: list[int]) -> dict[str, Any]:
    return {str(n): costs(n) for n in sizes}


def main() -> None:
    print(json.dumps(all_costs([int(n) for n in sys.argv[1:]])))


if __name__ == "__main__":
    main()
