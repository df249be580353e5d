"""What a load point measured, from the agents' outcomes: pure functions, no I/O.

Definitions (the report repeats them):

- A call **met its objectives** when it completed, its TTFT was within its tier's TTFT
  objective and its TPOT within its tier's TPOT objective (a one-token answer has no TPOT and
  meets it). The objectives are the ones kvgate is configured with (``Objectives``); kvgate's
  own judgement of a call (``broker.admission.objectives.Objective.met``) decides it.
- A session is **good** when every one of its calls met its objectives and it ended before its
  deadline. A session refused by admission, or given up, is not good: refused work counts in
  every denominator as offered and not served.
- **Session goodput**: good sessions per second of the arrival window, and as a fraction of the
  sessions offered. The offered rate is over the same window (the sessions that arrived in it,
  not the nominal rate), so goodput per second never exceeds it.
- **Call goodput**: calls that met their objectives / all calls of all offered sessions (the
  calls a refused or abandoned session never sent included).
- **Wasted tokens**: output tokens generated for sessions that were not good, as a share of all
  output tokens generated. "Generated" is the engine's own counter when the point read one
  (tokens of calls cut short included), else what the clients received.
- Percentiles (p50, p95, p99) are over the calls that completed, by ``loadtests.stats``'s
  definition (linear interpolation between closest ranks, numpy's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.admission.objectives import Objective
from broker.admission.tenants import Tenancy
from loadtests import stats
from loadtests.agent import CallOutcome, CallStatus, SessionOutcome
from schemas.vocab import Tier


@dataclass(frozen=True)
class Objectives:
    """Each tier's objective, as kvgate is configured with it."""

    by_tier: Mapping[str, Objective]

    @classmethod
    def same(cls, ttft_s: float, tpot_s: float) -> Objectives:
        return cls({t.value: Objective(ttft_s, tpot_s) for t in Tier})

    @classmethod
    def of(cls, tenancy: Tenancy) -> Objectives:
        """The tiers' objectives of a tenants file, as kvgate's front door reads them."""
        return cls(
            {
                t.value: Objective(p.ttft_ms / 1000, p.tpot_ms / 1000)
                for t, p in tenancy.tiers.items()
            }
        )

    def to_json(self) -> dict[str, dict[str, float]]:
        return {t: {"ttft_s": o.ttft_s, "tpot_s": o.tpot_s} for t, o in self.by_tier.items()}

    def met(self, call: CallOutcome) -> bool:
        if call.status is not CallStatus.OK:
            return False
        return self.by_tier[call.tier].met(call.ttft_s, call.tpot_s)

    def good(self, session: SessionOutcome) -> bool:
        return session.completed and all(self.met(call) for call in session.calls)


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """``n``, p50, p95 and p99, to the microsecond for values in seconds."""
    return stats.summary(values, (50, 95, 99), ndigits=6)


def _ratio(part: float, whole: float) -> float | None:
    return None if whole == 0 else part / whole


def summarize(
    sessions: Sequence[SessionOutcome],
    objectives: Objectives,
    *,
    window_s: float,
    generated_tokens: int | None = None,
    busy_s: float | None = None,
) -> dict[str, Any]:
    """One load point's metrics. ``window_s`` is the arrival window (goodput per second);
    ``generated_tokens`` the engine's output-token counter over the point, if read;
    ``busy_s`` the time from the first call sent to the last session's end (throughput)."""
    calls = [call for session in sessions for call in session.calls]
    good = [session for session in sessions if objectives.good(session)]
    received = sum(call.completion_tokens for call in calls)
    generated = received if generated_tokens is None else generated_tokens
    good_tokens = sum(call.completion_tokens for session in good for call in session.calls)
    completed = [call for call in calls if call.status is CallStatus.OK]
    refused_sessions = [session for session in sessions if not session.admitted]
    admitted_sessions = [session for session in sessions if session.admitted]
    deferred_sessions = [
        s for s in sessions if s.deferrals or any(c.retries for c in s.calls) or not s.admitted
    ]
    retries = sum(s.session_retries + sum(c.retries for c in s.calls) for s in sessions)
    tiers = sorted({session.tier for session in sessions})
    by_tier: dict[str, Any] = {}
    for tier in tiers:
        tier_sessions = [s for s in sessions if s.tier == tier]
        tier_calls = [c for s in tier_sessions for c in s.calls]
        tier_done = [c for c in tier_calls if c.status is CallStatus.OK]
        by_tier[tier] = {
            "sessions": len(tier_sessions),
            "good_sessions": sum(objectives.good(s) for s in tier_sessions),
            "calls": len(tier_calls),
            "calls_met": sum(objectives.met(c) for c in tier_calls),
            "ttft_met_share_of_completed": _ratio(
                sum(
                    1
                    for c in tier_done
                    if c.ttft_s is not None and c.ttft_s <= objectives.by_tier[tier].ttft_s
                ),
                len(tier_done),
            ),
            "ttft_s": latency_summary([c.ttft_s for c in tier_done if c.ttft_s is not None]),
            "tpot_s": latency_summary([c.tpot_s for c in tier_done if c.tpot_s is not None]),
        }
    return {
        "sessions_offered": len(sessions),
        "offered_per_s": len(sessions) / window_s if window_s > 0 else None,
        "sessions_good": len(good),
        "session_goodput_per_s": len(good) / window_s if window_s > 0 else None,
        "session_goodput_fraction": _ratio(len(good), len(sessions)),
        # kvgate's promise: a session it says yes to finishes within its objectives.
        "admitted_good_fraction": _ratio(
            sum(objectives.good(s) for s in admitted_sessions), len(admitted_sessions)
        ),
        "calls_offered": len(calls),
        "calls_completed": len(completed),
        "calls_met": sum(objectives.met(call) for call in calls),
        "call_goodput": _ratio(sum(objectives.met(call) for call in calls), len(calls)),
        "calls_by_status": _count(call.status.value for call in calls),
        "tokens_generated": generated,
        "tokens_generated_source": "client" if generated_tokens is None else "engine",
        "tokens_received": received,
        "tokens_good": good_tokens,
        "wasted_token_share": _ratio(max(generated - good_tokens, 0), generated),
        "output_tokens_per_s": None if not busy_s else generated / busy_s,
        "sessions_refused": len(refused_sessions),
        "refusal_rate": _ratio(len(refused_sessions), len(sessions)),
        "refusal_codes": _count(s.refusal_code or "none" for s in refused_sessions),
        "sessions_deferred": len(deferred_sessions),
        "defer_rate": _ratio(len(deferred_sessions), len(sessions)),
        "retries_sent": retries,
        "deadline_missed": sum(s.deadline_missed for s in sessions),
        "admission_wait_s": latency_summary([s.admission_wait_s for s in sessions if s.admitted]),
        "ttft_s": latency_summary([c.ttft_s for c in completed if c.ttft_s is not None]),
        "tpot_s": latency_summary([c.tpot_s for c in completed if c.tpot_s is not None]),
        "by_tier": by_tier,
    }


def _count(values: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


def spread(values: Iterable[float | None]) -> dict[str, float | None]:
    """min / median / max over repeats (None values, from empty points, left out)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return {"min": None, "median": None, "max": None, "n": 0}
    median = stats.percentile(present, 50)
    return {"min": present[0], "median": median, "max": present[-1], "n": len(present)}
