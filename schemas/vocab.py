"""Closed vocabularies: tiers, reply event kinds and error codes.

A code that is not listed here is a bug, not a new code: every error a caller can see carries
one of these values, so clients and dashboards can switch on them.
"""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    """Service tiers, highest first. The order is the serving priority."""

    GUARANTEED = "guaranteed"
    STANDARD = "standard"
    BESTEFFORT = "besteffort"

    @property
    def priority(self) -> int:
        """The tier's rank, highest tier 0 (lower is served first); the engine priority
        builds on it (``workers.headroom.engine_priority``)."""
        return _TIER_ORDER.index(self)


_TIER_ORDER: tuple[Tier, ...] = (Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT)
TIERS_BY_PRIORITY: tuple[Tier, ...] = _TIER_ORDER


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"


class Endpoint(enum.StrEnum):
    """The OpenAI API a call was made to; the worker serves it with vLLM's matching class."""

    CHAT_COMPLETIONS = "chat.completions"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    """Anthropic's Messages API, as vLLM serves it."""

    @property
    def path(self) -> str:
        return _ENDPOINT_PATHS[self]


_ENDPOINT_PATHS = {
    Endpoint.CHAT_COMPLETIONS: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.MESSAGES: "/v1/messages",
}


class ErrorCode(enum.StrEnum):
    """Every error code kvgate puts in front of a caller, on HTTP or in a reply event. Each has
    exactly one exception class in ``broker.errors``."""

    # Request shape (HTTP 400/404/413/415/422).
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    MISSING_MESSAGES = "missing_messages"
    INVALID_MESSAGES = "invalid_messages"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    INVALID_PARAMETER = "invalid_parameter"
    INVALID_TIER = "invalid_tier"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    NOT_FOUND = "not_found"
    UNAUTHORIZED = "unauthorized"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    TIER_NOT_ALLOWED = "tier_not_allowed"
    SESSION_NOT_FOUND = "session_not_found"
    BATCH_NOT_FOUND = "batch_not_found"
    SESSION_CLOSED = "session_closed"
    SESSION_EXPIRED = "session_expired"
    CALL_EXCEEDS_SESSION = "call_exceeds_session"
    # Admission refusals (HTTP 429/503): the values of ``Reason`` other than ``admitted``.
    TENANT_QUOTA = "tenant_quota"
    TIER_CAPACITY = "tier_capacity"
    FLEET_SATURATED = "fleet_saturated"
    DEADLINE_INFEASIBLE = "deadline_infeasible"
    EXCEEDS_CAPACITY = "exceeds_capacity"
    NO_WORKERS = "no_workers"
    DRAINING = "draining"
    ADMISSION_UNAVAILABLE = "admission_unavailable"
    # A call of an admitted session that may not wait for one of its slots (HTTP 429).
    TOO_MANY_WAITING_CALLS = "too_many_waiting_calls"
    # A batch past the tenant's limit on batches not yet ended (HTTP 429).
    TOO_MANY_OPEN_BATCHES = "too_many_open_batches"
    # Serving (HTTP 5xx, or an `error` reply event).
    DEADLINE_EXCEEDED = "deadline_exceeded"
    QUEUE_FULL = "queue_full"
    BROKER_UNAVAILABLE = "broker_unavailable"
    WORKER_LOST = "worker_lost"
    ENGINE_ERROR = "engine_error"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"


class Decision(enum.StrEnum):
    """What admission answers a session (or a call with no session)."""

    ADMIT = "admit"
    DEFER = "defer"
    """Not now, but soon: 503 with an honest ``Retry-After``."""
    REJECT = "reject"
    """Not like this: 429 when the tenant is over its share, 503 when the fleet cannot take it."""


class Reason(enum.StrEnum):
    """Why admission decided what it did. A refusal's reason is the ``ErrorCode`` its caller
    sees (its class in ``broker.errors`` is a ``Refused``), so its value is taken from there."""

    ADMITTED = "admitted"
    ADMITTED_DEGRADED = "admitted_degraded"
    """Admitted against this replica's local budget while the shared state was unreachable."""
    TENANT_QUOTA = ErrorCode.TENANT_QUOTA.value
    TIER_CAPACITY = ErrorCode.TIER_CAPACITY.value
    FLEET_SATURATED = ErrorCode.FLEET_SATURATED.value
    DEADLINE_INFEASIBLE = ErrorCode.DEADLINE_INFEASIBLE.value
    EXCEEDS_CAPACITY = ErrorCode.EXCEEDS_CAPACITY.value
    NO_WORKERS = ErrorCode.NO_WORKERS.value
    DRAINING = ErrorCode.DRAINING.value
    ADMISSION_UNAVAILABLE = ErrorCode.ADMISSION_UNAVAILABLE.value

    @property
    def error_code(self) -> ErrorCode:
        return ErrorCode(self.value)


class SessionState(enum.StrEnum):
    ACTIVE = "active"
    CLOSED = "closed"
    EXPIRED = "expired"
