"""Turn an HTTP chat-completions or completions body into a ``CallEnvelope``, or a precise 4xx.

The front door reads only what kvgate decides on (model, output budget, stream, the tier's
priority) and a prompt-size estimate for admission; the body itself travels to the worker
unchanged, where vLLM's serving layer reads every other field. Parsing is done here rather
than by FastAPI's body binding so that each kind of bad input gets its own stable code
(malformed JSON, missing messages, bad ``max_tokens``...) instead of one generic validation
error.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Collection
from typing import Any, Final, TypeVar

from fastapi import Request
from pydantic import ValidationError

from api.bodies import parse_json_object
from api.openapi import header
from broker.errors import (
    InvalidMaxTokens,
    InvalidMessages,
    InvalidParameter,
    InvalidRequest,
    InvalidTier,
    MaxTokensTooLarge,
    MissingMessages,
    ModelNotFound,
    UnsupportedParameter,
)
from broker.settings import ApiSettings
from schemas.openai import ChatCompletionRequest, CompletionRequest, MessagesRequest
from schemas.vocab import Endpoint, Tier
from schemas.wire import CallEnvelope

TIMEOUT_HEADER = "X-Kvgate-Timeout"
TIER_HEADER = "X-Kvgate-Tier"
SESSION_HEADER = "X-Kvgate-Session"

CALL_HEADERS: Final = [
    header(
        SESSION_HEADER,
        {"type": "string"},
        "The id of an admitted session (`POST /v1/sessions`) to run the call in, inside its "
        "reservation and parallelism; unknown or another tenant's: 404, closed: 409, expired: "
        "410. Without it, the call is admitted on its own, as a one-call session.",
    ),
    header(
        TIER_HEADER,
        {"type": "string", "enum": [tier.value for tier in Tier]},
        "The tier of a call sent without a session (default: the server's `default_tier`, "
        "lowered to the tenant's highest); above the tenant's highest tier: 403. With "
        f"{SESSION_HEADER} it may only repeat the session's tier.",
    ),
    header(
        TIMEOUT_HEADER,
        {"type": "number", "exclusiveMinimum": 0},
        "Seconds the call may take, queue included: its deadline (default: the server's "
        "`default_deadline_s`; at most its `max_deadline_s`, 3600 s unless configured). In a "
        "session, the session's own deadline bounds it too.",
    ),
]
"""The request headers a call reads, as OpenAPI parameters."""

_EXAMPLE_MODEL: Final = ApiSettings.model_fields["served_model_name"].default
_SAY_HELLO: Final = [{"role": "user", "content": "Say hello."}]
CHAT_EXAMPLE: Final = {"model": _EXAMPLE_MODEL, "messages": _SAY_HELLO, "max_tokens": 16}
COMPLETION_EXAMPLE: Final = {"model": _EXAMPLE_MODEL, "prompt": "Say hello.", "max_tokens": 16}
MESSAGES_EXAMPLE: Final = {"model": _EXAMPLE_MODEL, "max_tokens": 16, "messages": _SAY_HELLO}
"""Request bodies for the OpenAPI document, each one the front door takes."""

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest, MessagesRequest)
CallRequest = ChatCompletionRequest | CompletionRequest | MessagesRequest
"""A request kvgate queues: OpenAI chat completions or completions, or Anthropic messages."""


# Fields kvgate decides itself, refused by name so that a caller never believes it set them.
_KVGATE_DECIDES: Final = {
    "priority": f"the engine priority follows the tier ({TIER_HEADER}) and the session",
}


_MAX_TOKENS_FIELDS: Final = ("max_tokens", "max_completion_tokens")


def _call_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; an output budget past 64 bits is ``invalid_max_tokens``, as
    any other unusable one is."""
    try:
        return parse_json_object(body)
    except InvalidParameter as exc:
        if exc.param in _MAX_TOKENS_FIELDS:
            raise InvalidMaxTokens(exc.message, param=exc.param) from None
        raise


def parse_chat_request(body: bytes, settings: ApiSettings) -> ChatCompletionRequest:
    raw = _call_body(body)
    if "messages" not in raw:
        raise MissingMessages("'messages' is required", param="messages")
    return _checked(ChatCompletionRequest, raw, settings)


def parse_completion_request(body: bytes, settings: ApiSettings) -> CompletionRequest:
    raw = _call_body(body)
    if "prompt" not in raw:
        raise InvalidRequest("'prompt' is required", param="prompt")
    call = _checked(CompletionRequest, raw, settings)
    prompt = call.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        # Each prompt is a request of its own to the engine: sent as separate calls, each is
        # admitted, queued and fitted to the worker's headroom on its own.
        raise UnsupportedParameter(
            "a list of several prompts is not accepted: send one call per prompt",
            param="prompt",
        )
    return call


