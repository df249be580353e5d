"""Publish admitted calls onto their tier's and model's JetStream subject, with the deadline
attached.

A publish whose acknowledgement does not come (a server slow under a burst, a connection being
re-established, a stream electing a new leader on a cluster) is sent again for up to
``PUBLISH_PATIENCE_S`` and never past the call's deadline: the call id is the message id
(``Nats-Msg-Id``), so the stream keeps one copy whichever of the attempts landed, and the
caller gets the one sequence. Only then is it ``broker_unavailable``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from broker.errors import BrokerUnavailable, DeadlineExceeded, QueueFull
from schemas.wire import STREAM_NAME, WIRE_VERSION, CallEnvelope, Header, call_subject, encode

# JetStream API error codes (server's `err_code`) that mean the stream is at its limits, or
# the server's storage is (10023 "insufficient resources": its disk limit, or a full disk).
_STREAM_FULL_CODES = frozenset({10077, 10047, 10028, 10023})
PUBLISH_PATIENCE_S = 10.0
"""How long a call is retried for. A stream on a NATS cluster whose leader's server dies has
none for the seconds the survivors take to elect one (6.3-6.8 s measured on three servers,
tests/test_chaos_cluster.py), and every publish meanwhile fails at once ("no response from
stream"): bounded by a count of attempts (four, until 2026-12), an admitted call was refused
``broker_unavailable`` in under two seconds; bounded by time, it rides the election out."""
RETRY_BACKOFF_S = 0.25
"""The wait before the second attempt; doubled before each next one, up to ``MAX_BACKOFF_S``."""
MAX_BACKOFF_S = 1.0


def call_headers(
    call: CallEnvelope, reply_inbox: str | None, result_subject: str | None = None
) -> dict[str, str]:
    """A call has a reply inbox (interactive) or a result subject (batch), not both."""
    headers = {
        Header.CALL: call.call_id,
        Header.MSG_ID: call.call_id,
        Header.SESSION: call.session_id,
        Header.TIER: call.tier.value,
        Header.DEADLINE: str(call.deadline_ms),
        Header.VERSION: str(WIRE_VERSION),
    }
    if reply_inbox is not None:
        headers[Header.REPLY] = reply_inbox
    if result_subject is not None:
        headers[Header.RESULT] = result_subject
    return headers


class CallPublisher:
    def __init__(self, js: JetStreamContext, *, timeout: float = 2.0) -> None:
        self._js = js
        self._timeout = timeout

    async def publish(
        self,
        call: CallEnvelope,
        reply_inbox: str | None,
        *,
        now_ms: int,
        trace_headers: Mapping[str, str] | None = None,
        result_subject: str | None = None,
    ) -> int:
        """Queue ``call`` and return its stream sequence.

        ``Nats-TTL`` is the time left to the deadline, rounded up to whole seconds (the
        server's granularity), so the server never drops a call that could still start.
        ``trace_headers`` (``traceparent``, ``tracestate``) ride along so that the worker's
        spans join the caller's trace.
        """
        remaining_ms = call.deadline_ms - now_ms
        if remaining_ms <= 0:
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        ttl_s = max(1, math.ceil(remaining_ms / 1000))
        headers = {**call_headers(call, reply_inbox, result_subject), **(trace_headers or {})}
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + remaining_ms / 1000
        give_up_at = min(deadline_at, loop.time() + PUBLISH_PATIENCE_S)
        backoff_s = RETRY_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = await self._js.publish(
                    call_subject(call.tier, call.model),
                    encode(call),
                    timeout=max(0.001, min(self._timeout, deadline_at - loop.time())),
                    stream=STREAM_NAME,
                    headers=headers,
                    msg_ttl=ttl_s,
                )
            except APIError as exc:
                if exc.err_code in _STREAM_FULL_CODES:
                    raise QueueFull(
                        f"the {call.tier.value} queue is full: {exc.description}"
                    ) from exc
                raise BrokerUnavailable(f"JetStream refused the call: {exc.description}") from exc
            except (TimeoutError, NoStreamResponseError, nats.errors.Error) as exc:
                if loop.time() + backoff_s >= give_up_at:
                    raise BrokerUnavailable(
                        f"JetStream did not accept the call in {attempt} attempts: {exc!r}"
                    ) from exc
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
                continue
            return int(ack.seq)
