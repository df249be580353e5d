"""Every ``SessionNeed`` admission decides on is built here: what a session request declares,
what a plain call asks for, and what a batch's open lines will publish.

A need is what the policy reserves against (``broker.admission.policy``): its peak is
``max_parallel`` calls of ``est_prompt_tokens + est_output_tokens`` each. Building all three
in one module keeps their defaults and limits side by side, so a change to one is seen
against the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.admission.policy import SessionNeed
from broker.admission.tenants import Tenancy, Tenant
from broker.errors import InvalidParameter
from broker.settings import ApiSettings
from schemas.sessions import SessionCreate
from schemas.vocab import Tier
from schemas.wire import CallEnvelope


def for_session(
    body: SessionCreate, tenant: Tenant, tenancy: Tenancy, settings: ApiSettings
) -> SessionNeed:
    """A session as its client declared it, defaults filled in from the settings and the
    tier. A declaration past the operator's limits is refused by name (400), never cut."""
    tenant.require_tier(body.tier)
    if body.max_parallel > settings.session_max_parallel:
        raise InvalidParameter(
            f"max_parallel must be at most {settings.session_max_parallel}",
            param="max_parallel",
        )
    if body.min_parallel is not None and body.min_parallel > body.max_parallel:
        raise InvalidParameter(
            f"min_parallel ({body.min_parallel}) must not exceed max_parallel "
            f"({body.max_parallel})",
            param="min_parallel",
        )
    deadline_s = body.deadline_s or tenancy.tiers[body.tier].default_deadline_s
    if deadline_s > settings.max_deadline_s:
        raise InvalidParameter(
            f"deadline_s must be at most {settings.max_deadline_s:g}",
            param="deadline_s",
        )
    if body.idle_timeout_s is not None and body.idle_timeout_s > settings.max_deadline_s:
        # No lease outlives its deadline, so a longer idle timeout means nothing (and one
        # near the float's limit overflowed to a 500).
        raise InvalidParameter(
            f"idle_timeout_s must be at most {settings.max_deadline_s:g}",
            param="idle_timeout_s",
        )
    output = body.est_output_tokens or settings.session_default_output_tokens
    if output > settings.max_tokens_limit:
        raise InvalidParameter(
            f"est_output_tokens must be at most {settings.max_tokens_limit}",
            param="est_output_tokens",
        )
    return SessionNeed(
        tier=body.tier,
        max_parallel=body.max_parallel,
        expected_calls=body.expected_calls or body.max_parallel,
        est_prompt_tokens=body.est_prompt_tokens or settings.session_default_prompt_tokens,
        est_output_tokens=output,
        deadline_s=deadline_s,
        min_parallel=body.min_parallel or 1,
    )


def for_call(tier: Tier, prompt_tokens: int, max_tokens: int, deadline_s: float) -> SessionNeed:
    """A call with no session is a session of one call, admitted by the same policy. It may
    queue (``SessionNeed.may_queue``): its client asked for one answer, not for a session."""
    return SessionNeed(
        tier=tier,
        max_parallel=1,
        expected_calls=1,
        est_prompt_tokens=prompt_tokens,
        est_output_tokens=max_tokens,
        deadline_s=deadline_s,
        may_queue=True,
    )


def for_batch(
    tier: Tier, calls: Sequence[CallEnvelope], *, lines: int, widest: int, left_s: float
) -> SessionNeed:
    """A batch's open lines as one session: ``calls`` as they will be published, ``lines``
    still open, ``widest`` the largest group the runner publishes at once, ``left_s`` until
    the batch expires."""
    return SessionNeed(
        tier=tier,
        max_parallel=widest,
        expected_calls=lines,
        est_prompt_tokens=max(call.est_prompt_tokens for call in calls),
        est_output_tokens=max(call.max_tokens for call in calls),
        deadline_s=max(1.0, left_s),
        # The runner publishes a parallel group at once, outside any call slot: a lease shaped
        # to fewer calls would not be honoured, so it is not shaped.
        min_parallel=widest,
    )
