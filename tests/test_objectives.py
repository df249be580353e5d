"""The objective windows: admission's over-commit per tier, grown while admitted calls meet their
objectives and cut when they miss. Pure: each step is a function call with the clock given."""

from __future__ import annotations

from dataclasses import replace

import pytest

from broker.admission.objectives import (
    FleetBusy,
    Objective,
    ObjectiveWindows,
    SessionPace,
    Verdict,
    WindowBounds,
)
from broker.admission.tenants import DEFAULT_TIERS, ObjectiveOverride, Tenancy, Tenant
from schemas.vocab import Tier

G, S, B = Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT
BOUNDS = WindowBounds(floor=1.0, ceiling=4.0, target=0.9, window_s=10.0, min_calls=10)


def judge(w: ObjectiveWindows, tier: Tier, met: int, missed: int, at_s: float) -> None:
    for _ in range(met):
        w.judge(Verdict(tier, True), at_s)
    for _ in range(missed):
        w.judge(Verdict(tier, False), at_s)


def test_an_objective_is_met_by_a_fast_first_token_and_fast_tokens_after_it() -> None:
    o = Objective(ttft_s=1.0, tpot_s=0.1)
    assert o.met(0.5, 0.05) and o.met(1.0, 0.1)
    assert o.met(0.5, None)  # a one-token answer has no time per output token
    assert not o.met(1.01, 0.05) and not o.met(0.5, 0.11)
    assert not o.met(None, None)  # no token at all


def test_windows_start_at_the_floor_and_grow_only_where_admissions_were_bound() -> None:
    w = ObjectiveWindows(BOUNDS)
    w.step(0.0)
    assert w.windows == {G: 1.0, S: 1.0, B: 1.0}
    judge(w, S, met=20, missed=0, at_s=1.0)
    w.step(5.0)  # met, but nobody was turned away: nothing to grow into
    assert w.windows == {G: 1.0, S: 1.0, B: 1.0}
    w.bound(1)  # a session was deferred because the standard group was full
    w.step(7.5)  # slow start: 2.5 s at 25% a second
    assert w.windows[G] == pytest.approx(1.625) and w.windows[S] == pytest.approx(1.625)
    assert w.windows[B] == 1.0  # the best-effort group did not bind
    for t in range(8, 40):
        w.bound(2)
        w.step(float(t))
    assert w.windows == {G: 2.0, S: 2.0, B: 2.0}  # slow start stops at its threshold
    for t in range(40, 100):  # beyond it, growth on evidence: 0.05 a second
        for tier in (G, S, B):
            judge(w, tier, met=10, missed=0, at_s=float(t))
        w.bound(2)
        w.step(float(t))
    assert w.windows[B] == pytest.approx(4.0)  # never above the ceiling


def test_after_its_first_cut_a_window_grows_by_a_constant_step_and_only_on_evidence() -> None:
    w = ObjectiveWindows(BOUNDS)
    w.windows.update({G: 2.0, S: 2.0, B: 2.0})
    judge(w, B, met=0, missed=10, at_s=0.0)
    w.step(0.0)  # best-effort is cut, and the tiers above it a little
    assert w.windows == {G: pytest.approx(1.8), S: pytest.approx(1.8), B: pytest.approx(1.4)}
    w.bound(2)
    w.step(2.0)  # best-effort's window binds its group, and has no evidence yet
    assert w.windows[B] == pytest.approx(1.4)
    judge(w, B, met=10, missed=0, at_s=2.5)  # the calls admitted under the cut meet it
    w.bound(2)
    w.step(4.0)
    assert w.windows[B] == pytest.approx(1.5)  # 2 s at 0.05 a second
    # Guaranteed and standard allow more than the best-effort group's factor: a busy
    # best-effort tier does not widen them.
    assert w.windows[G] == pytest.approx(1.8) and w.windows[S] == pytest.approx(1.8)
    w.bound(1)
    w.step(4.4)  # the standard group binds: cut, its windows grow only on their evidence
    assert w.windows[G] == pytest.approx(1.8) and w.windows[S] == pytest.approx(1.8)
    judge(w, S, met=10, missed=0, at_s=4.5)
    w.bound(1)
    w.step(6.4)
    assert w.windows[S] == pytest.approx(1.9) and w.windows[G] == pytest.approx(1.8)


