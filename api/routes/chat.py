"""``POST /v1/chat/completions``: OpenAI-compatible, streamed (SSE) or not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.admission import session_need_for_call
from api.calls import Restarted, failure_error, follow_call
from api.chat_request import (
    SESSION_HEADER,
    TIER_HEADER,
    call_tier,
    call_timeout_s,
    estimate_prompt_tokens,
    parse_chat_request,
    read_body,
    to_envelope,
)
from api.deps import FrontDoorDep, TenantDep
from api.errors import error_body
from api.replies import ReplyEvent
from api.routes.sessions import check_tier
from api.state import FrontDoor
from broker.admission_state import SessionRecord
from broker.errors import InvalidRequest, KvgateError
from schemas.openai import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from schemas.vocab import ErrorCode
from schemas.wire import CallEnvelope, Done, Failed, TokenDelta

router = APIRouter(tags=["chat"])

T = TypeVar("T")

CALL_ID_HEADER = "X-Kvgate-Call"
SESSION_ID_HEADER = "X-Kvgate-Session"
WORKER_ID_HEADER = "X-Kvgate-Worker"
"""The worker whose attempt answered (streamed: the one that sent the first token)."""

_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema()}},
    }
}


@router.post("/v1/chat/completions", openapi_extra=_BODY_SCHEMA, response_model=None)
async def create_chat_completion(
    request: Request, door: FrontDoorDep, tenant: TenantDep
) -> JSONResponse | StreamingResponse:
    settings = door.settings
    chat = parse_chat_request(await read_body(request, settings.max_body_bytes), settings)
    timeout_s = call_timeout_s(request, settings)
    session_id = request.headers.get(SESSION_HEADER)
    if session_id is not None:
        record = await door.admitter.get(tenant, session_id.strip())
        named = request.headers.get(TIER_HEADER)
        if named is not None and call_tier(request, settings) is not record.tier:
            raise InvalidRequest(
                ErrorCode.INVALID_TIER,
                f"{TIER_HEADER} {named!r} differs from the session's tier {record.tier.value!r}",
                param=TIER_HEADER,
            )
        left_s = record.deadline_ms / 1000 - time.time()
        call = to_envelope(
            chat,
            settings,
            tier=record.tier,
            timeout_s=max(0.001, min(timeout_s, left_s)),
            session_id=record.id,
        )
        one_call = False
    else:
        tier = call_tier(request, settings, ceiling=tenant.max_tier)
        check_tier(tier, tenant)
        call = to_envelope(chat, settings, tier=tier, timeout_s=timeout_s)
        need = session_need_for_call(
            tier, estimate_prompt_tokens(call), call.sampling.max_tokens, timeout_s
        )
        admitted = await door.admitter.admit(tenant, need, scope="call", idle_timeout_s=timeout_s)
        record = admitted.record
        call = msgspec.structs.replace(call, session_id=record.id)
        one_call = True
    events = _admitted_call(door, record, call, one_call)
    headers = {CALL_ID_HEADER: call.call_id, SESSION_ID_HEADER: record.id}
    if not chat.stream:
        async with contextlib.aclosing(events):
            completion, worker_id = await _unless_disconnected(request, _collect(call, events))
        if worker_id is not None:
            headers[WORKER_ID_HEADER] = worker_id
        return JSONResponse(completion.model_dump(), headers=headers)
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
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
    if isinstance(first, list) and (worker_id := _worker_of(first)) is not None:
        headers[WORKER_ID_HEADER] = worker_id
    return StreamingResponse(
        _sse(call, first, events, include_usage),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _admitted_call(
    door: FrontDoor, record: SessionRecord, call: CallEnvelope, one_call: bool
) -> AsyncGenerator[list[ReplyEvent] | Restarted, None]:
    """The call's events, run inside one of its session's call slots; a one-call session
    ends with its call."""
    try:
        async with door.admitter.call_slot(record, call.call_id, call.deadline_ms):
            events = follow_call(door, call)
            async with contextlib.aclosing(events):
                async for item in events:
                    yield item
    finally:
        if one_call:
            await door.admitter.end_one_call_session(record)


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
        raise KvgateError(ErrorCode.CANCELLED, "the client disconnected")
    return task.result()


def _worker_of(events: list[ReplyEvent]) -> str | None:
    return next((e.worker_id for e in events if isinstance(e, TokenDelta) and e.worker_id), None)


async def _collect(
    call: CallEnvelope, events: AsyncIterator[list[ReplyEvent] | Restarted]
) -> tuple[ChatCompletion, str | None]:
    """The whole answer, and the worker whose attempt gave it."""
    parts: list[str] = []
    worker_id: str | None = None
    async for item in events:
        if isinstance(item, Restarted):
            parts.clear()  # nothing was sent yet: the new attempt's answer replaces it
            worker_id = None
            continue
        for event in item:
            if isinstance(event, TokenDelta):
                parts.append(event.text)
                worker_id = event.worker_id or worker_id
            elif isinstance(event, Failed):
                raise failure_error(event)
            else:
                completion = ChatCompletion(
                    id=_completion_id(call),
                    created=call.created_ms // 1000,
                    model=call.model,
                    choices=[
                        Choice(
                            message=AssistantMessage(content="".join(parts)),
                            finish_reason=event.finish_reason.value,
                        )
                    ],
                    usage=_usage(event),
                )
                return completion, worker_id
    raise KvgateError(ErrorCode.WORKER_LOST, "the reply ended without a terminal event")


async def _sse(
    call: CallEnvelope,
    first: list[ReplyEvent] | Restarted,
    events: AsyncGenerator[list[ReplyEvent] | Restarted, None],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    chunk_id = _completion_id(call)
    created = int(time.time())

    def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None) -> bytes:
        choices = [] if usage is not None else [ChunkChoice(delta=delta, finish_reason=finish)]
        body = ChatCompletionChunk(
            id=chunk_id, created=created, model=call.model, choices=choices, usage=usage
        )
        return b"data: " + body.model_dump_json().encode() + b"\n\n"

    def error(exc: KvgateError) -> bytes:
        return b"data: " + json.dumps(error_body(exc).to_json()).encode() + b"\n\n"

    yield chunk(Delta(role="assistant", content=""))
    sent_tokens = False

    async def items() -> AsyncIterator[list[ReplyEvent] | Restarted]:
        yield first
        async for item in events:
            yield item

    try:
        async for item in items():
            if isinstance(item, Restarted):
                if sent_tokens:
                    # The client already holds tokens of the lost attempt; splicing another
                    # attempt's tokens after them would corrupt the answer.
                    yield error(
                        KvgateError(ErrorCode.WORKER_LOST, "the worker was lost mid-stream")
                    )
                    yield b"data: [DONE]\n\n"
                    return
                continue
            text = "".join(e.text for e in item if isinstance(e, TokenDelta))
            if text:
                yield chunk(Delta(content=text))
                sent_tokens = True
            terminal = item[-1] if item else None
            if isinstance(terminal, Done):
                yield chunk(Delta(), finish=terminal.finish_reason.value)
                if include_usage:
                    yield chunk(Delta(), usage=_usage(terminal))
                yield b"data: [DONE]\n\n"
                return
            if isinstance(terminal, Failed):
                yield error(failure_error(terminal))
                yield b"data: [DONE]\n\n"
                return
    except KvgateError as exc:
        yield error(exc)
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()


def _completion_id(call: CallEnvelope) -> str:
    return f"chatcmpl-{call.call_id}"


def _usage(done: Done) -> Usage:
    return Usage(
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
        total_tokens=done.usage.total_tokens,
    )