def parse_messages_request(body: bytes, settings: ApiSettings) -> MessagesRequest:
    raw = _call_body(body)
    if "messages" not in raw:
        raise MissingMessages("'messages' is required", param="messages")
    if "max_tokens" not in raw:
        raise InvalidMaxTokens("'max_tokens' is required", param="max_tokens")
    return _checked(MessagesRequest, raw, settings)


def _checked(model: type[RequestT], raw: dict[str, Any], settings: ApiSettings) -> RequestT:
    for name, why in _KVGATE_DECIDES.items():
        if name in raw:
            raise UnsupportedParameter(f"'{name}' is not accepted: {why}", param=name)
    try:
        call = model.model_validate(raw)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    max_tokens = call.requested_max_tokens()
    if max_tokens is not None and max_tokens > settings.max_tokens_limit:
        raise MaxTokensTooLarge(
            f"max_tokens {max_tokens} exceeds this server's limit of {settings.max_tokens_limit}",
            param="max_tokens",
        )
    return call


def check_known_model(model: str, known: Collection[str]) -> None:
    """``model_not_found`` (404) for a model no worker of this fleet serves."""
    if model not in known:
        served = ", ".join(repr(m) for m in sorted(known))
        raise ModelNotFound(
            f"model {model!r} does not exist; this fleet serves {served}",
            param="model",
        )


def _from_validation_error(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    field = loc[0] if loc else ""
    message = f"{'.'.join(loc) or 'body'}: {first['msg']}"
    if field == "messages":
        return InvalidMessages(message, param="messages")
    if field == "prompt":
        return InvalidRequest(message, param="prompt")
    if field in _MAX_TOKENS_FIELDS:
        return InvalidMaxTokens(message, param=field)
    if field == "model":
        return InvalidRequest(message, param="model")
    return InvalidParameter(message, param=field or None)


def call_timeout_s(request: Request, settings: ApiSettings) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return settings.default_deadline_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= settings.max_deadline_s):
        raise InvalidParameter(
            f"{TIMEOUT_HEADER} must be a number of seconds in (0, {settings.max_deadline_s:g}]",
            param=TIMEOUT_HEADER,
        )
    return value


def call_tier(request: Request, settings: ApiSettings, ceiling: Tier | None = None) -> Tier:
    """The tier named by the caller; else the default, lowered to ``ceiling`` (the tenant's
    highest tier) when the default is above it. A named tier is checked by the caller."""
    raw = request.headers.get(TIER_HEADER)
    if raw is None:
        if ceiling is not None and settings.default_tier.priority < ceiling.priority:
            return ceiling
        return settings.default_tier
    try:
        return Tier(raw.strip().lower())
    except ValueError:
        names = ", ".join(t.value for t in Tier)
        raise InvalidTier(f"unknown tier {raw!r}; tiers are {names}", param=TIER_HEADER) from None


def to_envelope(
    call: CallRequest,
    body: bytes,
    settings: ApiSettings,
    *,
    tier: Tier,
    timeout_s: float,
    session_id: str | None = None,
    session_started_ms: int = 0,
    ttft_objective_ms: int | None = None,
) -> CallEnvelope:
    """The call as queued: ``body`` unchanged, with kvgate's decisions beside it."""
    now_ms = int(time.time() * 1000)
    call_id = uuid.uuid4().hex
    if isinstance(call, ChatCompletionRequest):
        endpoint = Endpoint.CHAT_COMPLETIONS
    elif isinstance(call, CompletionRequest):
        endpoint = Endpoint.COMPLETIONS
    else:
        endpoint = Endpoint.MESSAGES
    return CallEnvelope(
        call_id=call_id,
        session_id=session_id or call_id,
        tier=tier,
        model=call.model,
        endpoint=endpoint,
        body=body,
        stream=call.stream,
        max_tokens=call.requested_max_tokens() or settings.default_max_tokens,
        deadline_ms=now_ms + int(timeout_s * 1000),
        created_ms=now_ms,
        est_prompt_tokens=estimate_prompt_tokens(call),
        session_started_ms=session_started_ms,
        ttft_objective_ms=ttft_objective_ms,
    )


def estimate_prompt_tokens(call: CallRequest) -> int:
    """A front-door estimate of the prompt's tokens (the front door holds no tokenizer):
    about three characters a token over what the chat template renders (messages and tools,
    measured as their JSON), plus a few tokens per message. The worker counts exactly; this
    only sizes the reservation."""
    if isinstance(call, CompletionRequest):
        prompt = call.prompt
        if isinstance(prompt, str):
            return max(1, math.ceil(len(prompt) / 3) + 2)
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        return max(1, math.ceil(len(json.dumps(prompt)) / 3))
    chars = sum(len(json.dumps(m.model_dump(exclude_none=True))) for m in call.messages)
    extra = call.model_extra or {}
    for rendered in ("tools", "system"):  # the system prompt is a field of its own (Anthropic)
        if extra.get(rendered):
            chars += len(json.dumps(extra[rendered]))
    return max(1, math.ceil(chars / 3) + 4 * len(call.messages) + 8)
