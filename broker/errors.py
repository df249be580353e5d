"""kvgate's error tree. The class is the classification: every ``ErrorCode`` has exactly one
class, which carries it as ``code``, so ``except InvalidRequest`` catches every error the caller
must fix. ``error_class`` finds a code's class (for a code that arrives as data: a worker's
``Failed`` event, an admission ``Reason``); ``api.errors`` maps codes to HTTP statuses, in one
place.

::

    KvgateError                   code, message, param; retry_after and decision (None here)
    ├── InvalidRequest            invalid_request: the caller must change the request (4xx)
    │   ├── InvalidJson           invalid_json
    │   ├── MissingMessages       missing_messages
    │   ├── InvalidMessages       invalid_messages
    │   ├── InvalidMaxTokens      invalid_max_tokens
    │   ├── MaxTokensTooLarge     max_tokens_too_large
    │   ├── InvalidParameter      invalid_parameter
    │   ├── InvalidTier           invalid_tier
    │   ├── UnsupportedParameter  unsupported_parameter
    │   ├── ContextLengthExceeded context_length_exceeded
    │   ├── ModelNotFound         model_not_found
    │   ├── BodyTooLarge          body_too_large
    │   ├── UnsupportedMediaType  unsupported_media_type
    │   ├── NotFound              not_found
    │   ├── MethodNotAllowed      method_not_allowed
    │   ├── Unauthorized          unauthorized
    │   ├── TierNotAllowed        tier_not_allowed
    │   ├── SessionNotFound       session_not_found
    │   ├── BatchNotFound         batch_not_found
    │   ├── SessionClosed         session_closed
    │   ├── SessionExpired        session_expired
    │   └── CallExceedsSession    call_exceeds_session: one call weighs more than its session
    │                             may hold in flight (its declaration times the overrun)
    ├── Refused                   admission said no: decision, and retry_after where waiting
    │   │                         helps (None where it cannot); one class per refusal Reason
    │   ├── TenantQuota           tenant_quota
    │   ├── TierCapacity          tier_capacity
    │   ├── FleetSaturated        fleet_saturated
    │   ├── DeadlineInfeasible    deadline_infeasible
    │   ├── ExceedsCapacity       exceeds_capacity
    │   ├── NoWorkers             no_workers
    │   ├── Draining              draining
    │   └── AdmissionUnavailable  admission_unavailable: the shared admission state (Redis)
    │                             cannot be reached; no decision unless admission answered
    ├── RetryableError            the same request may succeed later: retry_after (s)
    │   ├── BrokerUnavailable     broker_unavailable: NATS/JetStream cannot be reached
    │   ├── QueueFull             queue_full: the stream refused the call (discard-new)
    │   ├── DeadlineExceeded      deadline_exceeded: not started before its deadline
    │   ├── TooManyWaitingCalls   too_many_waiting_calls: too many calls already wait for a
    │   │                         call slot (of the session, or on this front door): 429
    │   └── TooManyOpenBatches    too_many_open_batches: the tenant has as many batches not
    │                             yet ended as it may have: 429
    ├── ServerError               the call failed on kvgate's side, not the caller's (5xx)
    │   ├── WorkerLost            worker_lost: the worker went silent or its reply broke off
    │   ├── EngineError           engine_error: the engine failed; a worker retries the call
    │   │   │                     on another worker (vLLM's EngineGenerateError)
    │   │   ├── EngineRequestError  (workers.engine) the serving layer refused the call: its
    │   │   │                       code is the request code the caller sees; never retried
    │   │   └── EngineDeadError     (workers.engine) fatal: the engine is gone, the worker
    │   │                           exits (vLLM's EngineDeadError)
    │   └── InternalError         internal_error: a bug, or a message that cannot be read
    │       └── NatsServerError     (broker.natsserver) the nats-server binary would not start
    └── Cancelled                 cancelled: the caller cancelled the call or went away

A class in parentheses lives beside what raises it and adds no code of its own.
"""

from __future__ import annotations

from typing import Any, TypeVar

from schemas.vocab import ErrorCode

_CLASSES: dict[ErrorCode, type[KvgateError]] = {}

E = TypeVar("E", bound="KvgateError")