def test_room_grows_a_binding_window_fast_until_its_first_cut_and_not_after() -> None:
    w = ObjectiveWindows(replace(BOUNDS, room_increase_per_s=1.0))
    w.bound(2)
    w.step(0.0, room=True)
    w.bound(2)
    w.step(0.5, room=True)  # sessions turned away from a fleet with room: 50% in 0.5 s
    assert w.windows[B] == pytest.approx(1.5)
    w.step(1.0, room=True)  # nobody was turned away: room alone grows nothing
    assert w.windows[B] == pytest.approx(1.5)
    for t in range(2, 5):
        w.bound(2)
        w.step(float(t), room=True)
    assert w.windows[B] == 2.0  # no further than slow start's threshold on passing room
    judge(w, B, met=0, missed=10, at_s=10.0)
    w.step(10.0)
    assert w.windows[B] == pytest.approx(1.4)
    # After the cut, room in the quiet after the burst that caused it is no evidence: the
    # window stays where the cut left it until calls run under it meet the target.
    for t in range(11, 15):
        w.bound(2)
        w.step(float(t), room=True)
    assert w.windows[B] == pytest.approx(1.4)


def test_sustained_room_grows_a_binding_window_past_slow_start_and_after_a_cut() -> None:
    """Sessions that idle between turns (tools running) reserve far more than they use: the
    fleet has room for seconds on end while sessions are turned away, and only growth on that
    room finds the window such a workload needs (loadtests/results/tools-2484832)."""
    bounds = replace(BOUNDS, room_hold_s=5.0, sustained_room_per_s=0.1, increase_per_s=0.0)
    w = ObjectiveWindows(bounds)
    w.windows.update({G: 2.0, S: 2.0, B: 2.0})  # slow start done
    for t in range(5):
        w.bound(2)
        w.step(float(t), room=True)
    assert w.windows[B] == 2.0  # room for 4 s: not yet sustained
    w.bound(2)
    w.step(5.0, room=True)
    assert w.windows[B] == pytest.approx(2.2)  # 10% of the window a second
    w.step(6.0, room=False)  # a moment without room starts the hold over
    for t in range(7, 12):
        w.bound(2)
        w.step(float(t), room=True)
    assert w.windows[B] == pytest.approx(2.2)
    w.bound(2)
    w.step(12.0, room=True)
    assert w.windows[B] == pytest.approx(2.42)
    # A cut starts it over too, whatever room the fleet has in the step of the cut.
    judge(w, B, met=0, missed=10, at_s=12.0)
    w.bound(2)
    w.step(12.5, room=True)
    assert w.windows[B] == pytest.approx(2.42 * 0.7)
    for t in range(13, 18):
        w.bound(2)
        w.step(float(t), room=True)
    assert w.windows[B] == pytest.approx(2.42 * 0.7)  # 4.5 s of room since the cut
    w.bound(2)
    w.step(18.0, room=True)
    assert w.windows[B] == pytest.approx(2.42 * 0.7 * 1.1)  # 5 s: sustained again


def test_calls_of_sessions_admitted_before_a_cut_are_no_evidence_after_it() -> None:
    w = ObjectiveWindows(replace(BOUNDS, start=4.0))
    for n in range(10):
        w.judge(Verdict(S, False, session=f"old{n}", session_calls=4, admitted_s=0.5), 1.0)
    w.step(1.0)
    assert w.windows[S] == pytest.approx(2.8)
    # The sessions admitted under 4.0 go on missing after the cut; they do not cut again,
    # nor count for the narrower window.
    for n in range(10, 30):
        w.judge(Verdict(S, False, session=f"old{n}", session_calls=1, admitted_s=0.9), 2.0)
    assert w.attainment(S, 2.0) == (None, 0)
    w.step(2.0)
    assert w.windows[S] == pytest.approx(2.8)
    # Sessions admitted after it do, met or missed; so does a call whose admission is unknown.
    for n in range(10):
        w.judge(Verdict(S, False, session=f"new{n}", session_calls=1, admitted_s=1.5), 3.0)
    w.judge(Verdict(S, True, session="elsewhere", session_calls=1), 3.0)
    assert w.attainment(S, 3.0) == pytest.approx((1 / 11, 11))
    w.step(3.0)
    assert w.windows[S] == pytest.approx(1.96)


