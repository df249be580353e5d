"""The wire protocol between the front door and the workers (version 1).

Calls travel on JetStream subject ``kvgate.calls.<tier>`` as a msgpack-encoded ``CallEnvelope``
with the headers named below. Replies travel on core NATS to the inbox named in the
``Kvgate-Reply`` header, as msgpack-encoded ``ReplyEvent`` values: zero or more ``TokenDelta``
then exactly one terminal event (``Done`` or ``Failed``) per attempt.

Invariants a reader must not break:
- ``seq`` starts at 0 for every attempt and grows by one per event; a receiver drops any event
  whose ``(attempt, seq)`` it has already seen, so a duplicate publish never duplicates tokens.
- A JetStream message's own reply subject is its ack subject, which is why the caller's inbox
  rides in a header instead.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from schemas.vocab import ErrorCode, FinishReason, Tier

WIRE_VERSION: Final = 1

STREAM_NAME: Final = "KVGATE_CALLS"
CALL_SUBJECT_PREFIX: Final = "kvgate.calls."
CANCEL_SUBJECT_PREFIX: Final = "kvgate.cancel."
WORKERS_BUCKET: Final = "KVGATE_WORKERS"
RESULTS_STREAM: Final = "KVGATE_RESULTS"
RESULT_SUBJECT_PREFIX: Final = "kvgate.results."


class Header:
    """NATS header names carried on every call message."""

    CALL: Final = "Kvgate-Call"
    SESSION: Final = "Kvgate-Session"
    TIER: Final = "Kvgate-Tier"
    DEADLINE: Final = "Kvgate-Deadline"
    REPLY: Final = "Kvgate-Reply"
    VERSION: Final = "Kvgate-Wire"
    RESULT: Final = "Kvgate-Result"
    """Batch calls: the durable subject the worker publishes the call's one result to (the
    call then has no reply inbox and no token events)."""
    MSG_ID: Final = "Nats-Msg-Id"
    TTL: Final = "Nats-TTL"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


class CallEnvelope(msgspec.Struct, frozen=True):
    """One chat call, as queued. ``deadline_ms`` is unix time in milliseconds."""

    call_id: str
    session_id: str
    tier: Tier
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    deadline_ms: int
    created_ms: int
    version: int = WIRE_VERSION


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenDelta(msgspec.Struct, frozen=True, tag="token"):
    seq: int
    attempt: int
    text: str
    tokens: int
    queue_wait_ms: int | None = None
    """On an attempt's first token only: from the call's publish to its engine start."""
    worker_id: str | None = None
    """On an attempt's first token only: the worker running the attempt."""


class Done(msgspec.Struct, frozen=True, tag="done"):
    seq: int
    attempt: int
    finish_reason: FinishReason
    usage: Usage


class Failed(msgspec.Struct, frozen=True, tag="error"):
    seq: int
    attempt: int
    code: ErrorCode
    message: str


ReplyEvent = Annotated[TokenDelta | Done | Failed, msgspec.Meta(title="ReplyEvent")]
TERMINAL_EVENTS: Final = (Done, Failed)


class WorkerHeartbeat(msgspec.Struct, frozen=True):
    """What a worker publishes to ``KVGATE_WORKERS`` every heartbeat interval."""

    worker_id: str
    model: str
    sent_ms: int
    kv_cache_usage: float | None
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_capacity_tokens: int | None
    draining: bool = False
    staged: int = 0
    """Calls fetched but not yet handed to the engine."""
    committed_tokens: int = 0
    """Worst-case KV tokens reserved by the calls the engine holds."""
    num_preemptions: int = 0
    generated_tokens: int = 0
    completed: int = 0
    deadline_dropped: int = 0
    cancelled: int = 0
    handed_back: int = 0


class CallResult(msgspec.Struct, frozen=True):
    """A batch call's outcome, published once per attempt to ``kvgate.results.<batch id>`` on
    the durable ``KVGATE_RESULTS`` stream (``Nats-Msg-Id`` = call id and attempt). Exactly one
    of ``text``/``error_code`` is set."""

    call_id: str
    attempt: int
    text: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error_code: ErrorCode | None = None
    error_message: str | None = None


_call_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(CallEnvelope)
_event_decoder = msgspec.msgpack.Decoder(ReplyEvent)
_heartbeat_decoder = msgspec.msgpack.Decoder(WorkerHeartbeat)
_result_decoder = msgspec.msgpack.Decoder(CallResult)


def encode(value: msgspec.Struct) -> bytes:
    return _call_encoder.encode(value)


def decode_call(data: bytes) -> CallEnvelope:
    """Raises ``msgspec.ValidationError`` (or ``DecodeError``) for a malformed call."""
    return _call_decoder.decode(data)


def decode_event(data: bytes) -> TokenDelta | Done | Failed:
    return _event_decoder.decode(data)


def decode_heartbeat(data: bytes) -> WorkerHeartbeat:
    return _heartbeat_decoder.decode(data)


def decode_result(data: bytes) -> CallResult:
    return _result_decoder.decode(data)
