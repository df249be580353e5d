"""The chaos suite's accounting (tests/chaos.py) catches what it is there to catch: each check
fed a case broken on purpose, with no server."""

from __future__ import annotations

from tests.chaos import MUST_BE_ZERO, Kind, Outcome, at_rest, check_answers, may_have_expired


def call(call_id: str, **fields: object) -> Outcome:
    outcome = Outcome(Kind.PLAIN_CALL, "standard", 0.0, call_id=call_id, status=200, answers=1)
    for name, value in fields.items():
        setattr(outcome, name, value)
    return outcome


def test_calls_answered_once_or_told_why_pass() -> None:
    outcomes = [
        call("a"),
        call("b", answers=0, status=503, code="admission_unavailable", retry_after=5),
        call("c", answers=0, disconnected=True),
    ]
    assert check_answers(outcomes) == []


def test_each_broken_case_is_caught() -> None:
    broken = {
        "answered 2 times": call("a", answers=2),
        "neither answered nor told why": call("b", answers=0, status=200),
        "unclear error 'internal_error'": call("c", answers=0, status=500, code="internal_error"),
        "transport": call("d", answers=0, problem="transport: ReadError"),
        "answered and also told": call("e", code="worker_lost"),
    }
    for expected, outcome in broken.items():
        faults = check_answers([outcome])
        assert len(faults) == 1 and expected in faults[0], (expected, faults)
    assert check_answers([call("x"), call("x")]) == ["call id x seen 2 times"]
    opened = Outcome(Kind.SESSION_OPEN, "standard", 0.0, session_id="s1", answers=1)
    assert check_answers([opened]) == ["session s1 never closed"]


def test_rest_needs_every_holding_at_zero_and_every_call_ended_once() -> None:
    quiet = {name: 0 for name in MUST_BE_ZERO} | {
        "workers_live": 1,
        "worker_ended": 7,
        "js_calls_published": 7,
    }
    assert at_rest(quiet)
    for name in MUST_BE_ZERO:
        assert not at_rest(quiet | {name: 1}), name
    assert not at_rest(quiet | {"worker_ended": 8})  # a call ended twice
    assert not at_rest(quiet | {"worker_ended": 6})  # a call lost
    assert not at_rest(quiet | {"workers_live": 0})


def test_calls_ended_by_a_gone_worker_count_within_what_is_known_of_them() -> None:
    """A worker that is gone ended between ``gone_ended_min`` and ``gone_ended_max`` calls:
    the live workers' count must make up the rest, no more, no less."""
    quiet = {name: 0 for name in MUST_BE_ZERO} | {
        "workers_live": 1,
        "js_calls_published": 10,
        "gone_ended_min": 3,
        "gone_ended_max": 5,
    }
    for live_ended in (5, 6, 7):
        assert at_rest(quiet | {"worker_ended": live_ended}), live_ended
    assert not at_rest(quiet | {"worker_ended": 8})  # a call ended twice
    assert not at_rest(quiet | {"worker_ended": 4})  # a call lost


def test_calls_the_server_may_have_dropped_at_their_deadline_are_bounded_by_the_callers() -> None:
    """Only after a stall that outlasted a deadline may a call have left the stream unstarted,
    and only one whose caller never saw it start."""
    quiet = {name: 0 for name in MUST_BE_ZERO} | {"workers_live": 1, "js_calls_published": 10}
    no_stall = [
        call("a"),
        call("b", answers=0, status=503, code="broker_unavailable"),
        call("c", answers=0, disconnected=True),
    ]
    assert may_have_expired(no_stall) == 0
    assert not at_rest(quiet | {"worker_ended": 9, "may_expire": may_have_expired(no_stall)})
    streamed = call("d", answers=0, disconnected=True, stream=True)  # after its first token
    stalled = [*no_stall, streamed, call("e", answers=0, status=504, code="deadline_exceeded")]
    assert may_have_expired(stalled) == 3  # b, c and e
    for live_ended in (7, 8, 9, 10):
        assert at_rest(quiet | {"worker_ended": live_ended, "may_expire": 3}), live_ended
    assert not at_rest(quiet | {"worker_ended": 6, "may_expire": 3})  # more lost than could be
    assert not at_rest(quiet | {"worker_ended": 11, "may_expire": 3})  # a call ended twice