def test_a_miss_rate_above_the_target_cuts_the_tier_and_below_it_and_above_it_less() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, target=0.9, start=4.0))
    judge(w, S, met=17, missed=3, at_s=1.0)  # 85% met, target 90%
    judge(w, G, met=20, missed=0, at_s=1.0)
    w.step(2.0)
    # Guaranteed met its objectives, but its work is part of what standard's calls waited on.
    assert w.windows == {G: pytest.approx(3.6), S: pytest.approx(2.8), B: pytest.approx(2.8)}
    # The judged calls are forgotten: the next cut waits for calls run under the new window.
    w.step(3.0)
    assert w.windows[S] == pytest.approx(2.8)
    judge(w, S, met=18, missed=2, at_s=3.5)
    w.step(4.0)
    assert w.windows[S] == pytest.approx(2.8)  # 90% met: on target
    judge(w, G, met=5, missed=15, at_s=4.5)
    w.step(5.0)
    assert w.windows == {G: pytest.approx(2.52), S: pytest.approx(1.96), B: pytest.approx(1.96)}
    for t in range(6, 20):
        judge(w, G, met=0, missed=20, at_s=float(t))
        w.step(float(t) + 0.5)
    assert w.windows == {G: 1.0, S: 1.0, B: 1.0}  # never below the floor


def test_a_tier_is_judged_by_its_sessions_not_by_its_calls() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, target=0.9, start=4.0))
    # Ten sessions of ten calls; two of them have one late call each: 98% of calls met, 80%
    # of sessions finished good.
    for n in range(10):
        for c in range(10):
            met = not (n in (3, 7) and c == 5)
            w.judge(Verdict(S, met, session=f"s{n}", session_calls=10), 1.0)
    assert w.attainment(S, 1.0) == pytest.approx((0.8, 100))
    w.step(2.0)
    assert w.windows[S] == pytest.approx(2.8)
    # The same verdicts as plain calls (sessions of one) meet a 90% target.
    plain = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, target=0.9, start=4.0))
    judge(plain, S, met=98, missed=2, at_s=1.0)
    plain.step(2.0)
    assert plain.windows[S] == 4.0


def test_a_missed_session_counts_once_whole_and_its_later_calls_add_nothing() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, target=0.5, start=4.0))
    for _ in range(4):  # half of a session of eight met, then it misses twice
        w.judge(Verdict(B, True, session="late", session_calls=8), 1.0)
    w.judge(Verdict(B, False, session="late", session_calls=8), 1.0)
    w.judge(Verdict(B, False, session="late", session_calls=8), 1.0)
    for _ in range(8):
        w.judge(Verdict(B, True, session="fine", session_calls=8), 1.0)
    for _ in range(6):
        w.judge(Verdict(B, True, session="late", session_calls=8), 1.0)
    # Two sessions judged, one missed: 50%, however many of the missed one's calls came after.
    assert w.attainment(B, 1.0) == pytest.approx((0.5, 20))
    w.step(1.5)
    assert w.windows[B] == 4.0  # on the 50% target
    w.judge(Verdict(B, False, session="fine", session_calls=8), 2.0)  # a ninth call, late
    assert w.attainment(B, 2.0) == pytest.approx((0.0, 21))


def test_too_few_calls_are_no_evidence_and_old_calls_leave_the_window() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, target=0.9, start=2.0))
    judge(w, B, met=0, missed=19, at_s=0.0)  # min_calls is 20
    w.step(1.0)
    assert w.windows[B] == 2.0 and not w.violated(B, 1.0)
    assert w.attainment(B, 1.0) == (0.0, 19)
    assert w.attainment(B, 30.0) == (None, 0)  # older than the 20 s window
    judge(w, B, met=0, missed=1, at_s=30.0)
    w.step(30.5)
    assert w.windows[B] == 2.0


def test_a_lone_missed_session_is_no_violation_and_a_second_one_is() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, start=2.0))  # target 0.97
    for n in range(24):  # 25 sessions of one call each: one missed is 96%, under the target
        w.judge(Verdict(S, True, session=f"s{n}"), 1.0)
    w.judge(Verdict(S, False, session="late"), 1.0)
    assert w.attainment(S, 1.0) == pytest.approx((0.96, 25))
    w.step(1.5)
    assert w.windows[S] == 2.0 and not w.violated(S, 1.5)
    w.judge(Verdict(S, False, session="late"), 2.0)  # the same session again: still one
    w.step(2.5)
    assert w.windows[S] == 2.0
    w.judge(Verdict(S, False, session="later"), 3.0)
    w.step(3.5)
    assert w.windows[S] == pytest.approx(1.4)
    # With one miss as enough, the first would have cut.
    eager = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, start=2.0, min_missed=1))
    for n in range(24):
        eager.judge(Verdict(S, True, session=f"s{n}"), 1.0)
    eager.judge(Verdict(S, False, session="late"), 1.0)
    eager.step(1.5)
    assert eager.windows[S] == pytest.approx(1.4)


