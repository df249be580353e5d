"""Run batches in the background of every front door.

- **Runner.** Each tick it claims the unfinished batches nobody else runs (a front door that
  stops renewing its claim for ``batch_runner_stale_s`` loses them to the next one), and for
  each session of each batch: admits it through the same session admission as interactive
  traffic (a deferred session is retried by kvgate after its ``Retry-After``, never bounced to
  the caller), publishes the lines that may start (a session's lines run in order; a line
  marked ``parallel`` starts alongside the one before it), keeps the session's lease alive,
  and closes it when the session's lines are all done. Lines carry the batch's deadline (the
  end of its completion window) and no reply inbox: the worker publishes one durable result.
- **Collector** (``api.batches.collector``), started and stopped with the runner, writes the
  workers' results to their lines.

Batch calls are best-effort by default and go through the same worker pull policy, so they
soak up idle capacity without pushing interactive tiers out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.engine import Engine

from api.batches import store
from api.batches.collector import ResultCollector
from api.batches.store import BatchRow, BatchStatus, LineRow, LineStatus
from api.chat_request import parse_chat_request, to_envelope
from broker.admission import needs
from broker.admission.admitter import Admitter
from broker.db import utcnow
from broker.errors import InvalidRequest, KvgateError, Refused, RetryableError
from broker.publisher import CallPublisher
from broker.settings import ApiSettings
from schemas.vocab import ErrorCode, SessionState, Tier
from schemas.wire import (
    CANCEL_SUBJECT_PREFIX,
    RESULT_SUBJECT_PREFIX,
    CallEnvelope,
)

log = logging.getLogger(__name__)

# Lines still running this long after their batch's window closed are given up as expired
# (their calls' TTLs have dropped them from the queue by then).
EXPIRY_GRACE_S = 30.0


@dataclass
class _SessionRun:
    lease: str | None = None
    retry_at: float = 0.0


def runnable(lines: list[LineRow]) -> list[LineRow]:
    """The pending lines of one session (in line order) that may start now: a line waits for
    every earlier line, except that a ``parallel`` line does not wait for the line before it
    (nor for the parallel run it belongs to). One pass: the runner decides this for every
    session on every tick, and a session may have tens of thousands of lines."""
    first_open = next((i for i, line in enumerate(lines) if not line.terminal), len(lines))
    out: list[LineRow] = []
    run_start = 0  # where the run of parallel lines that ``line`` belongs to begins
    for i, line in enumerate(lines):
        if not line.parallel:
            run_start = i
        if run_start > first_open:
            break  # this run, and every later one, waits for the open line before it
        if line.status == LineStatus.PENDING.value:
            out.append(line)
    return out


def widest_group(lines: list[LineRow]) -> int:
    width = best = 0
    for line in lines:
        width = width + 1 if line.parallel else 1
        best = max(best, width)
    return max(best, 1)


class BatchRunner:
    def __init__(
        self,
        settings: ApiSettings,
        engine: Engine,
        admitter: Admitter,
        publisher: CallPublisher,
        nc: NATS,
        js: JetStreamContext,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.admitter = admitter
        self.publisher = publisher
        self.nc = nc
        self.js = js
        self.runner_id = f"{admitter.replica}-{uuid.uuid4().hex[:6]}"
        self._sessions: dict[tuple[str, str], _SessionRun] = defaultdict(_SessionRun)
        self._cancel_sent: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # A written result may let a session's next line start: the runner looks at once.
        self.collector = ResultCollector(engine, js, self.wake)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run_loop())]
        self.collector.start()

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        await self.collector.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- runner ------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("batch runner tick failed; retrying")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.batch_tick_s)

    async def tick(self) -> None:
        now = utcnow()
        owned = await asyncio.to_thread(
            store.claim_batches,
            self.engine,
            self.runner_id,
            now,
            self.settings.batch_runner_stale_s,
        )
        for batch in owned:
            try:
                await self._advance(batch, now)
            except Exception:  # one batch's trouble must not hold up the batches after it
                log.exception("batch %s not advanced; retrying next tick", batch.id)

    async def _advance(self, batch: BatchRow, now: datetime) -> None:
        lines = await asyncio.to_thread(store.lines_of, self.engine, batch.id)
        if batch.cancel_requested:
            await self._cancel(batch, lines, now)
            return
        if now >= batch.expires_at:
            grace = (now - batch.expires_at).total_seconds() > EXPIRY_GRACE_S
            changed = await asyncio.to_thread(
                store.end_open_lines,
                self.engine,
                batch.id,
                LineStatus.EXPIRED,
                ErrorCode.DEADLINE_EXCEEDED.value,
                now,
                only_pending=not grace,
            )
            if changed:
                lines = await asyncio.to_thread(store.lines_of, self.engine, batch.id)
        sessions: dict[str, list[LineRow]] = defaultdict(list)
        for line in lines:
            sessions[line.session_key].append(line)
        for key, session_lines in sessions.items():
            await self._advance_session(batch, key, session_lines, now)
        if all(line.terminal for line in lines):
            expired = any(line.status == LineStatus.EXPIRED.value for line in lines)
            final = BatchStatus.EXPIRED if expired else BatchStatus.COMPLETED
            await asyncio.to_thread(store.set_status, self.engine, batch.id, final, now)
            log.info("batch %s %s", batch.id, final.value)

    async def _advance_session(
        self, batch: BatchRow, key: str, lines: list[LineRow], now: datetime
    ) -> None:
        run = self._sessions[(batch.id, key)]
        if all(line.terminal for line in lines):
            await self._end_lease(batch.id, key)
            return
        start = runnable(lines)
        if run.lease is not None:
            await self.admitter.store_for(run.lease).touch(run.lease, int(time.time() * 1000))
        sendable: list[LineRow] = []
        for line in start:
            checked = self._line_call(batch, line, "")
            if isinstance(checked, InvalidRequest):
                # Failed alone, before admission sizes the session; the lines after it may start.
                await self._fail_lines([line], checked.code, checked.message)
                self.wake()
            else:
                sendable.append(line)
        if not sendable:
            return
        if run.lease is None and not await self._admit(batch, run, lines, now):
            return
        assert run.lease is not None
        started: list[int] = []
        started_at = utcnow()
        for line in sendable:
            call = self._line_call(batch, line, run.lease)
            if isinstance(call, InvalidRequest):
                await self._fail_lines([line], call.code, call.message)
                continue
            try:
                await self._publish(batch, call)
            except KvgateError as exc:
                log.warning("batch %s line %d not queued yet: %s", batch.id, line.line_no, exc)
                break
            started.append(line.id)
        if started:
            await asyncio.to_thread(store.mark_started, self.engine, started, started_at)

    async def _admit(
        self, batch: BatchRow, run: _SessionRun, lines: list[LineRow], now: datetime
    ) -> bool:
        if time.monotonic() < run.retry_at:
            return False
        tenant = self.admitter.tenancy.by_id(batch.tenant)
        if tenant is None:
            await self._fail_lines(lines, ErrorCode.UNAUTHORIZED, "the tenant no longer exists")
            return False
        left_s = (batch.expires_at - now).total_seconds()
        # Sized from the calls as they will be published; a line that cannot be one is failed
        # when its turn comes (see ``_line_call``).
        calls = [
            call
            for line in lines
            if not line.terminal
            if isinstance(call := self._line_call(batch, line, ""), CallEnvelope)
        ]
        need = needs.for_batch(
            Tier(batch.tier), calls, lines=len(lines), widest=widest_group(lines), left_s=left_s
        )
        try:
            admitted = await self.admitter.admit(
                tenant,
                need,
                scope="batch",
                idle_timeout_s=max(60.0, 4 * self.settings.batch_tick_s),
                metadata={"batch": batch.id},
            )
        except Refused as exc:
            if exc.retry_after is None:  # waiting cannot help (the deadline is infeasible)
                await self._fail_lines(lines, exc.code, exc.message)
                return False
            run.retry_at = time.monotonic() + exc.retry_after
            return False
        except RetryableError as exc:
            run.retry_at = time.monotonic() + (exc.retry_after or 5)
            return False
        run.lease = admitted.record.id
        return True

    def _line_call(
        self, batch: BatchRow, line: LineRow, session_id: str
    ) -> CallEnvelope | InvalidRequest:
        """The line's call, or why it can never be one. Lines were validated on submit, but a
        line stored before a check existed, or under limits since lowered, must fail alone:
        raised, it would stop its batch (and its session's lease) on every tick."""
        try:
            return self._envelope(batch, line, session_id)
        except InvalidRequest as exc:
            return exc
        except Exception as exc:  # a body no check foresaw is still that line's failure only
            log.exception("batch %s line %d cannot be sent", batch.id, line.line_no)
            return InvalidRequest(f"the line cannot be sent: {exc}")

    def _envelope(self, batch: BatchRow, line: LineRow, session_id: str) -> CallEnvelope:
        """The line's call, with its fixed call id and the batch window as its deadline."""
        body = msgspec.json.encode(line.body)
        chat = parse_chat_request(body, self.settings)
        left_s = max(0.001, (batch.expires_at - utcnow()).total_seconds())
        call = to_envelope(
            chat,
            body,
            self.settings,
            tier=Tier(batch.tier),
            timeout_s=left_s,
            session_id=session_id,
        )
        return msgspec.structs.replace(call, call_id=line.call_id)

    async def _publish(self, batch: BatchRow, call: CallEnvelope) -> None:
        await self.publisher.publish(
            call,
            None,
            now_ms=int(time.time() * 1000),
            result_subject=f"{RESULT_SUBJECT_PREFIX}{batch.id}",
        )

    async def _fail_lines(self, lines: list[LineRow], code: ErrorCode, message: str) -> None:
        outcomes = [
            (line.call_id, LineStatus.FAILED, store.line_error(code.value, message), code.value)
            for line in lines
            if not line.terminal
        ]
        await asyncio.to_thread(store.finish_lines, self.engine, outcomes, utcnow())

    async def _end_lease(self, batch_id: str, key: str) -> None:
        run = self._sessions.pop((batch_id, key), None)
        if run is not None and run.lease is not None:
            store_ = self.admitter.store_for(run.lease)
            with contextlib.suppress(KvgateError):
                await store_.release(run.lease, SessionState.CLOSED, int(time.time() * 1000))

    async def _cancel(self, batch: BatchRow, lines: list[LineRow], now: datetime) -> None:
        await asyncio.to_thread(
            store.end_open_lines,
            self.engine,
            batch.id,
            LineStatus.CANCELLED,
            ErrorCode.CANCELLED.value,
            now,
            only_pending=True,
        )
        running = [line for line in lines if line.status == LineStatus.RUNNING.value]
        for line in running:
            if line.call_id not in self._cancel_sent:
                self._cancel_sent.add(line.call_id)
                await self.nc.publish(f"{CANCEL_SUBJECT_PREFIX}{line.call_id}", b"")
        if not running:
            for key in {line.session_key for line in lines}:
                await self._end_lease(batch.id, key)
            await asyncio.to_thread(
                store.set_status, self.engine, batch.id, BatchStatus.CANCELLED, now
            )
            log.info("batch %s cancelled", batch.id)
