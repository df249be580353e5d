"""The order in which a replica decides again the sessions it holds (``HeldSessions``), step
by step: no front door, no NATS, no sleeps but the bounds a turn is awaited within."""

from __future__ import annotations

import asyncio

from broker.admission.holding import HeldSessions

TURN_BOUND_S = 10.0
"""How long a turn that must come is awaited: generous, it only bounds a failing test."""
NO_TURN_S = 0.05
"""How long a turn that must not come is watched not coming (no pass runs in it: nothing
wakes one, and the poll is a minute)."""
MINUTE = 60.0


async def test_turns_go_to_the_higher_tier_first_then_the_earliest_deadline() -> None:
    held = HeldSessions(poll_s=MINUTE)
    ranks = {
        "standard, deadline 30": (1, 30.0),
        "guaranteed, deadline 50": (0, 50.0),
        "standard, deadline 10": (1, 10.0),
        "besteffort, deadline 1": (2, 1.0),
    }
    # Joined before the first pass runs (no await between): one pass sees all four.
    places = {name: held.join(rank) for name, rank in ranks.items()}
    turns: list[str] = []

    async def answered_on_its_turn(name: str) -> None:
        place = places[name]
        assert await held.turn(place, TURN_BOUND_S)
        turns.append(name)
        held.leave(place)

    await asyncio.gather(*(answered_on_its_turn(name) for name in ranks))
    assert turns == [
        "guaranteed, deadline 50",
        "standard, deadline 10",
        "standard, deadline 30",
        "besteffort, deadline 1",
    ]
    assert held.held == 0
    await held.close()


async def test_one_that_still_does_not_fit_does_not_block_those_behind_it() -> None:
    held = HeldSessions(poll_s=MINUTE)
    first, second = held.join((1, 1.0)), held.join((1, 2.0))
    assert await held.turn(first, TURN_BOUND_S)
    held.decided(first)  # deferred again: it waits for the next pass
    assert await held.turn(second, TURN_BOUND_S)  # in the same pass
    held.leave(second)  # admitted
    assert not await held.turn(first, NO_TURN_S)  # no pass until room frees
    held.wake()  # room freed on this replica
    assert await held.turn(first, TURN_BOUND_S)
    held.leave(first)
    assert held.held == 0
    await held.close()


async def test_one_that_leaves_on_its_turn_lets_the_pass_go_on() -> None:
    held = HeldSessions(poll_s=MINUTE)
    gone, next_one = held.join((1, 1.0)), held.join((1, 2.0))
    assert await held.turn(gone, TURN_BOUND_S)
    held.leave(gone)  # its client went away while it was being decided
    assert await held.turn(next_one, TURN_BOUND_S)
    held.leave(next_one)
    await held.close()


async def test_a_new_session_goes_behind_held_ones_of_its_tier_with_earlier_deadlines() -> None:
    held = HeldSessions(poll_s=MINUTE)
    place = held.join((1, 20.0))
    assert held.ahead_of((1, 30.0))  # same tier, later deadline: behind it
    assert held.ahead_of((2, 5.0))  # a lower tier: behind it, whatever its deadline
    assert not held.ahead_of((1, 10.0))  # an earlier deadline goes first
    assert not held.ahead_of((0, 99.0))  # a higher tier goes first
    held.leave(place)
    assert not held.ahead_of((2, 99.0))
    await held.close()