def test_group_factors_are_the_smallest_window_at_or_above_each_group() -> None:
    w = ObjectiveWindows(WindowBounds(floor=1.0, ceiling=4.0, start=3.0))
    w.windows.update({G: 2.0, S: 3.0, B: 1.5})
    assert w.group_factors() == (2.0, 2.0, 1.5)
    w.windows.update({G: 4.0, S: 1.0, B: 3.0})
    assert w.group_factors() == (4.0, 1.0, 1.0)


def test_a_tenant_may_set_its_own_objectives_for_a_tier() -> None:
    strict = Tenant(
        id="strict",
        key_sha256="b" * 64,
        objectives={Tier.STANDARD: ObjectiveOverride(ttft_ms=250)},
    )
    plain = Tenant(id="plain", key_sha256="c" * 64)
    tenancy = Tenancy([strict, plain])
    standard = DEFAULT_TIERS[Tier.STANDARD]
    assert tenancy.objective(strict, S) == Objective(0.25, standard.tpot_ms / 1000)
    assert tenancy.objective(plain, S) == Objective(
        standard.ttft_ms / 1000, standard.tpot_ms / 1000
    )
    assert tenancy.objective(strict, B) == tenancy.objective(plain, B)


def test_the_session_pace_is_a_quantile_of_recent_sessions_per_round_token() -> None:
    pace = SessionPace(0.9, window_s=60.0, min_sessions=10, min_first=10)
    # 12 calls, 3 at a time, 20 output tokens each: 4 rounds of 20 = 80 round tokens.
    for i in range(9):
        pace.observe(i, 8.0, expected_calls=12, max_parallel=3, est_output_tokens=20)
    assert pace.refresh(9.0) is None  # too few sessions to say
    pace.observe(9.0, 80.0, expected_calls=12, max_parallel=3, est_output_tokens=20)  # slow
    assert pace.refresh(9.0) == pytest.approx(0.1 + 0.1 * 0.9)  # p90 of nine 0.1 and one 1.0
    assert pace.current == pace.refresh(9.0)
    # Sessions older than the window no longer count: at 61 s the first has left.
    assert pace.refresh(59.5) is not None and pace.refresh(61.0) is None
    # A session with nothing to decode says nothing: it does not make up the count.
    pace.observe(61.0, 5.0, expected_calls=0, max_parallel=1, est_output_tokens=20)
    assert pace.refresh(61.0) is None
    with pytest.raises(ValueError, match="quantile"):
        SessionPace(0.0)


def test_the_pace_is_read_for_the_fleet_as_busy_as_it_is_now() -> None:
    """A burst's sessions ran slow; once it is over, their pace no longer rejects sessions
    that will run on a fleet a third as busy (loadtests/results/pace-by-busy)."""
    pace = SessionPace(0.5, window_s=120.0, min_sessions=4, min_first=4, busy_band=0.1)
    for i in range(6):  # 4 round tokens each: a burst's sessions, 0.5 s a token (one 0.3)
        took = 1.2 if i == 5 else 2.0
        pace.observe(i, took, expected_calls=1, max_parallel=1, est_output_tokens=4, busy=0.8)
    pace.refresh(6.0)
    assert pace.current == pytest.approx(0.5)
    assert pace.at(0.8) == pace.at(0.75) == pytest.approx(0.5)
    assert pace.at(0.95) == pytest.approx(0.5)  # busier than any: the busiest sessions' pace
    # Less busy than every session learned from: as fast as the fastest of the 4 least busy,
    # not their quantile (a quieter fleet runs at least as fast).
    assert pace.at(0.3) == pytest.approx(0.3)
    assert pace.at(None) == pytest.approx(0.5)  # not known now: every session's
    for i in range(4):  # then sessions on a quieter fleet, 0.1 s a token
        pace.observe(10 + i, 0.4, expected_calls=1, max_parallel=1, est_output_tokens=4, busy=0.3)
    pace.refresh(14.0)
    assert pace.at(0.3) == pytest.approx(0.1)  # only the four within the band
    assert pace.at(0.8) == pytest.approx(0.5)
    # Between the two, the four busiest sessions no busier than a band above it.
    assert pace.at(0.5) == pytest.approx(0.1)
    assert pace.at(0.72) == pytest.approx(0.5)
    # A session whose busy is not known counts toward current, not toward at.
    pace.observe(15, 40.0, expected_calls=1, max_parallel=1, est_output_tokens=4)
    pace.refresh(15.0)
    assert pace.at(0.3) == pytest.approx(0.1)
    # Sessions admitted by another replica and closed here: with too few of known busy to
    # read by, every session's pace.
    elsewhere = SessionPace(0.5, window_s=120.0, min_sessions=4, min_first=4, busy_band=0.1)
    for i in range(6):
        busy = 0.8 if i < 2 else None
        elsewhere.observe(i, 2.0, expected_calls=1, max_parallel=1, est_output_tokens=4, busy=busy)
    elsewhere.refresh(6.0)
    assert elsewhere.at(0.1) == elsewhere.current == pytest.approx(0.5)


