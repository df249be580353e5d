"""``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI) and ``POST /v1/messages``
(Anthropic), streamed (SSE) or not.

The front door admits and queues the call; the worker's vLLM serving layer writes the answer.
What reaches the caller is vLLM's own response body, or its own server-sent events, relayed as
they were produced; kvgate adds only its headers, and (OpenAI's APIs only) ``data: [DONE]``
once the call ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from api.bodies import read_body
from api.calls import Restarted, failure_error, follow_call
from api.chat_request import (
    CALL_HEADERS,
    CHAT_EXAMPLE,
    COMPLETION_EXAMPLE,
    MESSAGES_EXAMPLE,
    SESSION_HEADER,
    TIER_HEADER,
    CallRequest,
    call_tier,
    call_timeout_s,
    parse_chat_request,
    parse_completion_request,
    parse_messages_request,
    to_envelope,
)
from api.deps import FrontDoorDep, TenantDep
from api.errors import anthropic_error_body, error_body
from api.frontdoor import FrontDoor
from api.openapi import Responses, codes_below, error_responses, json_body
from api.replies import ReplyEvent
from api.streaming import SseResponse
from broker.admission import needs
from broker.admission.objectives import Objective
from broker.admission.state import CallCharge, SessionRecord
from broker.admission.tenants import Tenant
from broker.errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    InvalidTier,
    KvgateError,
    Refused,
    RetryableError,
    ServerError,
    SessionExpired,
    WorkerLost,
)
from schemas.openai import (
    AnthropicErrorBody,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    MessagesRequest,
)
from schemas.vocab import Endpoint, ErrorCode
from schemas.wire import CallEnvelope, Done, Failed, TokenDelta

router = APIRouter(tags=["chat"])

T = TypeVar("T")

CALL_ID_HEADER = "X-Kvgate-Call"
SESSION_ID_HEADER = "X-Kvgate-Session"
WORKER_ID_HEADER = "X-Kvgate-Worker"
"""The worker whose attempt answered (streamed: the one that sent the first token)."""
QUEUE_WAIT_HEADER = "X-Kvgate-Queue-Wait-Ms"
"""How long the answering attempt waited, from its publish to its engine start, as its worker
measured it: what of a call's time to first token went to queues (JetStream, the worker's
staging) rather than to the engine."""


_NOT_A_CALLS_ERROR = {
    ErrorCode.NOT_FOUND,
    ErrorCode.METHOD_NOT_ALLOWED,
    ErrorCode.BATCH_NOT_FOUND,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE,
}
CALL_ERRORS = tuple(
    code
    for group in (InvalidRequest, Refused, RetryableError, ServerError)
    for code in codes_below(group)
    if code not in _NOT_A_CALLS_ERROR
)
"""What a call may answer: its request's faults, admission's refusals, and (relayed from the
worker that served it) any failure of the serving layer, the engine or the broker."""


def _call_responses(body: type[BaseModel], events: str) -> Responses:
    ok: dict[str, Any] = {
        "description": "The serving layer's response body; with `stream: true`, its "
        f"server-sent events ({events}).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
        "headers": {
            CALL_ID_HEADER: {"description": "The call's id.", "schema": {"type": "string"}},
            SESSION_ID_HEADER: {
                "description": "The session the call ran in (its own, for a call sent "
                f"without {SESSION_HEADER}).",
                "schema": {"type": "string"},
            },
            WORKER_ID_HEADER: {
                "description": "The worker whose attempt answered.",
                "schema": {"type": "string"},
            },
            QUEUE_WAIT_HEADER: {
                "description": "Milliseconds the answering attempt waited between its publish "
                "and its engine start (JetStream and the worker's staging).",
                "schema": {"type": "integer"},
            },
        },
    }
    return {200: ok, **error_responses(*CALL_ERRORS, body=body)}


OPENAI_CALL_RESPONSES = _call_responses(ErrorBody, "ending with `data: [DONE]`")


@router.post(
    "/v1/chat/completions",
    openapi_extra={**json_body(ChatCompletionRequest, CHAT_EXAMPLE), "parameters": CALL_HEADERS},
    response_model=None,
    responses=OPENAI_CALL_RESPONSES,
)
async def create_chat_completion(
    request: Request, door: FrontDoorDep, tenant: TenantDep
) -> Response:
    body = await read_body(request, door.settings.max_body_bytes)
    return await _serve_call(request, door, tenant, parse_chat_request(body, door.settings), body)


@router.post(
    "/v1/completions",
    openapi_extra={**json_body(CompletionRequest, COMPLETION_EXAMPLE), "parameters": CALL_HEADERS},
    response_model=None,
    responses=OPENAI_CALL_RESPONSES,
)
async def create_completion(request: Request, door: FrontDoorDep, tenant: TenantDep) -> Response:
    body = await read_body(request, door.settings.max_body_bytes)
    call = parse_completion_request(body, door.settings)
    return await _serve_call(request, door, tenant, call, body)


@router.post(
    "/v1/messages",
    openapi_extra={**json_body(MessagesRequest, MESSAGES_EXAMPLE), "parameters": CALL_HEADERS},
    response_model=None,
    responses=_call_responses(AnthropicErrorBody, "ending with `message_stop`"),
)
async def create_message(request: Request, door: FrontDoorDep, tenant: TenantDep) -> Response:
    """Anthropic's Messages API (Claude Code and other agents reach it through their base-URL
    setting); errors in Anthropic's shape."""
    body = await read_body(request, door.settings.max_body_bytes)
    call = parse_messages_request(body, door.settings)
    return await _serve_call(request, door, tenant, call, body)


