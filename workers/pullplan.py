"""The worker's pure "what may I ask for now" step. No I/O: the NATS shell in
``workers.puller`` and ``workers.worker`` carries the plan out.

The worker keeps *pull credit* outstanding at the server: a pull request for ``n`` messages
lets the server push up to ``n`` calls, one by one, the moment they are published. So a call
that lands on an idle worker starts at once, with no poll interval on its time to first token,
and the worker never holds more credit than it has room for.

Invariant: ``sum(credit asked) + in-flight calls <= capacity``. Capacity here is sequence
slots; the KV-headroom policy refines what a slot is worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.vocab import Tier


@dataclass(frozen=True, slots=True)
class TierView:
    tier: Tier
    outstanding: int
    """Credit asked for on this tier and not yet used or expired."""
    backlog: int
    """Calls known to be waiting on this tier beyond what was delivered (0 when unknown)."""


def plan_pulls(free_slots: int, tiers: Sequence[TierView]) -> dict[Tier, int]:
    """How much new credit to ask for on each tier. ``tiers`` is highest priority first.

    Every tier with no credit first gets one (a "doorbell", so a call on an empty tier is
    noticed at once); what is left goes to tiers with a known backlog, highest first.
    """
    plan: dict[Tier, int] = {}
    free = free_slots
    for view in tiers:
        if free <= 0:
            return plan
        if view.outstanding == 0:
            plan[view.tier] = 1
            free -= 1
    for view in tiers:
        if free <= 0:
            break
        already = view.outstanding + plan.get(view.tier, 0)
        want = min(view.backlog - already, free)
        if want > 0:
            plan[view.tier] = plan.get(view.tier, 0) + want
            free -= want
    return plan