def test_open_sessions_are_lower_bounds_on_the_pace() -> None:
    """A first burst has no ended session to learn from for as long as its sessions take: the
    sessions still open say how slow they are at least (loadtests/results/pace-by-busy)."""
    pace = SessionPace(0.5, window_s=120.0, min_sessions=4, min_first=4)
    one = {"expected_calls": 1, "max_parallel": 1, "est_output_tokens": 10}
    for n in range(4):
        pace.opened(f"s{n}", float(n), **one, deadline_s=30.0)
    assert pace.refresh(3.0) == pytest.approx(0.15)  # open 3, 2, 1 and 0 s: 0.3 ... 0 a token
    assert pace.refresh(13.0) == pytest.approx(1.15)  # 10 s on, none has ended
    pace.refresh(100.0)
    assert pace.current == pytest.approx(3.0)  # at most its deadline over its tokens
    for n in range(4):  # four end fast; the open sessions slower than them count
        pace.observe(20.0, 1.0, **one, session_id=f"e{n}")
    pace.observe(20.0, 5.0, **one, session_id="s0")  # closed: no longer open
    assert not pace.is_open("s0") and pace.is_open("s1")
    pace.opened("young", 19.5, **one, deadline_s=30.0)  # 0.05 so far: faster, not counted
    # Ended 0.1 x4 and 0.5 (median 0.1); open s1-s3 at 1.9, 1.8 and 1.7 count: median 0.3.
    assert pace.refresh(20.0) == pytest.approx(0.3)
    pace.observe(20.0, 1.0, **one, session_id="s1")
    pace.forget("s2")  # idled out, or closed by another front door: says nothing here
    assert pace.refresh(20.0) == pytest.approx(0.1)  # 0.1 x5, 0.5 and s3's 1.7
    # Past its deadline for a whole window, an open session's end was missed: forgotten.
    assert pace.refresh(170.0) is None
    assert not pace.is_open("s3") and not pace.is_open("young")
    # Ends that may have gone unheard: every open session is forgotten.
    pace.opened("later", 160.0, **one, deadline_s=30.0)
    pace.forget_open()
    assert not pace.is_open("later")
    # Only so many are followed: the youngest beyond them are not.
    few = SessionPace(0.5, min_sessions=2, min_first=2, max_open=2)
    for n in range(3):
        few.opened(f"f{n}", float(n), **one, deadline_s=30.0)
    assert [few.is_open(f"f{n}") for n in range(3)] == [True, True, False]


def test_a_first_pace_is_read_from_fewer_sessions_while_few_have_ended() -> None:
    """Until ``min_sessions`` have ended, ``min_first`` sessions, ended or open, give a pace:
    the first to end are the quickest and open ones are lower bounds, so it errs fast."""
    pace = SessionPace(0.5, window_s=120.0, min_sessions=6, min_first=3)
    one = {"expected_calls": 1, "max_parallel": 1, "est_output_tokens": 10}
    pace.observe(1.0, 1.0, **one, session_id="first")  # 0.1 a token
    pace.opened("a", 0.0, **one, deadline_s=30.0)
    assert pace.refresh(2.0) is None  # two known: too few even for a first pace
    pace.opened("b", 0.5, **one, deadline_s=30.0)
    assert pace.refresh(2.0) == pytest.approx(0.15)  # 0.1, and a and b open 2 and 1.5 s
    for n in range(5):  # six ended: the open ones count only where slower than them
        pace.observe(3.0, 1.0, **one, session_id=f"e{n}")
    assert pace.refresh(3.0) == pytest.approx(0.1)  # 0.1 x6, a 0.3 and b 0.25
    with pytest.raises(ValueError, match="min_first"):
        SessionPace(0.5, min_sessions=4, min_first=5)


