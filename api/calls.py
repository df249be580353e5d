"""One call's life in the front door: queue it, then follow its reply events to the end.

Time limits: the first event must arrive before the call's deadline (the same deadline the
worker and the server's ``Nats-TTL`` enforce, so a call nobody started ends at its deadline,
never hangs); after that, the worker may go silent for at most ``stream_idle_timeout_s``.
Whenever the caller stops following before a terminal event (gave up, disconnected, timed
out), the call is cancelled so the worker frees its KV cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from api.replies import ReplyEvent
from api.state import FrontDoor
from broker.errors import DeadlineExceeded, KvgateError
from schemas.vocab import ErrorCode
from schemas.wire import CANCEL_SUBJECT_PREFIX, CallEnvelope, Done, Failed


@dataclass(frozen=True, slots=True)
class Restarted:
    """The call was delivered again (its worker was lost); events start over from here."""

    attempt: int


async def follow_call(
    door: FrontDoor, call: CallEnvelope
) -> AsyncGenerator[list[ReplyEvent] | Restarted, None]:
    """Publish ``call`` and yield its reply events in arrival batches until the terminal one.

    Raises ``KvgateError`` (from publishing, or a timeout); a worker's ``Failed`` event is
    yielded like any other, since what it means depends on what the client already has.
    """
    stream = door.replies.open(call.call_id)
    finished = False
    try:
        await door.publisher.publish(call, stream.inbox, now_ms=int(time.time() * 1000))
        attempt: int | None = None
        while True:
            if attempt is None:
                timeout = call.deadline_ms / 1000 - time.time()
            else:
                timeout = door.settings.stream_idle_timeout_s
            try:
                batch = await stream.next_batch(timeout)
            except TimeoutError:
                if attempt is None:
                    raise DeadlineExceeded(
                        "no worker started the call before its deadline "
                        f"({(call.deadline_ms - call.created_ms) / 1000:g}s)"
                    ) from None
                raise KvgateError(
                    ErrorCode.WORKER_LOST,
                    f"the worker sent nothing for {door.settings.stream_idle_timeout_s:g}s",
                ) from None
            current: list[ReplyEvent] = []
            for event in batch:
                if attempt is not None and event.attempt != attempt:
                    if current:
                        yield current
                        current = []
                    yield Restarted(event.attempt)
                attempt = event.attempt
                current.append(event)
                if isinstance(event, Done | Failed):
                    finished = True
                    yield current
                    return
            yield current
    finally:
        door.replies.close(call.call_id)
        if not finished:
            with contextlib.suppress(Exception):
                await door.nc.publish(f"{CANCEL_SUBJECT_PREFIX}{call.call_id}", b"")


def failure_error(event: Failed) -> KvgateError:
    if event.code == ErrorCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(event.message)
    return KvgateError(event.code, event.message)
