"""Measured over-commit: how much of what admitted sessions reserve they actually use.

A session reserves its peak KV footprint, ``max_parallel * (prompt + output)`` per-call
estimates, for its whole life. An agent's calls are rarely all in flight at once: a turn fans
out in a burst, tools run between turns, estimates are rounded up. Held against the physical
cache, peak reservations leave most of it idle while sessions are turned away (the load harness
measured about 7% KV use with most sessions deferred).

So admission lets reservations add up to ``capacity * factor``, where the factor is learned from
the fleet: over a sliding window, the KV tokens that sessions actually held or waited for
(*demand*: the workers' committed tokens plus the calls queued for them) against the tokens
reserved. If reservations are used at a ratio ``r``, a factor of ``target_use / r`` keeps
expected demand at ``target_use`` of the cache. Pure: time and readings are arguments.

Invariants a change must keep:

- the factor stays within ``[floor, ceiling]``; ``floor`` is the operator's static
  ``KVGATE_ADMISSION_KV_OVERCOMMIT`` and ``floor == ceiling`` turns learning off;
- without enough evidence (reservations held for less than ``min_evidence_s`` of the window)
  the factor is the floor: an idle fleet, or one that just admitted its first sessions, has
  learned nothing yet and must not treat fresh, unused reservations as slack;
- it rises at most ``max_rise_per_s`` (slow start) and falls at once; under pressure it may
  fall but never rise, since a busy fleet's measured slack is not to be trusted;
- demand counts queued calls, so over-admission shows up as demand and pulls the factor down.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from broker.admission import FleetSnapshot, Pressure


@dataclass(frozen=True, slots=True)
class OvercommitBounds:
    floor: float = 1.0
    ceiling: float = 4.0
    target_use: float = 0.8
    """The share of the KV cache that admitted sessions' measured demand may fill."""
    window_s: float = 30.0
    min_evidence_s: float = 10.0
    """Seconds of the window in which reservations were held, before anything is learned."""
    max_rise_per_s: float = 0.2


@dataclass(frozen=True, slots=True)
class _Reading:
    at_s: float
    reserved: int
    demand: float


class OvercommitEstimator:
    def __init__(self, bounds: OvercommitBounds | None = None) -> None:
        self.bounds = bounds or OvercommitBounds()
        self.value = self.bounds.floor
        self.ratio: float | None = None
        """Demand / reserved over the window, when there was enough evidence."""
        self._readings: deque[_Reading] = deque()
        self._last_s: float | None = None

    def observe(
        self, now_s: float, *, reserved: int, demand: float | None, pressure: Pressure
    ) -> float:
        """One tick: the tokens reserved now (all tiers) and the fleet's demand now (``None``
        when no fresh worker reading exists: nothing is learned from an unknown)."""
        b = self.bounds
        elapsed = 0.0 if self._last_s is None else max(0.0, now_s - self._last_s)
        self._last_s = now_s
        if demand is not None:
            self._readings.append(_Reading(now_s, reserved, demand))
        while self._readings and self._readings[0].at_s < now_s - b.window_s:
            self._readings.popleft()
        target = self._target()
        if target > self.value:
            if pressure is not Pressure.NORMAL:
                target = self.value
            else:
                target = min(target, self.value + b.max_rise_per_s * elapsed)
        self.value = max(b.floor, min(b.ceiling, target))
        return self.value

    def _target(self) -> float:
        b = self.bounds
        held = [r for r in self._readings if r.reserved > 0]
        if len(held) < 2 or held[-1].at_s - held[0].at_s < b.min_evidence_s:
            self.ratio = None
            return b.floor
        reserved = sum(r.reserved for r in held)
        demand = sum(r.demand for r in held)
        self.ratio = demand / reserved
        if self.ratio <= 0:
            return b.ceiling
        return max(b.floor, min(b.ceiling, b.target_use / self.ratio))


def fleet_demand(fleet: FleetSnapshot, max_age_s: float) -> float | None:
    """KV tokens the serving workers hold for running calls, plus what the calls queued for them
    (staged in a worker, waiting in an engine, pending in JetStream) will need at the mean cost
    of a running call. ``None`` with no fresh reading."""
    serving = [w for w in fleet.workers if w.age_s <= max_age_s and not w.draining]
    if not serving:
        return None
    held = 0.0
    running = 0
    queued = 0
    for w in serving:
        if w.committed_tokens is not None:
            held += w.committed_tokens
        else:
            held += (w.kv_usage or 0.0) * (w.kv_capacity_tokens or 0)
        running += w.running
        queued += w.waiting + w.staged
    if fleet.pending_by_tier is not None:
        queued += sum(fleet.pending_by_tier.values())
    if running:
        per_call = held / running
    else:
        capacity = sum(w.kv_capacity_tokens or 0 for w in serving)
        per_call = capacity / max(1, sum(w.max_num_seqs for w in serving))
    return held + queued * per_call
