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
        """vLLM request priority: lower is served first."""
        return _TIER_ORDER.index(self)

    @property
    def subject(self) -> str:
        return f"kvgate.calls.{self.value}"

    @property
    def consumer(self) -> str:
        return f"kvgate-{self.value}"


_TIER_ORDER: tuple[Tier, ...] = (Tier.GUARANTEED, Tier.STANDARD, Tier.BESTEFFORT)
TIERS_BY_PRIORITY: tuple[Tier, ...] = _TIER_ORDER


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


class ErrorCode(enum.StrEnum):
    """Every error code kvgate puts in front of a caller, on HTTP or in a reply event."""

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
    # Serving (HTTP 5xx, or an `error` reply event).
    DEADLINE_EXCEEDED = "deadline_exceeded"
    QUEUE_FULL = "queue_full"
    BROKER_UNAVAILABLE = "broker_unavailable"
    WORKER_LOST = "worker_lost"
    ENGINE_ERROR = "engine_error"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"