def test_open_sessions_are_read_by_how_busy_the_fleet_has_been_since_their_admission() -> None:
    pace = SessionPace(0.5, window_s=120.0, min_sessions=2, min_first=2, busy_band=0.1)
    one = {"expected_calls": 1, "max_parallel": 1, "est_output_tokens": 10}
    busy = FleetBusy()
    busy.step(0.0, 0.8)
    for n in range(2):
        busy.mark(f"s{n}", 0.0)
        pace.opened(f"s{n}", 0.0, **one, deadline_s=30.0)
    busy.step(10.0, 0.8)
    pace.refresh(10.0, lambda session_id: busy.so_far(session_id, 10.0))
    assert pace.at(0.8) == pytest.approx(1.0)  # open 10 s, 10 tokens each, the fleet 0.8 busy
    assert pace.at(0.3) == pytest.approx(1.0)  # a quieter fleet: the fastest of them
    assert busy.so_far("s0", 10.0) == pytest.approx(0.8)  # the mark is kept while open


def test_fleet_busy_averages_over_a_sessions_life_and_the_recent_past() -> None:
    busy = FleetBusy(recent_s=2.0)
    assert busy.now(0.0) is None
    busy.step(0.0, 0.2)
    busy.mark("s1", 0.0)
    busy.step(1.0, 0.6)
    busy.step(2.0, None)  # no fresh reading: the last one goes on
    busy.mark("s2", 2.0)
    busy.step(3.0, 0.2)
    busy.step(4.0, 0.2)
    # s1: 0.2 for 1 s, 0.6 for 2 s, 0.2 for 1 s.
    assert busy.since("s1", 4.0) == pytest.approx((0.2 + 0.6 * 2 + 0.2) / 4)
    assert busy.since("s1", 4.0) is None  # forgotten once read
    assert busy.since("other", 4.0) is None  # marked by no one here
    assert busy.since("s2", 4.0) == pytest.approx((0.6 + 0.2) / 2)
    # Over the last 3 s, the median of the two sessions' lives (4 s and 2 s).
    assert busy.now(4.0) == pytest.approx((0.6 * 2 + 0.2) / 3)
    busy.mark("s3", 4.0)
    busy.forget("s3")
    assert busy.since("s3", 5.0) is None
    small = FleetBusy(max_marks=2, max_mark_age_s=60.0)
    small.step(0.0, 0.5)
    for name in ("a", "b", "c"):
        small.mark(name, 0.0)
    assert small.since("a", 1.0) is None and small.since("c", 1.0) == pytest.approx(0.5)
    small.step(61.0, 0.5)  # b's lease ran out long ago, and nobody closed it
    assert small.since("b", 61.0) is None


def test_fleet_busy_now_spans_as_long_as_sessions_lived() -> None:
    # 1 s busy at 0.9, then quiet: read over the last 2 s, the fleet looks half as busy as over
    # the last 10 s, a session's life here. Sessions live as long as a pace they learn is read
    # for: one admitted in a quiet moment of a busy minute lives through the busy part too.
    busy = FleetBusy(recent_s=2.0, longest_s=30.0)
    for t in range(0, 9):
        busy.step(float(t), 0.9)
    busy.step(9.0, 0.1)
    busy.step(10.0, 0.1)
    assert busy.span_s == 2.0  # no session has ended here yet
    assert busy.now(10.0) == pytest.approx((0.9 + 0.1) / 2)
    for name, admitted_s in (("a", 0.0), ("b", 2.0), ("c", 4.0)):
        busy.mark(name, admitted_s)
    busy.since("a", 10.0)  # lived 10 s
    busy.since("b", 10.0)  # 8 s
    busy.since("c", 10.0)  # 6 s
    assert busy.span_s == 8.0  # their median
    assert busy.now(10.0) == pytest.approx((0.9 * 7 + 0.1) / 8)
    # Bounded: never shorter than recent_s, never longer than longest_s.
    busy.mark("d", 10.0)
    busy.since("d", 10.5)
    busy.mark("e", 10.0)
    busy.since("e", 10.5)
    assert busy.span_s == 6.0
    busy.mark("f", 10.0)
    busy.since("f", 10.1)
    busy.mark("g", 10.0)
    busy.since("g", 10.1)
    assert busy.span_s == 2.0
    slow = FleetBusy(recent_s=2.0, longest_s=30.0)
    slow.step(0.0, 0.5)
    slow.mark("h", 0.0)
    slow.since("h", 100.0)
    assert slow.span_s == 30.0
