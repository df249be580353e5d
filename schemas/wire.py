"""The wire protocol between the front door and the workers (version 3: a queue per model).

Calls travel on JetStream subject ``kvgate.calls.<tier>.<model token>`` (``call_subject``) as a
msgpack-encoded ``CallEnvelope``
with the headers named below. The envelope carries the request body exactly as the agent sent
it (chat completions or completions, every field) beside what kvgate decided about it; the
worker hands the body to vLLM's own OpenAI serving layer. Replies travel on core NATS to the
inbox named in the ``Kvgate-Reply`` header, as msgpack-encoded ``ReplyEvent`` values: zero or
more ``TokenDelta`` (for a streamed call, the server-sent events vLLM produced) then exactly one
terminal event (``Done``, carrying vLLM's whole response body for a call that was not
streamed, or ``Failed``) per attempt.

Invariants a reader must not break:
- ``seq`` starts at 0 for every attempt and grows by one per event; a receiver drops any event
  whose ``(attempt, seq)`` it has already seen, so a duplicate publish never duplicates tokens.
- A JetStream message's own reply subject is its ack subject, which is why the caller's inbox
  rides in a header instead.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Final

import msgspec

from schemas.vocab import Endpoint, ErrorCode, FinishReason, Tier

WIRE_VERSION: Final = 3

STREAM_NAME: Final = "KVGATE_CALLS"
CALL_SUBJECT_PREFIX: Final = "kvgate.calls."
CANCEL_SUBJECT_PREFIX: Final = "kvgate.cancel."
WORKERS_BUCKET: Final = "KVGATE_WORKERS"
RESULTS_STREAM: Final = "KVGATE_RESULTS"
RESULT_SUBJECT_PREFIX: Final = "kvgate.results."
INBOX_PREFIX: Final = "_INBOX."
"""Where nats.py's inboxes live: every call's reply inbox is under it."""


_UNSAFE_IN_TOKEN = re.compile(r"[^A-Za-z0-9_-]+")


def model_token(model: str) -> str:
    """A served model name as one subject token (names hold ``/`` and ``.``): a readable slug,
    then 8 hex digits of the name's hash, so two names that slug alike never share a queue."""
    slug = _UNSAFE_IN_TOKEN.sub("_", model).strip("_")[:48] or "model"
    return f"{slug}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def call_subject(tier: Tier, model: str) -> str:
    """Where calls for ``model`` at ``tier`` are queued; only that model's workers pull it."""
    return f"{CALL_SUBJECT_PREFIX}{tier.value}.{model_token(model)}"


def consumer_name(tier: Tier, model: str) -> str:
    """The durable pull consumer shared by every worker serving ``model``, for one tier."""
    return f"kvgate-{tier.value}-{model_token(model)}"


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
    PROBE: Final = "Kvgate-Probe"
    """On a request a worker sends to a call's reply inbox (no body): does the caller still
    wait? The front door answers ``PROBE_WAITING`` or ``PROBE_GONE``; no front door at all is
    NATS's "no responders"."""


PROBE_WAITING: Final = b"waiting"
PROBE_GONE: Final = b"gone"


class CallEnvelope(msgspec.Struct, frozen=True):
    """One call, as queued. ``deadline_ms`` is unix time in milliseconds.

    ``body`` is the caller's JSON request body, unchanged: the worker parses it with vLLM's own
    request models, so every field vLLM serves reaches the engine. ``max_tokens`` is kvgate's
    output budget for the call (the caller's, or the front door's default when the caller set
    none); the worker applies it only when the body names no limit of its own."""

    call_id: str
    session_id: str
    tier: Tier
    model: str
    endpoint: Endpoint
    body: bytes
    stream: bool
    max_tokens: int
    deadline_ms: int
    created_ms: int
    est_prompt_tokens: int = 0
    """The front door's estimate of the prompt, which sized the session's reservation."""
    session_started_ms: int = 0
    """When admission said yes to the call's session (unix ms); 0 when unknown, read as the
    call's own ``created_ms``. Orders calls of one tier: an older session's first."""
    ttft_objective_ms: int | None = None
    """The time-to-first-token objective of the call's tier (its tenant's where the tenants
    file overrides it); ``None`` for work with none (batches). A worker may start a call that
    waited for room past its usual mark before the call misses it (``workers.headroom``)."""
    version: int = WIRE_VERSION


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenDelta(msgspec.Struct, frozen=True, tag="token"):
    """New output of a streamed call: ``sse`` holds one or more complete server-sent events
    (``data: {...}\n\n``) exactly as vLLM's serving layer wrote them (never ``[DONE]``, which
    the front door writes after the terminal event); ``tokens`` counts the engine tokens
    generated since the previous event.

    A call that is not streamed gets token events with an empty ``sse``: one when it starts
    (naming its worker) and then one every few seconds while it generates, so that the front
    door can tell a long generation from a lost worker."""

    seq: int
    attempt: int
    sse: str
    tokens: int
    queue_wait_ms: int | None = None
    """On an attempt's first token only: from the call's publish to its engine start."""
    worker_id: str | None = None
    """On an attempt's first token only: the worker running the attempt."""


class Done(msgspec.Struct, frozen=True, tag="done"):
    """The attempt finished. ``body`` is vLLM's whole response (JSON) for a call that was not
    streamed, ``None`` for a streamed one. ``worker_id`` names the worker that answered."""

    seq: int
    attempt: int
    finish_reason: FinishReason
    usage: Usage
    body: bytes | None = None
    worker_id: str | None = None


class Failed(msgspec.Struct, frozen=True, tag="error"):
    """The attempt ended without an answer. For a request vLLM's serving layer refused,
    ``message`` and ``param`` are vLLM's own."""

    seq: int
    attempt: int
    code: ErrorCode
    message: str
    param: str | None = None


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
    max_model_len: int | None = None
    staged: int = 0
    """Calls fetched but not yet handed to the engine."""
    committed_tokens: int = 0
    """The predicted peak of the KV tokens of the calls the engine runs (each to its whole
    ``max_tokens``; ``workers/headroom.py``)."""
    num_preemptions: int = 0
    generated_tokens: int = 0
    completed: int = 0
    deadline_dropped: int = 0
    cancelled: int = 0
    handed_back: int = 0
    rescued: int = 0
    """Calls started by the rescue rule (``workers.headroom``): due by their time-to-first-token
    objective, past a call that did not fit or past the mark."""
    failed: int = 0
    """Calls that ended with an error their caller saw: a request the serving layer refused, or
    the engine failing on the call's last attempt."""
    faulted: int = 0
    """Calls a fault outside the engine interrupted (an ack or a publish that failed): any is
    worth a look (``WorkerCounters.faulted``)."""
    ended: int = 0
    """Calls ended for good, whatever their outcome (``WorkerCounters.ended``)."""


class CallResult(msgspec.Struct, frozen=True):
    """A batch call's outcome, published once per attempt to ``kvgate.results.<batch id>`` on
    the durable ``KVGATE_RESULTS`` stream (``Nats-Msg-Id`` = call id and attempt). Exactly one
    of ``body``/``error_code`` is set."""

    call_id: str
    attempt: int
    body: bytes | None = None
    """vLLM's whole response body (JSON), as a non-streamed call would have received it."""
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