async def _serve_call(
    request: Request, door: FrontDoor, tenant: Tenant, parsed: CallRequest, body: bytes
) -> Response:
    settings = door.settings
    timeout_s = call_timeout_s(request, settings)
    session_id = request.headers.get(SESSION_HEADER)
    if session_id is not None:
        record = await door.leases.get(tenant, session_id.strip())
        named = request.headers.get(TIER_HEADER)
        if named is not None and call_tier(request, settings) is not record.tier:
            raise InvalidTier(
                f"{TIER_HEADER} {named!r} differs from the session's tier {record.tier.value!r}",
                param=TIER_HEADER,
            )
        door.check_model(parsed.model)
        left_s = record.deadline_ms / 1000 - time.time()
        objective = door.admitter.tenancy.objective(tenant, record.tier)
        call = to_envelope(
            parsed,
            body,
            settings,
            tier=record.tier,
            timeout_s=max(0.001, min(timeout_s, left_s)),
            session_id=record.id,
            session_started_ms=record.created_ms,
            ttft_objective_ms=round(objective.ttft_s * 1000),
        )
        one_call = False
    else:
        tier = call_tier(request, settings, ceiling=tenant.max_tier)
        tenant.require_tier(tier)
        door.check_model(parsed.model)
        objective = door.admitter.tenancy.objective(tenant, tier)
        call = to_envelope(
            parsed,
            body,
            settings,
            tier=tier,
            timeout_s=timeout_s,
            ttft_objective_ms=round(objective.ttft_s * 1000),
        )
        need = needs.for_call(tier, call.est_prompt_tokens, call.max_tokens * parsed.n, timeout_s)
        admitted = await door.admitter.admit(tenant, need, scope="call", idle_timeout_s=timeout_s)
        record = admitted.record
        call = msgspec.structs.replace(
            call, session_id=record.id, session_started_ms=record.created_ms
        )
        one_call = True
    charge = door.leases.charge(tenant, record, call.est_prompt_tokens, call.max_tokens * parsed.n)
    events = _admitted_call(door, record, call, charge, one_call, objective)
    headers = {CALL_ID_HEADER: call.call_id, SESSION_ID_HEADER: record.id}
    if not call.stream:
        async with contextlib.aclosing(events):
            answer, answered_by = await _unless_disconnected(request, _collect(events))
        headers.update(answered_by)
        return Response(answer, media_type="application/json", headers=headers)
    # Wait for the first event before answering, so that anything that goes wrong before the
    # first token (deadline, full queue, a rejected prompt) is a proper HTTP status.
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    if isinstance(first, list) and first and isinstance(first[0], Failed):
        await events.aclose()
        raise failure_error(first[0])
    if isinstance(first, list):
        headers.update(_answered_by(first))
    return SseResponse(
        _sse(first, events, call.endpoint),
        send_timeout_s=settings.stream_send_timeout_s,
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _admitted_call(
    door: FrontDoor,
    record: SessionRecord,
    call: CallEnvelope,
    charge: CallCharge,
    one_call: bool,
    objective: Objective,
) -> AsyncGenerator[list[ReplyEvent] | Restarted, None]:
    """The call's events, run inside one of its session's call slots; a one-call session
    ends with its call."""
    slot = contextlib.AsyncExitStack()
    try:
        try:
            await slot.enter_async_context(
                door.leases.call_slot(record, call.call_id, call.deadline_ms, charge)
            )
        except SessionExpired:
            if not one_call:
                raise
            # A one-call session lives as long as its call's own timeout: the call ran out of
            # time before it started. Its caller named no session; 410 would name one it never saw.
            raise DeadlineExceeded("the call's timeout passed before it could start") from None
        events = follow_call(
            door.calls,
            call,
            objective,
            session_calls=record.expected_calls,
            session_admitted_ms=record.created_ms,
        )
        async with contextlib.aclosing(events):
            async for item in events:
                yield item
    finally:
        # A streamed call's client that disconnects cancels the response (Starlette's AnyIO
        # cancel scope), and the scope cancels again at every await after that: unshielded,
        # these releases would be cut at their first round trip to Redis, leaving the slot
        # and the one-call session held in the admission state until the call's deadline.
        with anyio.CancelScope(shield=True):
            await slot.aclose()
            if one_call:
                await door.leases.end_one_call_session(record)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it if the client goes away first (closing the call's event
    iterator then cancels the call on the worker, freeing its KV cache)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise Cancelled("the client disconnected")
    return task.result()


def _answered_by(events: list[ReplyEvent]) -> dict[str, str]:
    """The headers that say which worker's attempt answered and how long it queued, from
    that attempt's events (the first of them carries both)."""
    headers: dict[str, str] = {}
    for event in events:
        if isinstance(event, TokenDelta | Done) and event.worker_id:
            headers.setdefault(WORKER_ID_HEADER, event.worker_id)
        if isinstance(event, TokenDelta) and event.queue_wait_ms is not None:
            headers.setdefault(QUEUE_WAIT_HEADER, str(event.queue_wait_ms))
    return headers


async def _collect(
    events: AsyncIterator[list[ReplyEvent] | Restarted],
) -> tuple[bytes, dict[str, str]]:
    """vLLM's whole response body, and the headers naming the attempt that gave it."""
    answered_by: dict[str, str] = {}
    async for item in events:
        if isinstance(item, Restarted):
            answered_by = {}  # nothing was sent yet: the new attempt's answer replaces the lost one
            continue
        answered_by = {**_answered_by(item), **answered_by}
        for event in item:
            if isinstance(event, Failed):
                raise failure_error(event)
            if isinstance(event, Done):
                if event.body is None:
                    raise InternalError("the worker sent no body")
                return event.body, answered_by
    raise WorkerLost("the reply ended without a terminal event")


async def _sse(
    first: list[ReplyEvent] | Restarted,
    events: AsyncGenerator[list[ReplyEvent] | Restarted, None],
    endpoint: Endpoint,
) -> AsyncIterator[bytes]:
    anthropic = endpoint is Endpoint.MESSAGES
    # Anthropic's streams end with their own message_stop event, and carry errors as an
    # "error" event; OpenAI's end with [DONE] and carry errors as a data event.
    done = b"" if anthropic else b"data: [DONE]\n\n"

    def error(exc: KvgateError) -> bytes:
        if anthropic:
            return (
                b"event: error\ndata: %s\n\n"
                % json.dumps(anthropic_error_body(exc).to_json()).encode()
            )
        return b"data: %s\n\n" % json.dumps(error_body(exc).to_json()).encode()

    sent_tokens = False

    async def items() -> AsyncIterator[list[ReplyEvent] | Restarted]:
        yield first
        async for item in events:
            yield item

    try:
        async for item in items():
            if isinstance(item, Restarted):
                if sent_tokens:
                    # The client already holds events of the lost attempt; splicing another
                    # attempt's after them would corrupt the answer.
                    yield error(WorkerLost("the worker was lost mid-stream"))
                    yield done
                    return
                continue
            # Everything that arrived since the last write goes out in one write.
            sse = "".join(e.sse for e in item if isinstance(e, TokenDelta))
            if sse:
                yield sse.encode()
                sent_tokens = True
            terminal = item[-1] if item else None
            if isinstance(terminal, Done):
                yield done
                return
            if isinstance(terminal, Failed):
                yield error(failure_error(terminal))
                yield done
                return
    except KvgateError as exc:
        yield error(exc)
        yield done
    finally:
        await events.aclose()