class KvgateError(Exception):
    """The root; never raised itself (nor is a group below it): raise the class of a code."""

    code: ErrorCode
    """Set in the body of exactly one class per code; ``EngineRequestError`` sets it per error."""
    retry_after: int | None = None
    """Seconds after which the same request may succeed (the ``Retry-After`` header)."""
    decision: str | None = None
    """``defer`` or ``reject`` when admission refused."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            claimed = _CLASSES.setdefault(code, cls)
            if claimed is not cls:
                raise TypeError(f"{cls.__name__} and {claimed.__name__} both claim {code}")

    def __init__(self, message: str, *, param: str | None = None) -> None:
        if not hasattr(type(self), "code"):
            raise TypeError(f"{type(self).__name__} is a group: raise the class of a code")
        super().__init__(message)
        self.message = message
        self.param = param


def error_class(code: ErrorCode, group: type[E]) -> type[E]:
    """The one class of ``code``, which must be in ``group`` (``KvgateError`` for any)."""
    cls = _CLASSES[code]
    if not issubclass(cls, group):
        raise TypeError(f"{code} is a {cls.__name__}, not a {group.__name__}")
    return cls


# -- the caller must change the request ------------------------------------------------------


class InvalidRequest(KvgateError):
    code = ErrorCode.INVALID_REQUEST


class InvalidJson(InvalidRequest):
    code = ErrorCode.INVALID_JSON


class MissingMessages(InvalidRequest):
    code = ErrorCode.MISSING_MESSAGES


class InvalidMessages(InvalidRequest):
    code = ErrorCode.INVALID_MESSAGES


class InvalidMaxTokens(InvalidRequest):
    code = ErrorCode.INVALID_MAX_TOKENS


class MaxTokensTooLarge(InvalidRequest):
    code = ErrorCode.MAX_TOKENS_TOO_LARGE


class InvalidParameter(InvalidRequest):
    code = ErrorCode.INVALID_PARAMETER


class InvalidTier(InvalidRequest):
    code = ErrorCode.INVALID_TIER


class UnsupportedParameter(InvalidRequest):
    code = ErrorCode.UNSUPPORTED_PARAMETER


class ContextLengthExceeded(InvalidRequest):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class ModelNotFound(InvalidRequest):
    code = ErrorCode.MODEL_NOT_FOUND


class BodyTooLarge(InvalidRequest):
    code = ErrorCode.BODY_TOO_LARGE


class UnsupportedMediaType(InvalidRequest):
    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class NotFound(InvalidRequest):
    code = ErrorCode.NOT_FOUND


class MethodNotAllowed(InvalidRequest):
    code = ErrorCode.METHOD_NOT_ALLOWED


class Unauthorized(InvalidRequest):
    code = ErrorCode.UNAUTHORIZED


class TierNotAllowed(InvalidRequest):
    code = ErrorCode.TIER_NOT_ALLOWED


class SessionNotFound(InvalidRequest):
    code = ErrorCode.SESSION_NOT_FOUND


class BatchNotFound(InvalidRequest):
    code = ErrorCode.BATCH_NOT_FOUND


class SessionClosed(InvalidRequest):
    code = ErrorCode.SESSION_CLOSED


class SessionExpired(InvalidRequest):
    code = ErrorCode.SESSION_EXPIRED


class CallExceedsSession(InvalidRequest):
    """Waiting cannot help: the call alone is more than its session may ever hold in flight.
    The caller sends a smaller call, or opens a session that declares calls of this size."""

    code = ErrorCode.CALL_EXCEEDS_SESSION


# -- admission said no -----------------------------------------------------------------------


class Refused(KvgateError):
    """Admission said no. ``retry_after`` is ``None`` where waiting cannot help (a session
    that could not meet its deadline even on an idle fleet); left out, it is the class's."""

    def __init__(
        self,
        message: str,
        *,
        decision: str | None = None,
        retry_after: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.decision = decision
        if retry_after is not None:
            self.retry_after = retry_after


class TenantQuota(Refused):
    code = ErrorCode.TENANT_QUOTA


class TierCapacity(Refused):
    code = ErrorCode.TIER_CAPACITY


class FleetSaturated(Refused):
    code = ErrorCode.FLEET_SATURATED


class DeadlineInfeasible(Refused):
    code = ErrorCode.DEADLINE_INFEASIBLE


class ExceedsCapacity(Refused):
    code = ErrorCode.EXCEEDS_CAPACITY


class NoWorkers(Refused):
    code = ErrorCode.NO_WORKERS


class Draining(Refused):
    code = ErrorCode.DRAINING


class AdmissionUnavailable(Refused):
    """Raised with no decision by the admission state store (a session's lease could not be
    read); admission answers it as a deferral."""

    code = ErrorCode.ADMISSION_UNAVAILABLE
    retry_after = 5


# -- the same request may succeed later ------------------------------------------------------


class RetryableError(KvgateError):
    """``retry_after``, left out, is the class's."""

    retry_after: int

    def __init__(
        self, message: str, *, retry_after: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        if retry_after is not None:
            self.retry_after = retry_after


class BrokerUnavailable(RetryableError):
    code = ErrorCode.BROKER_UNAVAILABLE
    retry_after = 2


class QueueFull(RetryableError):
    code = ErrorCode.QUEUE_FULL
    retry_after = 5


class DeadlineExceeded(RetryableError):
    code = ErrorCode.DEADLINE_EXCEEDED
    retry_after = 1


class TooManyWaitingCalls(RetryableError):
    """Refused before it waited: a call slot frees when one of the session's calls ends, so
    the same call may well be taken a second later."""

    code = ErrorCode.TOO_MANY_WAITING_CALLS
    retry_after = 1


class TooManyOpenBatches(RetryableError):
    """Refused before the batch was parsed (and checked again as it is stored): room comes back
    when one of the tenant's batches ends, which takes minutes at least, so a minute is the
    soonest a retry is worth it."""

    code = ErrorCode.TOO_MANY_OPEN_BATCHES
    retry_after = 60


# -- kvgate's side failed --------------------------------------------------------------------


class ServerError(KvgateError):
    pass


class WorkerLost(ServerError):
    code = ErrorCode.WORKER_LOST


class EngineError(ServerError):
    """Any failure of the engine; a plain ``EngineError`` is worth retrying elsewhere. The
    engine's own refinements (``EngineRequestError``, ``EngineDeadError``) are in
    ``workers.engine``; this one is here because the front door rebuilds it from a worker's
    ``engine_error`` event."""

    code = ErrorCode.ENGINE_ERROR


class InternalError(ServerError):
    code = ErrorCode.INTERNAL_ERROR


class Cancelled(KvgateError):
    code = ErrorCode.CANCELLED
