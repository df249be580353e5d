"""The worker's pure "how much to ask for, from which tier" step. No I/O: the NATS shell in
``workers.puller`` and ``workers.worker`` carries the plan out.

The worker keeps *pull credit* open at the server: a pull request for ``n`` messages lets the
server push up to ``n`` calls, one by one, the moment they are published. So a call that lands
on an idle worker starts at once, with no poll interval on its time to first token, and the
worker never holds more credit than its headroom (``workers.headroom``) allows.

Tiers are served highest first. A tier with no credit gets a "doorbell" (one credit, so a call
on an empty tier is noticed at once) unless a higher tier has a backlog; a tier held back that
way for longer than the starvation bound is *starved* and served first.
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
    """Calls known to be waiting on this tier beyond those delivered (0 when unknown)."""
    starved: bool = False


def held_back(tiers: Sequence[TierView]) -> set[Tier]:
    """Tiers that get no doorbell because a higher tier has work waiting beyond its credit."""
    result: set[Tier] = set()
    higher_busy = False
    for view in tiers:
        if higher_busy and view.outstanding == 0:
            result.add(view.tier)
        higher_busy = higher_busy or view.backlog > view.outstanding
    return result


def plan_pulls(
    free_calls: int, tiers: Sequence[TierView], *, top_tier_room: bool = False
) -> dict[Tier, int]:
    """New credit per tier; ``tiers`` highest priority first, ``free_calls`` from the headroom
    (calls that fit, not counting credit already open).

    Doorbells ride free: with any room at all, every eligible tier keeps one credit, even if
    that asks for up to ``len(tiers) - 1`` calls more than fit. Otherwise a worker with room
    for one call would only ever listen to its highest tier, and doorbells idling on empty
    tiers would use up the room a busy tier needs. An extra arrival waits staged in the
    worker; it never over-commits the engine, whose starts ``workers.headroom`` decides.
    Credit beyond doorbells never exceeds ``free_calls``.

    ``top_tier_room``: the highest tier still has room of its own (the guaranteed reserve),
    so it keeps its doorbell even when lower-tier work has used up ``free_calls``.
    """
    plan: dict[Tier, int] = {}
    if free_calls <= 0:
        if top_tier_room and tiers and tiers[0].outstanding == 0:
            plan[tiers[0].tier] = 1
        return plan
    order = [v for v in tiers if v.starved] + [v for v in tiers if not v.starved]
    waiting = held_back(tiers)
    for view in order:
        if view.outstanding == 0 and (view.starved or view.tier not in waiting):
            plan[view.tier] = 1
    budget = free_calls - sum(max(0, v.outstanding - 1) for v in tiers)
    for view in order:
        if budget <= 0:
            break
        already = view.outstanding + plan.get(view.tier, 0)
        want = min(view.backlog - already, budget)
        if want > 0:
            plan[view.tier] = plan.get(view.tier, 0) + want
            budget -= want
    return plan
