"""Admission aimed at the tiers' objectives: a window per tier that scales how much work may be
admitted, grown while admitted calls meet their objectives and cut when they do not.

Reservations (``broker.admission.policy``) bound what admitted sessions may hold by their declared
peaks. Whether that much work meets its TTFT and TPOT objectives depends on the workload, the
engine and the hardware, which admission cannot know in advance; the over-commit a fleet can
carry is therefore learned from the outcome, as CONCUR (arXiv 2601.22705) does for agent
sessions. Every call of an admitted session is judged against its objectives (its tier's, or
its tenant's where the tenants file overrides them) when it ends, or sooner when no worker has
started it within its first-token objective (``api.calls``), and per tier a window, a
factor on the fleet's KV capacity, moves by additive increase and multiplicative decrease:

- a tier's attainment is the share of its admitted sessions that met every objective so far,
  estimated from their calls as they end (the promise is per session: a session of ten calls
  with one late first token did not finish good, so judging calls one by one would let a
  tier run at 99% of calls met and 90% of sessions good). A call that met its objectives adds
  its share of its session (one over the session's expected calls); a session's first missed
  call counts the whole session as missed (what its earlier calls added, and one missed
  session); later calls of a missed session add nothing. A call outside any session (a plain
  call) is a session of one;
- a tier whose recent sessions met their objectives less often than ``target`` has a violation:
  its window and the window of every tier below it are multiplied by ``decrease`` (the work of
  lower tiers is what slows a higher tier's calls, and lower tiers give way first), and the
  windows of the tiers above it by ``decrease_above``: their work also slows the violating
  tier's calls (the engine starts theirs first), and a higher tier never cut would keep the
  fleet's total, its group's factor, where slow start left it, however often the tiers below
  are cut (the guaranteed window stayed at 3.6 while the standard one was cut to 1.2 and its
  sessions still missed, ``loadtests/results/paced-windows``). The calls
  judged so far are then forgotten for those tiers, so the next judgement sees only work that
  ran under the smaller window (TCP likewise waits a round trip after a loss);
- when a tier group's factor bound an admission since the last step (a session was deferred,
  or shaped to fewer calls, because the group was full), the windows that make that factor
  (the smallest among the group's tiers and the tiers above them) grow, unless they were just
  cut; the others already allow more than the factor and are left alone, or a busy lower
  tier would inflate a higher tier's window with nothing to show for it. They grow by
  ``slow_start_per_s`` of their value a second until a tier's first cut (a slow start, as
  TCP's, so that a fleet whose objectives allow a wide window finds it in seconds), and by
  ``room_increase_per_s`` of it while the fleet measurably has room (the caller says so: its
  committed KV under ``room_below``, nothing staged or queued;
  ``broker.admission.fleet_has_room``), up to ``slow_start_until`` (TCP's initial slow-start
  threshold). Misses are judged seconds after the sessions behind them were admitted, so an
  unbounded slow start ran on to 3.6-4 before its first cut, and the sessions admitted on the
  way missed (``loadtests/results/paced-windows``);
- past that threshold, or after a tier's first cut, its windows grow by ``increase_per_s`` a
  second while the tier's judged calls show it meeting its target (at least ``min_calls`` of
  them). The effect of a wider window shows only once the sessions it admitted have run, a
  median of about 8 s in the CPU sweep: the growth is paced to that delay (0.05 a second adds
  0.4 in a round trip), and room seen in the quiet after a burst is not evidence (growing on
  it returned a window to the factor its misses had come from within a second,
  ``loadtests/results/overcommit-cap``). Capacity nobody asks for is not grown into, so a
  quiet fleet keeps what it learned;
- room that lasts is evidence: while the fleet has had room at every step for
  ``room_hold_s``, with no cut since, binding windows grow by ``sustained_room_per_s`` of
  their value a second, past the threshold and after a cut. Agents that wait seconds for their
  tools reserve far more than they use: at a window of 2-4.7 the fleet had room 83-96% of the
  time, ran 2-4 of its 16 sequences with 15-28% of its KV in use, and turned away 31-48% of
  sessions (``loadtests/results/tools-2484832``), while 0.05 a second took 200 s to bring the
  window from 2 to 4.7. The hold is meant to outlast the quiet after a burst: the sessions
  admitted in the burst come back for their next turns within seconds;
- a call of a session admitted before its tier's last cut is not evidence about the window the
  cut left: its verdicts are not counted for the tier. Otherwise the misses of the sessions
  admitted under the wide window would go on cutting the narrower one for a round trip
  after the first cut;
- with fewer than ``min_calls`` calls judged, or fewer than ``min_missed`` of its sessions
  missed, a tier is never in violation. A lone miss is not a trend (TCP likewise waits for three
  duplicate acknowledgements before it takes a reordering for a loss): at the target of 0.97 one
  missed session among fewer than 33 in the window fell below it, and the cut that followed
  left the windows full of reservations while the fleet ran half empty. In six alternating
  pairs of CPU sweeps, two misses against one: admitted sessions good at 4x 95.4% against
  90.9%, no run's windows cut at 1x against three of six (``loadtests/results/lone-miss``).

Invariants a change must keep: every window stays within ``[floor, ceiling]``; the factor of a
nested tier group (a tier and all tiers below it, as ``broker.admission.tenants`` shares nest) is
the smallest window among the tiers it holds and the tiers above them, so a higher tier's violation
always narrows every group below it.

``SessionPace`` learns the other thing admission cannot know in advance: how long admitted sessions
actually take, which check 4 of ``broker.admission.policy`` turns into a prediction against a
session's deadline. Pure: the clock is an argument.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from schemas.vocab import TIERS_BY_PRIORITY, Tier


@dataclass(frozen=True, slots=True)
class Objective:
    """What a call of a tier promises: the time to its first token and the mean time per
    output token after it (seconds)."""

    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """``ttft_s`` is ``None`` for a call that produced no token (it failed): a miss.
        ``tpot_s`` is ``None`` for a one-token answer, which has no time per output token."""
        if ttft_s is None or ttft_s > self.ttft_s:
            return False
        return tpot_s is None or tpot_s <= self.tpot_s


@dataclass(frozen=True, slots=True)
class Verdict:
    """One call of an admitted session judged against its tier's objectives: when it ended, or
    when its first-token objective ran out before a worker started it."""

    tier: Tier
    met: bool
    session: str | None = None
    """Its session; ``None``: the call is a session of its own (module doc)."""
    session_calls: int = 1
    """The calls its session declared."""
    admitted_s: float | None = None
    """When its session was admitted (epoch seconds, the windows' clock); ``None``: not known."""


@dataclass(frozen=True, slots=True)
class WindowBounds:
    floor: float = 1.0
    """The operator's static over-commit (``KVGATE_ADMISSION_KV_OVERCOMMIT``)."""
    ceiling: float = 16.0
    target: float = 0.97
    """The share of judged sessions that must meet their objectives (module doc: sessions
    weighted by their calls). Above the promise (95% of admitted sessions good), because the
    windows react to misses only after the sessions admitted under them have run."""
    window_s: float = 20.0
    """Calls judged longer ago than this no longer count."""
    min_calls: int = 20
    min_missed: int = 2
    """Sessions that must have missed in the window for a violation (module doc)."""
    decrease: float = 0.7
    decrease_above: float = 0.9
    """The cut of the tiers above a violating one (module doc)."""
    slow_start_per_s: float = 0.25
    """Until a tier's first cut: this share of the window a second."""
    slow_start_until: float = 2.0
    """Slow start and room growth stop at this window (module doc)."""
    increase_per_s: float = 0.05
    """Past slow start: this much a second, and only on evidence (``min_calls`` judged,
    meeting ``target``)."""
    room_below: float = 0.5
    """The fleet has room while its committed and used KV are both under this share."""
    room_increase_per_s: float = 1.0
    """In slow start, growth (a share of the window a second) of a binding window while the
    fleet has room."""
    room_hold_s: float = 5.0
    """Room is sustained once the fleet has had it at every step for this long, and not since
    a cut (module doc)."""
    sustained_room_per_s: float = 0.1
    """Past slow start and after a cut, growth (a share of the window a second) of a binding
    window while room is sustained."""
    start: float | None = None
    """The windows' first value; the floor when unset (nothing learned yet)."""


_SESSION_MEMORY_S = 120.0
"""A session with no call judged for this long is forgotten (a later call of it starts over)."""


@dataclass(slots=True)
class _Judged:
    at_s: float
    sessions: float
    """The share of a session this judgement adds (module doc)."""
    missed: float
    """1 for a session's first missed call, else 0."""


@dataclass(slots=True)
class _SessionSoFar:
    counted: float = 0.0
    missed: bool = False
    last_s: float = 0.0


class ObjectiveWindows:
    def __init__(self, bounds: WindowBounds | None = None) -> None:
        self.bounds = b = bounds or WindowBounds()
        if not 0 < b.floor <= b.ceiling:
            raise ValueError("window bounds need 0 < floor <= ceiling")
        start = max(b.floor, min(b.ceiling, b.floor if b.start is None else b.start))
        self.windows: dict[Tier, float] = {t: start for t in TIERS_BY_PRIORITY}
        self._judged: dict[Tier, deque[_Judged]] = {t: deque() for t in TIERS_BY_PRIORITY}
        # Least recently judged first, so forgetting pops from the front.
        self._sessions: dict[Tier, OrderedDict[str, _SessionSoFar]] = {
            t: OrderedDict() for t in TIERS_BY_PRIORITY
        }
        self._bound_group: int | None = None
        self._last_s: float | None = None
        self._cut_at: dict[Tier, float] = {}
        """When each tier was last cut; a tier in it is past its slow start."""
        self._room_since: float | None = None
        """Since when the fleet has had room at every step, with no cut since."""

    def judge(self, verdict: Verdict, now_s: float) -> None:
        """One judged call (``Verdict``), at ``now_s``."""
        tier, met, session = verdict.tier, verdict.met, verdict.session
        cut_at = self._cut_at.get(tier, -math.inf)
        if verdict.admitted_s is not None and verdict.admitted_s < cut_at:
            return  # admitted under an earlier window: no evidence about this one (module doc)
        if session is None:
            self._judged[tier].append(_Judged(now_s, 1.0, 0.0 if met else 1.0))
            return
        sessions = self._sessions[tier]
        so_far = sessions.setdefault(session, _SessionSoFar())
        sessions.move_to_end(session)
        so_far.last_s = now_s
        if so_far.missed:
            self._judged[tier].append(_Judged(now_s, 0.0, 0.0))  # still a call judged
        elif met:
            share = min(1.0 / max(verdict.session_calls, 1), 1.0 - so_far.counted)
            so_far.counted += share
            self._judged[tier].append(_Judged(now_s, share, 0.0))
        else:
            so_far.missed = True
            self._judged[tier].append(_Judged(now_s, 1.0 - so_far.counted, 1.0))

    def bound(self, group: int) -> None:
        """A session was deferred because nested tier group ``group`` (0 the whole fleet, as
        ``broker.admission.tier_limits`` counts them) was full."""
        if self._bound_group is None or group > self._bound_group:
            self._bound_group = group

    def attainment(self, tier: Tier, now_s: float) -> tuple[float | None, int]:
        """The share of the tier's sessions judged in the window that met their objectives
        (``None`` with none; module doc), and how many calls were judged."""
        share, _, n = self._tally(tier, now_s)
        return share, n

    def _tally(self, tier: Tier, now_s: float) -> tuple[float | None, float, int]:
        """``attainment``, with the sessions that missed in the window."""
        judged = self._judged[tier]
        while judged and judged[0].at_s < now_s - self.bounds.window_s:
            judged.popleft()
        sessions = sum(j.sessions for j in judged)
        if sessions <= 0:
            return None, 0.0, len(judged)
        missed = sum(j.missed for j in judged)
        return max(0.0, 1.0 - missed / sessions), missed, len(judged)

    def violated(self, tier: Tier, now_s: float) -> bool:
        b = self.bounds
        share, missed, n = self._tally(tier, now_s)
        if share is None or n < b.min_calls or missed < b.min_missed:
            return False
        return share < b.target

    def meeting(self, tier: Tier, now_s: float) -> bool:
        """Enough of the tier's calls judged, and they meet the target."""
        share, n = self.attainment(tier, now_s)
        return share is not None and n >= self.bounds.min_calls and share >= self.bounds.target

    def step(self, now_s: float, *, room: bool = False) -> dict[Tier, float]:
        """One control step; returns the windows. ``room``: the fleet measurably has room now
        (see the module docstring)."""
        b = self.bounds
        elapsed = 0.0 if self._last_s is None else max(0.0, now_s - self._last_s)
        self._last_s = now_s
        if not room:
            self._room_since = None
        elif self._room_since is None:
            self._room_since = now_s
        sustained = self._room_since is not None and now_s - self._room_since >= b.room_hold_s
        cut_from: int | None = None
        for i, tier in enumerate(TIERS_BY_PRIORITY):
            if self.violated(tier, now_s):
                cut_from = i
                break
        binding: set[Tier] = set()
        if self._bound_group is not None:
            group = TIERS_BY_PRIORITY[: self._bound_group + 1]
            factor = min(self.windows[t] for t in group)
            binding = {t for t in group if self.windows[t] <= factor * (1 + 1e-9)}
        for i, tier in enumerate(TIERS_BY_PRIORITY):
            window = self.windows[tier]
            if cut_from is not None:
                cut = b.decrease if i >= cut_from else b.decrease_above
                self.windows[tier] = max(b.floor, window * cut)
                self._judged[tier].clear()
                self._cut_at[tier] = now_s
                # Sessions go on being remembered as missed: a late call of one says nothing
                # new about the smaller window.
            elif tier in binding:
                if tier not in self._cut_at and window < b.slow_start_until:
                    rate = max(b.slow_start_per_s, b.room_increase_per_s if room else 0.0)
                    grown = window * (1 + rate * elapsed)
                    self.windows[tier] = min(b.ceiling, b.slow_start_until, grown)
                    continue
                grown = window
                if sustained:
                    grown = window * (1 + b.sustained_room_per_s * elapsed)
                if self.meeting(tier, now_s):
                    grown = max(grown, window + b.increase_per_s * elapsed)
                self.windows[tier] = min(b.ceiling, grown)
        if cut_from is not None:
            self._room_since = None  # the quiet after the burst that caused it is no room
        self._bound_group = None
        self._forget_sessions(now_s)
        return dict(self.windows)

    def _forget_sessions(self, now_s: float) -> None:
        for sessions in self._sessions.values():
            while sessions and next(iter(sessions.values())).last_s < now_s - _SESSION_MEMORY_S:
                sessions.popitem(last=False)

    def group_factors(self) -> tuple[float, ...]:
        """The factor on KV capacity of each nested tier group, highest tier first: the
        smallest window among the group's own tier and every tier above it."""
        out: list[float] = []
        smallest = math.inf
        for tier in TIERS_BY_PRIORITY:
            smallest = min(smallest, self.windows[tier])
            out.append(smallest)
        return tuple(out)


class SessionPace:
    """How long admitted sessions take, learned from those that ended: seconds per declared
    output token of each round of calls (a session of ``expected_calls`` with ``max_parallel``
    in flight runs ``ceil(expected_calls / max_parallel)`` rounds of ``est_output_tokens``).
    What a session waits for besides decoding (time to first token under load, its client's
    tool time between turns, slots and queues) is in the pace too, which is the point: the
    fastest decode speed alone says a late session can finish when it cannot.

    ``current`` is the ``quantile`` of the paces of sessions ended within ``window_s`` (at most
    ``max_samples``), refreshed by ``refresh``, or ``None`` with fewer than ``min_sessions``.
    A session given up at its deadline ended slow, so it raises the pace: the estimate errs
    late, and its feedback is stable (slower sessions under load make admission stricter,
    which lightens the load).

    How busy the fleet was over a session's life (``busy``: the share of the fleet's KV its
    workers had committed, on average; ``FleetBusy``) sets its pace as much as the session
    itself does, so ``at`` answers for the fleet as busy as it is now: the quantile over the
    sessions that ran with the fleet about as busy (within ``busy_band`` either side), or,
    where fewer than ``min_sessions`` did, over the busiest ``min_sessions`` of those at most
    ``busy_band`` busier. A fleet less busy than all but a few of the sessions learned from
    reads the fastest pace among the ``min_sessions`` least busy: its sessions will run at
    least as fast as those did, and a quantile of theirs would err late and reject them on a
    guess, while the decode speed alone (no pace at all) admitted sessions with too little of
    their deadline left once a burst's arrivals ended and the fleet emptied (8 of the 28
    admitted sessions that missed their deadline at 4x in five runs,
    ``loadtests/results/pace-first-burst``). Read over every session of the window, the pace
    a burst taught outlived the burst: run right after 4x, 0.5x turned away 2, 3 and 0 of 25
    sessions as ``deadline_infeasible`` with the fleet a fifth to two fifths busy, and none in
    two runs read this way (``loadtests/results/pace-by-busy``).

    Sessions still open (``opened``; ended by ``observe`` or ``forget``) are lower bounds: one
    open for ``t`` seconds takes at least ``t`` (at most its deadline) over its round tokens.
    One already slower than the quantile of the sessions that ended is evidence that sessions
    are slowing, and counts beside them, with how busy the fleet has been since its admission;
    where fewer than ``min_sessions`` have ended, every open one counts, and ``min_first``
    sessions (ended, or open) are enough for a pace: both err fast then (the first sessions to
    end are the quickest, and an open one's bound is below its pace), so a pace read from so few
    errs toward admitting, and the fleet's first burst has one. Learned from ended
    sessions alone, a front door's first burst had no pace for as long as its first sessions
    took, and admitted sessions that came back from their clients' retries with too little of
    their deadline left: 11 of the 12 admitted sessions that missed at 4x in one run were in
    that first burst (``loadtests/results/pace-by-busy``). Only sessions their clients close
    may be opened (plain calls' one-call sessions end without a ``DELETE`` and would stay open
    to their deadlines); one whose end was never reported is forgotten a ``window_s`` after its
    deadline. At most ``max_open`` are followed: beyond, the youngest are not (they bound the
    pace least), which keeps ``refresh`` a bounded loop on the admission path's event loop."""

    def __init__(
        self,
        quantile: float,
        *,
        window_s: float = 120.0,
        min_sessions: int = 20,
        max_samples: int = 512,
        busy_band: float = 0.15,
        max_open: int = 512,
        min_first: int = 8,
    ) -> None:
        if not 0 < quantile <= 1 or not 2 <= min_first <= min_sessions:
            raise ValueError(
                "the pace needs a quantile in (0, 1] and 2 <= min_first <= min_sessions"
            )
        self.quantile = quantile
        self.window_s = window_s
        self.min_sessions = min_sessions
        self.min_first = min_first
        self._k = min_sessions
        """How many sessions a pace is read from at least: ``min_sessions``, or ``min_first``
        while fewer than that have ended (class doc)."""
        self.busy_band = busy_band
        self._paces: deque[tuple[float, float, float | None]] = deque(maxlen=max_samples)
        self.current: float | None = None
        self._by_busy: list[tuple[float, float]] = []
        """(busy, pace) of the sessions ``current`` is taken from whose busy is known, sorted."""
        self._at: dict[int, float | None] = {}
        """``at``'s answers since the last refresh, by busy in hundredths."""
        self.max_open = max_open
        self._open: dict[str, tuple[float, int, float]] = {}
        """Sessions opened and not ended, oldest first: when, their round tokens, deadline (s)."""

    def observe(
        self,
        now_s: float,
        duration_s: float,
        *,
        expected_calls: int,
        max_parallel: int,
        est_output_tokens: int,
        busy: float | None = None,
        session_id: str | None = None,
    ) -> None:
        """A session that ended ``duration_s`` after its admission; ``busy``: how busy the fleet
        was over its life (class doc), ``None`` where not known; ``session_id``: no longer open."""
        tokens = _round_tokens(expected_calls, max_parallel, est_output_tokens)
        if tokens > 0 and duration_s >= 0:
            self._paces.append((now_s, duration_s / tokens, busy))
        if session_id is not None:
            self._open.pop(session_id, None)

    def opened(
        self,
        session_id: str,
        now_s: float,
        *,
        expected_calls: int,
        max_parallel: int,
        est_output_tokens: int,
        deadline_s: float,
    ) -> None:
        """A session admitted at ``now_s``, which its client will close (class doc)."""
        tokens = _round_tokens(expected_calls, max_parallel, est_output_tokens)
        if tokens > 0 and len(self._open) < self.max_open:
            self._open[session_id] = (now_s, tokens, deadline_s)

    def forget(self, session_id: str) -> None:
        """An open session ended saying nothing of its pace here (it idled out, or was closed
        elsewhere)."""
        self._open.pop(session_id, None)

    def is_open(self, session_id: str) -> bool:
        return session_id in self._open

    def forget_open(self) -> None:
        """Every open session: their ends may have gone unheard."""
        self._open.clear()

    def refresh(
        self, now_s: float, busy_so_far: Callable[[str], float | None] | None = None
    ) -> float | None:
        """``busy_so_far``: how busy the fleet has been since an open session's admission."""
        paces = self._paces
        while paces and paces[0][0] < now_s - self.window_s:
            paces.popleft()
        self._at = {}
        ended = [(pace, busy) for _, pace, busy in paces]
        estimate = None
        if len(ended) >= self.min_sessions:
            estimate = self._quantile([pace for pace, _ in ended])
        bounds = self._lower_bounds(now_s, estimate, busy_so_far)
        samples = ended + bounds
        self._k = self.min_sessions if estimate is not None else self.min_first
        if len(samples) < self._k:
            self.current = None
            self._by_busy = []
        else:
            # With no open session counted, the samples are the ended ones: their quantile is
            # the estimate already taken.
            has_estimate = estimate is not None and not bounds
            self.current = estimate if has_estimate else self._quantile([p for p, _ in samples])
            self._by_busy = sorted((busy, pace) for pace, busy in samples if busy is not None)
        return self.current

    def _lower_bounds(
        self,
        now_s: float,
        estimate: float | None,
        busy_so_far: Callable[[str], float | None] | None,
    ) -> list[tuple[float, float | None]]:
        """The open sessions that count (class doc), as (pace so far, busy so far)."""
        bounds: list[tuple[float, float | None]] = []
        lost: list[str] = []
        for session_id, (at_s, tokens, deadline_s) in self._open.items():
            age_s = now_s - at_s
            if age_s > deadline_s + self.window_s:
                lost.append(session_id)  # its end was never reported
                continue
            bound = min(age_s, deadline_s) / tokens
            if estimate is None or bound > estimate:
                busy = None if busy_so_far is None else busy_so_far(session_id)
                bounds.append((bound, busy))
        for session_id in lost:
            del self._open[session_id]
        return bounds

    def at(self, busy: float | None) -> float | None:
        """The pace for a session admitted with the fleet ``busy`` now (class doc): ``current``
        where how busy is not known now, or for fewer than ``min_sessions`` (``min_first``
        while fewer have ended) of the sessions learned from (another replica admitted the
        rest)."""
        if self.current is None or busy is None or len(self._by_busy) < self._k:
            return self.current  # too few sessions of known busy (others closed elsewhere)
        key = round(busy * 100)
        if key not in self._at:
            self._at[key] = self._at_busy(key / 100)
        return self._at[key]

    def _at_busy(self, busy: float) -> float | None:
        by_busy, k = self._by_busy, self._k
        # The sessions that ran at most a band busier than now, nearest first: those within
        # the band on both sides, or the busiest k of them where fewer are near.
        high = bisect.bisect_right(by_busy, (busy + self.busy_band, math.inf))
        if high < k:
            # Quieter than all but a few of them: as fast as the fastest of the k least busy.
            return min(pace for _, pace in by_busy[:k])
        low = min(bisect.bisect_left(by_busy, (busy - self.busy_band, -math.inf)), high - k)
        return self._quantile([pace for _, pace in by_busy[low:high]])

    def _quantile(self, values: list[float]) -> float:
        if self.quantile >= 1:
            return max(values)
        # 99 cut points: the quantile to the percent, interpolated between sessions.
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        return cuts[max(0, round(self.quantile * 100) - 1)]


def _round_tokens(expected_calls: int, max_parallel: int, est_output_tokens: int) -> int:
    """The output tokens of a session's rounds of calls (``SessionPace``)."""
    return math.ceil(expected_calls / max(max_parallel, 1)) * est_output_tokens


class FleetBusy:
    """How busy the fleet is (the share of its KV its workers have committed), integrated over
    time: the average over a session's life, which ``SessionPace`` learns with its pace, is the
    difference of two readings of the integral, and ``now`` the average over as long as the
    sessions that ended lately lived (their median, at least ``recent_s``, at most
    ``longest_s``; ``recent_s`` until one has ended here). Pure: the clock is an argument.

    Why ``now`` spans a session's life: a pace is learned for how busy the fleet was over a
    session's whole life, and read for a session about to live about as long. Read over the
    last 5 s instead, it swung with every turn (0.2 to 0.9 within seconds at 1x), and a burst's
    sessions were judged at the pace of whichever moment they asked in. In three alternating
    pairs of CPU sweeps, admitted sessions that finished good at 4x were 60 of 69 read this way
    against 50 of 66, and 1x was unchanged (``loadtests/results/busy-over-a-life``)."""

    def __init__(
        self,
        recent_s: float = 5.0,
        max_marks: int = 100_000,
        max_mark_age_s: float = 3600.0,
        *,
        longest_s: float = 60.0,
        lives: int = 64,
    ) -> None:
        self.recent_s = recent_s
        self.longest_s = max(longest_s, recent_s)
        self.max_marks = max_marks
        self.max_mark_age_s = max_mark_age_s
        """Sessions not closed (their leases ran out) are forgotten after this long, or once
        ``max_marks`` are held, oldest first."""
        self._integral = 0.0
        self._last: tuple[float, float] | None = None
        """(when, how busy) at the last step with a reading."""
        self._recent: deque[tuple[float, float]] = deque()
        """(when, the integral then) at each step, oldest first, ``longest_s`` back and one
        more before."""
        self._marks: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lives: deque[float] = deque(maxlen=lives)
        self._span_s = recent_s

    @property
    def span_s(self) -> float:
        """How far back ``now`` averages."""
        return self._span_s

    def _integral_at(self, now_s: float) -> float:
        if self._last is None:
            return self._integral
        at_s, busy = self._last
        return self._integral + busy * max(0.0, now_s - at_s)

    def step(self, now_s: float, busy: float | None) -> None:
        """A reading; ``None`` (no fresh worker reading) carries the last one on."""
        self._integral = self._integral_at(now_s)
        if busy is not None:
            self._last = (now_s, busy)
        elif self._last is not None:
            self._last = (now_s, self._last[1])
        marks = self._marks
        while marks and next(iter(marks.values()))[0] < now_s - self.max_mark_age_s:
            marks.popitem(last=False)
        if self._last is None:
            return
        recent = self._recent
        recent.append((now_s, self._integral))
        while len(recent) > 1 and recent[1][0] <= now_s - self.longest_s:
            recent.popleft()

    def now(self, now_s: float) -> float | None:
        """The average over the last ``span_s``, or the last reading where there is no span."""
        if self._last is None:
            return None
        recent = self._recent
        # The last step at or before the span's start (the oldest where none is).
        at = bisect.bisect_right(recent, now_s - self._span_s, key=lambda step: step[0])
        since_s, integral = recent[max(0, at - 1)]
        if now_s - since_s <= 0:
            return self._last[1]
        return (self._integral_at(now_s) - integral) / (now_s - since_s)

    def mark(self, session_id: str, now_s: float) -> None:
        """``session_id`` was admitted at ``now_s``."""
        self._marks[session_id] = (now_s, self._integral_at(now_s))
        while len(self._marks) > self.max_marks:
            self._marks.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """``session_id`` ended, and how busy the fleet was over its life is not wanted."""
        self._marks.pop(session_id, None)

    def since(self, session_id: str, now_s: float) -> float | None:
        """The average since ``session_id`` was marked, forgetting the mark: the session
        ended. ``None`` for one not marked here (another replica admitted it, or it was
        forgotten for its age), or with no reading yet."""
        mark = self._marks.pop(session_id, None)
        if mark is not None and now_s > mark[0]:
            self._lives.append(now_s - mark[0])
            median = statistics.median(self._lives)
            self._span_s = min(self.longest_s, max(self.recent_s, median))
        return self._average(mark, now_s)

    def so_far(self, session_id: str, now_s: float) -> float | None:
        """As ``since``, for a session still open: the mark is kept."""
        return self._average(self._marks.get(session_id), now_s)

    def _average(self, mark: tuple[float, float] | None, now_s: float) -> float | None:
        if mark is None or self._last is None:
            return None
        at_s, integral = mark
        if now_s - at_s <= 0:
            return self.now(now_s)
        return (self._integral_at(now_s) - integral) / (now_s - at_s)
