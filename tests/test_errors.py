"""The error tree: one class per code, the class is the classification, and what reaches a
client (status, code, body) is the code's. Pure: no server."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from api.calls import failure_error
from api.errors import STATUS_BY_CODE, error_body, error_response
from broker.admission.tenants import Tenant
from broker.errors import (
    AdmissionUnavailable,
    BrokerUnavailable,
    Cancelled,
    DeadlineExceeded,
    EngineError,
    InternalError,
    InvalidRequest,
    KvgateError,
    QueueFull,
    Refused,
    RetryableError,
    ServerError,
    SessionNotFound,
    TenantQuota,
    TierNotAllowed,
    error_class,
)
from broker.natsserver import EmbeddedNats, NatsServerError
from schemas.vocab import ErrorCode, Reason, Tier
from schemas.wire import Failed
from workers.engine import EngineDeadError, EngineRequestError

GROUPS: dict[type[KvgateError], set[int]] = {
    InvalidRequest: {400, 401, 403, 404, 405, 409, 410, 413, 415},
    Refused: {429, 503},
    RetryableError: {429, 503, 504},
    ServerError: {500, 502},
    Cancelled: {499},
}
"""Each branch of the tree and the HTTP statuses its codes may have."""


def tree() -> list[type[KvgateError]]:
    found: list[type[KvgateError]] = []
    todo = [KvgateError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def code_classes() -> dict[ErrorCode, list[type[KvgateError]]]:
    """The classes that claim each code (set it in their own body)."""
    claims: dict[ErrorCode, list[type[KvgateError]]] = {}
    for cls in tree():
        if "code" in vars(cls):
            claims.setdefault(cls.code, []).append(cls)
    return claims


def test_every_code_has_exactly_one_class_and_the_lookup_finds_it() -> None:
    claims = code_classes()
    assert set(claims) == set(ErrorCode)
    for code, classes in claims.items():
        assert len(classes) == 1, f"{code}: {classes}"
        assert error_class(code, KvgateError) is classes[0]
        assert classes[0]("x").code is code


def test_a_second_class_for_a_code_is_refused_when_it_is_defined() -> None:
    with pytest.raises(TypeError, match="both claim"):

        class Again(InvalidRequest):
            code = ErrorCode.SESSION_NOT_FOUND

    assert error_class(ErrorCode.SESSION_NOT_FOUND, KvgateError) is SessionNotFound
    # The refused class is still listed as a subclass until it is collected: collect it, so
    # that the walks of the tree in the other tests do not see it.
    gc.collect()
    assert [c for c in InvalidRequest.__subclasses__() if c.__name__ == "Again"] == []


@pytest.mark.parametrize("group", [KvgateError, Refused, RetryableError, ServerError])
def test_a_group_cannot_be_raised_without_a_code(group: type[KvgateError]) -> None:
    with pytest.raises(TypeError, match="group"):
        group("unclassified")


def test_the_lookup_checks_the_group() -> None:
    assert error_class(ErrorCode.TENANT_QUOTA, Refused) is TenantQuota
    with pytest.raises(TypeError):
        error_class(ErrorCode.SESSION_NOT_FOUND, Refused)


def test_every_code_has_one_http_status_that_fits_its_branch() -> None:
    assert set(STATUS_BY_CODE) == set(ErrorCode)
    for code, [cls] in code_classes().items():
        [group] = [g for g in GROUPS if issubclass(cls, g)]
        assert STATUS_BY_CODE[code] in GROUPS[group], f"{cls.__name__} ({code})"
        assert error_response(cls("x")).status_code == STATUS_BY_CODE[code]


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.TIER_NOT_ALLOWED,
        ErrorCode.SESSION_NOT_FOUND,
        ErrorCode.SESSION_CLOSED,
        ErrorCode.SESSION_EXPIRED,
        ErrorCode.BATCH_NOT_FOUND,
        ErrorCode.NOT_FOUND,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.MODEL_NOT_FOUND,
    ],
)
def test_except_invalid_request_catches_every_4xx_the_caller_must_fix(code: ErrorCode) -> None:
    # These were raised as bare KvgateErrors, which ``except InvalidRequest`` let through.
    with pytest.raises(InvalidRequest):
        raise error_class(code, KvgateError)("x")


def test_a_tenant_refused_a_tier_raises_an_invalid_request() -> None:
    tenant = Tenant(id="t", key_sha256="0" * 64, max_tier=Tier.STANDARD)
    with pytest.raises(InvalidRequest) as caught:
        tenant.require_tier(Tier.GUARANTEED)
    assert isinstance(caught.value, TierNotAllowed)
    assert (caught.value.code, caught.value.param) == (ErrorCode.TIER_NOT_ALLOWED, "tier")


def test_every_refusal_reason_is_the_code_of_a_refused_class() -> None:
    refusals = {r for r in Reason if r not in (Reason.ADMITTED, Reason.ADMITTED_DEGRADED)}
    for reason in refusals:
        assert issubclass(error_class(reason.error_code, KvgateError), Refused)
    refused_codes = {code for code, [cls] in code_classes().items() if issubclass(cls, Refused)}
    assert refused_codes == {r.error_code for r in refusals}


def test_engine_errors_are_server_errors_with_the_engine_code() -> None:
    assert issubclass(EngineError, ServerError)
    dead = EngineDeadError("the engine died")
    assert isinstance(dead, EngineError) and dead.code is ErrorCode.ENGINE_ERROR
    assert not isinstance(dead, RetryableError)
    refused = EngineRequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")
    assert isinstance(refused, KvgateError) and not isinstance(refused, InvalidRequest)
    assert (refused.code, refused.message, refused.param) == (
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        "too long",
        "messages",
    )
    assert str(refused) == "too long"


def test_a_nats_server_error_is_an_internal_error(tmp_path: Path) -> None:
    with pytest.raises(InternalError) as caught:
        _ = EmbeddedNats(tmp_path).url  # not started
    assert isinstance(caught.value, NatsServerError)
    assert caught.value.code is ErrorCode.INTERNAL_ERROR


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (ErrorCode.SESSION_NOT_FOUND, SessionNotFound),
        (ErrorCode.ENGINE_ERROR, EngineError),
        (ErrorCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (ErrorCode.CANCELLED, Cancelled),
    ],
)
def test_a_workers_failed_event_becomes_its_codes_class(
    code: ErrorCode, cls: type[KvgateError]
) -> None:
    error = failure_error(Failed(0, 1, code, "why", "param"))
    assert type(error) is cls
    assert (error.code, error.message, error.param) == (code, "why", "param")


@pytest.mark.parametrize(
    ("error", "retry_after"),
    [
        (BrokerUnavailable("x"), 2),
        (QueueFull("x"), 5),
        (DeadlineExceeded("x"), 1),
        (QueueFull("x", retry_after=9), 9),
        (AdmissionUnavailable("x"), 5),
        (SessionNotFound("x"), None),
        (TenantQuota("x", decision="reject", retry_after=None), None),
    ],
)
def test_retry_after_is_the_classs_unless_given(
    error: KvgateError, retry_after: int | None
) -> None:
    assert error.retry_after == retry_after


def test_error_bodies_keep_their_wire_shape() -> None:
    assert error_body(SessionNotFound("no session 'x'", param="session")).to_json() == {
        "error": {
            "message": "no session 'x'",
            "type": "invalid_request_error",
            "code": "session_not_found",
            "param": "session",
        }
    }
    refused = error_response(TenantQuota("over quota", decision="reject", retry_after=7))
    assert (refused.status_code, refused.headers["retry-after"]) == (429, "7")
    assert error_body(TenantQuota("q", decision="reject", retry_after=7)).to_json() == {
        "error": {
            "message": "q",
            "type": "rate_limit_error",
            "code": "tenant_quota",
            "param": None,
        },
        "retry_after": 7,
        "decision": "reject",
    }
    # Unreachable state while reading a lease: no admission decision in the body.
    assert error_body(AdmissionUnavailable("redis down")).to_json() == {
        "error": {
            "message": "redis down",
            "type": "service_unavailable_error",
            "code": "admission_unavailable",
            "param": None,
        },
        "retry_after": 5,
    }
