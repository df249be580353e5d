"""kvgate's error tree. Every error carries a stable ``ErrorCode``; ``api.errors`` maps codes to
HTTP statuses in one place.

::

    KvgateError                  code, message, param
    ├── InvalidRequest           the caller must change the request (4xx)
    └── RetryableError           the same request may succeed later; carries retry_after (s)
        ├── BrokerUnavailable    NATS/JetStream cannot be reached or did not answer
        ├── QueueFull            the stream refused the call (discard-new at its limits)
        ├── DeadlineExceeded     no worker finished starting the call before its deadline
        ├── AdmissionUnavailable the shared admission state (Redis) cannot be reached
    └── Refused                  admission deferred or rejected; carries the decision and,
                                 where waiting helps, retry_after

A ``Failed`` reply event from a worker becomes a ``KvgateError`` with the worker's code, so the
front door answers it the same way it answers its own errors.
"""

from __future__ import annotations

from schemas.vocab import ErrorCode


class KvgateError(Exception):
    retry_after: int | None = None
    """Seconds after which the same request may succeed (the ``Retry-After`` header)."""
    decision: str | None = None
    """``defer`` or ``reject`` when admission refused."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class InvalidRequest(KvgateError):
    pass


class RetryableError(KvgateError):
    retry_after: int

    def __init__(
        self, code: ErrorCode, message: str, *, retry_after: int, param: str | None = None
    ) -> None:
        super().__init__(code, message, param=param)
        self.retry_after = retry_after


class BrokerUnavailable(RetryableError):
    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(ErrorCode.BROKER_UNAVAILABLE, message, retry_after=retry_after)


class QueueFull(RetryableError):
    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(ErrorCode.QUEUE_FULL, message, retry_after=retry_after)


class DeadlineExceeded(RetryableError):
    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(ErrorCode.DEADLINE_EXCEEDED, message, retry_after=retry_after)


class AdmissionUnavailable(RetryableError):
    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(ErrorCode.ADMISSION_UNAVAILABLE, message, retry_after=retry_after)


class Refused(KvgateError):
    """Admission said no. ``retry_after`` is ``None`` where waiting cannot help (a session
    that could not meet its deadline even on an idle fleet)."""

    def __init__(
        self, code: ErrorCode, message: str, *, decision: str, retry_after: int | None
    ) -> None:
        super().__init__(code, message)
        self.decision = decision
        self.retry_after = retry_after
