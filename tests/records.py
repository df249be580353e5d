"""Session records for the admission state's tests, on a fixed clock."""

from __future__ import annotations

from broker.admission.state import SessionRecord
from schemas.vocab import SessionState, Tier

T0 = 1_800_000_000_000
"""A fixed clock, ms: every operation of the stores takes ``now`` explicitly."""


def session(
    sid: str,
    *,
    tier: Tier = Tier.STANDARD,
    tokens: int = 1_000,
    parallel: int = 2,
    tenant: str = "acme",
    now: int = T0,
    deadline_s: float = 300,
    idle_s: float = 30,
) -> SessionRecord:
    deadline = now + int(deadline_s * 1000)
    return SessionRecord(
        id=sid,
        tenant=tenant,
        tier=tier,
        state=SessionState.ACTIVE,
        max_parallel=parallel,
        expected_calls=4,
        est_prompt_tokens=tokens // parallel - 10,
        est_output_tokens=10,
        reserved_tokens=tokens,
        created_ms=now,
        deadline_ms=deadline,
        idle_timeout_ms=int(idle_s * 1000),
        expires_ms=min(deadline, now + int(idle_s * 1000)),
        metadata={"agent": "coder", "attempt": 1},
    )
