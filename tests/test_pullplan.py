"""The worker's pure fetch step."""

from __future__ import annotations

from schemas.vocab import Tier
from workers.pullplan import TierView, plan_pulls

G, S, B = Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT


def views(*rows: tuple[int, int]) -> list[TierView]:
    return [TierView(t, o, b) for t, (o, b) in zip((G, S, B), rows, strict=True)]


def test_idle_worker_rings_a_doorbell_on_every_tier() -> None:
    assert plan_pulls(16, views((0, 0), (0, 0), (0, 0))) == {G: 1, S: 1, B: 1}


def test_no_room_asks_for_nothing() -> None:
    assert plan_pulls(0, views((0, 5), (0, 5), (0, 5))) == {}
    assert plan_pulls(-3, views((0, 5), (0, 5), (0, 5))) == {}


def test_every_tier_keeps_a_doorbell_even_when_room_is_short() -> None:
    # Room for one call still listens on every tier; the extra arrivals wait staged.
    assert plan_pulls(1, views((0, 0), (0, 0), (0, 0))) == {G: 1, S: 1, B: 1}


def test_known_backlog_is_asked_for_highest_tier_first() -> None:
    # Doorbells already open everywhere; 10 free slots; guaranteed has 4 waiting, besteffort 20.
    plan = plan_pulls(10, views((1, 4), (1, 0), (1, 20)))
    assert plan == {G: 3, B: 7}


def test_credit_already_open_counts_against_the_backlog() -> None:
    assert plan_pulls(10, views((5, 5), (1, 0), (1, 0))) == {}


def test_beyond_doorbells_the_plan_never_exceeds_the_free_slots() -> None:
    for free in range(0, 20):
        for backlog in (0, 3, 50):
            rows = views((0, backlog), (0, backlog), (1, backlog))
            plan = plan_pulls(free, rows)
            doorbells = sum(1 for v in rows if v.outstanding == 0 and v.tier in plan)
            assert sum(plan.values()) - doorbells <= free
            assert all(n > 0 for n in plan.values())


def test_lower_tiers_get_no_doorbell_while_a_higher_tier_has_backlog() -> None:
    assert plan_pulls(10, views((1, 40), (0, 0), (0, 0))) == {G: 10}


def test_a_starved_tier_is_served_first() -> None:
    rows = [TierView(G, 1, 40), TierView(S, 0, 0), TierView(B, 0, 5, starved=True)]
    assert plan_pulls(3, rows) == {B: 4}  # the doorbell plus the 3 calls that fit


def test_doorbells_on_empty_tiers_do_not_use_up_a_busy_tiers_room() -> None:
    # Room for 2 calls; doorbells idle on guaranteed and besteffort; standard has 3 waiting.
    assert plan_pulls(2, views((1, 0), (1, 3), (1, 0))) == {S: 2}


def test_the_top_tier_keeps_its_doorbell_when_lower_tiers_used_the_room() -> None:
    assert plan_pulls(0, views((0, 0), (0, 0), (1, 9)), top_tier_room=True) == {G: 1}
    assert plan_pulls(0, views((0, 0), (0, 0), (1, 9)), top_tier_room=False) == {}
    assert plan_pulls(0, views((1, 0), (0, 0), (1, 9)), top_tier_room=True) == {}
