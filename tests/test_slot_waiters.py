"""The calls waiting for a call slot on one front door: the bounds, one wake per freed slot, only
the head polls, and no wake is lost. Pure: no server, no clock."""

from __future__ import annotations

import random

import pytest

from api.errors import error_response
from broker.admission.waiters import POLL_JITTER, POLL_MAX_S, POLL_S, SlotWaiter, SlotWaiters
from broker.errors import TooManyWaitingCalls


def queued(waiters: SlotWaiters, session_id: str, n: int) -> list[SlotWaiter]:
    """``n`` calls of the session, each told ``busy`` once."""
    calls = [waiters.join(session_id) for _ in range(n)]
    for call in calls:
        waiters.wait(call)
    return calls


def woken(calls: list[SlotWaiter]) -> list[bool]:
    return [call.woken.is_set() for call in calls]


def test_a_session_over_its_bound_is_refused_with_429_and_retry_after() -> None:
    waiters = SlotWaiters(per_session=2, total=100)
    queued(waiters, "s", 2)
    third = waiters.join("s")
    with pytest.raises(TooManyWaitingCalls) as refused:
        waiters.wait(third)
    waiters.leave(third)
    response = error_response(refused.value)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert b'"code":"too_many_waiting_calls"' in response.body
    # Another session still has room; so does this one once a call has left.
    queued(waiters, "other", 2)
    assert waiters.waiting == 4


def test_the_front_door_total_bounds_every_session_together() -> None:
    waiters = SlotWaiters(per_session=10, total=3)
    queued(waiters, "a", 2)
    queued(waiters, "b", 1)
    with pytest.raises(TooManyWaitingCalls, match="on this front door"):
        waiters.wait(waiters.join("c"))


def test_a_call_that_never_waited_counts_against_no_bound() -> None:
    waiters = SlotWaiters(per_session=1, total=1)
    first = waiters.join("s")  # asking, not told busy yet
    [held] = queued(waiters, "s", 1)
    waiters.leave(first)
    waiters.leave(held)
    assert waiters.waiting == 0


def test_a_freed_slot_wakes_one_waiter_in_arrival_order() -> None:
    waiters = SlotWaiters(per_session=10, total=10)
    calls = queued(waiters, "s", 3)
    other = queued(waiters, "t", 1)
    waiters.call_ended("s")
    assert woken(calls + other) == [True, False, False, False]
    waiters.call_ended("s")
    assert woken(calls + other) == [True, True, False, False]


def test_only_the_head_polls_and_its_wait_backs_off_with_jitter() -> None:
    waiters = SlotWaiters(per_session=10, total=10, rng=random.Random(7))
    head, second = queued(waiters, "s", 2)
    assert waiters.timeout_s(second) is None
    waits = [waiters.timeout_s(head) for _ in range(5)]
    bases = [POLL_S, 2 * POLL_S, 4 * POLL_S, POLL_MAX_S, POLL_MAX_S]
    for wait_s, base in zip(waits, bases, strict=True):
        assert wait_s is not None
        assert base * (1 - POLL_JITTER) <= wait_s <= base * (1 + POLL_JITTER)


def test_a_head_that_leaves_wakes_the_next_which_then_polls() -> None:
    waiters = SlotWaiters(per_session=10, total=10)
    head, second, third = queued(waiters, "s", 3)
    waiters.leave(head)  # its deadline passed, or it got its slot
    assert woken([second, third]) == [True, False]
    assert waiters.timeout_s(second) is not None


def test_a_wake_held_by_a_call_that_goes_away_is_passed_on() -> None:
    waiters = SlotWaiters(per_session=10, total=10)
    asking = waiters.join("s")  # a wake lands while it is still asking
    [waiting] = queued(waiters, "s", 1)
    waiters.call_ended("s")
    assert woken([asking, waiting]) == [True, False]
    waiters.leave(asking)  # its client went away before it asked again
    assert waiting.woken.is_set()


def test_a_call_that_got_a_slot_at_once_wakes_nobody() -> None:
    waiters = SlotWaiters(per_session=10, total=10)
    [waiting] = queued(waiters, "s", 1)
    fast = waiters.join("s")
    waiters.leave(fast)
    assert not waiting.woken.is_set()


def test_an_ended_session_wakes_all_and_a_gap_in_the_feed_wakes_every_head() -> None:
    waiters = SlotWaiters(per_session=10, total=10)
    s_calls = queued(waiters, "s", 2)
    t_calls = queued(waiters, "t", 2)
    u_calls = queued(waiters, "u", 2)
    waiters.session_ended("s")
    assert woken(s_calls) == [True, True]
    waiters.releases_missed()
    assert woken(t_calls + u_calls) == [True, False, True, False]
