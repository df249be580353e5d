"""Collect batch results into the database, in the background of every front door.

A durable consumer on ``KVGATE_RESULTS``, shared by every front door, writes each result to its
line in the database, then acks it. A result is acked only after its write committed, so a
crash loses nothing; the write is conditional (``store.finish_lines``), so a duplicate changes
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js import JetStreamContext
from sqlalchemy.engine import Engine

from api.batches import store
from api.batches.store import LineStatus
from broker.db import utcnow
from broker.streams import COLLECTOR
from schemas.vocab import ErrorCode
from schemas.wire import RESULTS_STREAM, CallResult, decode_result

log = logging.getLogger(__name__)


class ResultCollector:
    def __init__(self, engine: Engine, js: JetStreamContext, written: Callable[[], None]) -> None:
        """``written`` is called after each batch of results is in the database."""
        self.engine = engine
        self.js = js
        self._written = written
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._collect_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _collect_loop(self) -> None:
        sub = await self.js.pull_subscribe_bind(COLLECTOR, stream=RESULTS_STREAM)
        try:
            await self._collect(sub)
        finally:
            # An open pull subscription would hold the connection's drain at shutdown.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _collect(self, sub: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                messages = await sub.fetch(256, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:
                log.warning("result collector: %s", exc)
                await asyncio.sleep(1.0)
                continue
            outcomes = []
            for msg in messages:
                try:
                    outcomes.append(_outcome(decode_result(msg.data)))
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.error("malformed batch result dropped: %s", exc)
            try:
                await asyncio.to_thread(store.finish_lines, self.engine, outcomes, utcnow())
            except Exception:
                log.exception(
                    "could not write %d batch results; they will come back", len(messages)
                )
                await asyncio.sleep(1.0)
                continue  # not acked: redelivered after the ack wait
            for msg in messages:
                with contextlib.suppress(Exception):
                    await msg.ack()
            self._written()


def _outcome(result: CallResult) -> tuple[str, LineStatus, dict[str, Any] | None, str | None]:
    if result.error_code is None:
        # vLLM's own response body, as a non-streamed call would have received it.
        body = json.loads(result.body) if result.body is not None else None
        return result.call_id, LineStatus.COMPLETED, {"status_code": 200, "body": body}, None
    code = result.error_code
    status = {
        ErrorCode.DEADLINE_EXCEEDED: LineStatus.EXPIRED,
        ErrorCode.CANCELLED: LineStatus.CANCELLED,
    }.get(code, LineStatus.FAILED)
    return (
        result.call_id,
        status,
        store.line_error(code.value, result.error_message or ""),
        code.value,
    )
