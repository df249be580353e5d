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
- **Retention.** In the background too, ended batches (with their lines and results) and the
  uploaded files no batch names are deleted ``batch_retention_s`` after they ended or were
  uploaded.

A tick costs what changed since the last one, not the size of the batches: the runner keeps
each batch's open lines in memory (``api.batches.openlines``), read once when it takes the
batch, and then reads only the ids of the lines running now (to learn which ended, whichever
front door collected their results) and the bodies of the lines it starts. Only the sessions
whose lines changed, or whose admission retry is due, are looked at. The database stays the
truth: a runner that takes a batch over (or this one after a restart, or after a failed tick)
rebuilds the batch's lines from it, and a line is published with its fixed call id, so a line
published before a restart but not yet marked running is deduplicated by JetStream.

Batch calls are best-effort by default and go through the same worker pull policy, so they
soak up idle capacity without pushing interactive tiers out.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.engine import Engine

from api.batches import files, store
from api.batches.collector import ResultCollector
from api.batches.openlines import BatchLines, OpenLine, SessionLines
from api.batches.store import BatchRow, BatchStatus, LineStatus
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
# Batches (or files) deleted a transaction by the retention sweep: each may have tens of
# thousands of lines.
SWEEP_CHUNK = 16
# Bodies read at a time when a session's need is sized.
PEAK_CHUNK = 1000


@dataclass
class _SessionRun:
    lease: str | None = None
    retry_at: float = 0.0
    peak: list[CallEnvelope] | None = None
    """The calls that set the session's need (the largest prompt, the largest output) among
    its open lines when it was first sized: lines only end, so the need can only shrink."""


@dataclass
class _BatchRun:
    """What the runner keeps of a batch it holds between ticks."""

    lines: BatchLines
    dirty: dict[str, None]
    """Sessions to look at next tick (in the order they became so): just read, a line of theirs
    ended, or a start to retry."""
    deferred: list[tuple[float, str]] = field(default_factory=list)
    """Sessions whose admission is to be retried, as a heap of (monotonic time, session)."""
    touched_at: float = 0.0
    """When the leases of the batch's sessions were last kept alive (monotonic)."""
    cancel_sent: set[str] = field(default_factory=set)
    """Call ids of running lines told to stop (the batch is being cancelled)."""


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
        self._sessions: dict[tuple[str, str], _SessionRun] = {}
        self._batches: dict[str, _BatchRun] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # A lease idles out after this long without a touch; it is touched well within it.
        self._idle_timeout_s = max(60.0, 4 * settings.batch_tick_s)
        # A written result may let a session's next line start: the runner looks at once.
        self.collector = ResultCollector(engine, js, self.wake)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run_loop()),
            asyncio.create_task(self._sweep_loop()),
        ]
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
        held = {batch.id for batch in owned}
        for batch_id in [b for b in self._batches if b not in held]:
            # Taken over by another front door while this one was silent: theirs now.
            await self._forget(batch_id)
        for batch in owned:
            try:
                await self._advance(batch, now)
            except Exception:  # one batch's trouble must not hold up the batches after it
                log.exception("batch %s not advanced; retrying next tick", batch.id)
                # What is in memory may be behind the database now: rebuilt from it.
                self._batches.pop(batch.id, None)

    async def _advance(self, batch: BatchRow, now: datetime) -> None:
        run = self._batches.get(batch.id)
        if run is None:
            # Tens of thousands of lines, once: read and indexed off the event loop.
            lines = await asyncio.to_thread(self._read_lines, batch.id)
            run = self._batches[batch.id] = _BatchRun(lines, dict.fromkeys(lines.sessions))
        elif run.lines.running:
            # Whichever front door collected their results, lines that no longer run ended.
            still = await asyncio.to_thread(store.running_line_ids, self.engine, batch.id)
            ended = run.lines.ended([i for i in run.lines.running if i not in still])
            run.dirty.update(dict.fromkeys(ended))
        if batch.cancel_requested:
            await self._cancel(batch, run, now)
            return
        if now >= batch.expires_at:
            await self._expire(batch, run, now)
        clock = time.monotonic()
        while run.deferred and run.deferred[0][0] <= clock:
            run.dirty[heapq.heappop(run.deferred)[1]] = None
        todo: dict[str, None]
        todo, run.dirty = run.dirty, {}
        for key in todo:
            await self._advance_session(batch, run, key)
        if clock - run.touched_at >= self._idle_timeout_s / 4:
            run.touched_at = clock
            await self._keep_leases(batch.id, run)
        if run.lines.done:
            await self._finish(batch, now)

    def _read_lines(self, batch_id: str) -> BatchLines:
        return BatchLines.build(store.line_states(self.engine, batch_id))

    async def _expire(self, batch: BatchRow, run: _BatchRun, now: datetime) -> None:
        grace = (now - batch.expires_at).total_seconds() > EXPIRY_GRACE_S
        await asyncio.to_thread(
            store.end_open_lines,
            self.engine,
            batch.id,
            LineStatus.EXPIRED,
            ErrorCode.DEADLINE_EXCEEDED.value,
            now,
            only_pending=not grace,
        )
        run.dirty.update(dict.fromkeys(run.lines.end_pending()))
        if grace:
            run.dirty.update(dict.fromkeys(run.lines.ended(list(run.lines.running))))

    async def _advance_session(self, batch: BatchRow, run: _BatchRun, key: str) -> None:
        lines = run.lines.sessions.get(key)
        if lines is None:
            return
        if not lines.done:
            await self._start_lines(batch, run, lines)
        if lines.done:
            run.lines.forget(key)
            await self._end_lease(batch.id, key)

    async def _start_lines(self, batch: BatchRow, run: _BatchRun, lines: SessionLines) -> None:
        start = lines.runnable()
        if not start:
            return
        bodies = await asyncio.to_thread(
            store.line_bodies, self.engine, [line.id for line in start]
        )
        sendable: list[tuple[OpenLine, CallEnvelope]] = []
        for line in start:
            call = self._line_call(batch, line, bodies.get(line.id))
            if isinstance(call, InvalidRequest):
                # Failed alone, before admission sizes the session; the lines after it may start.
                await self._fail_lines(run, [line], call.code, call.message)
                run.dirty[lines.key] = None
                self.wake()
            else:
                sendable.append((line, call))
        if not sendable:
            return
        session = self._sessions.setdefault((batch.id, lines.key), _SessionRun())
        if session.lease is None and not await self._admit(batch, run, lines, session):
            return
        assert session.lease is not None
        started: list[OpenLine] = []
        started_at = utcnow()
        for line, call in sendable:
            try:
                await self._publish(batch, msgspec.structs.replace(call, session_id=session.lease))
            except KvgateError as exc:
                log.warning("batch %s line %d not queued yet: %s", batch.id, line.line_no, exc)
                run.dirty[lines.key] = None  # tried again next tick
                break
            started.append(line)
        if started:
            await asyncio.to_thread(
                store.mark_started, self.engine, [line.id for line in started], started_at
            )
            run.lines.started(started)

    async def _admit(
        self, batch: BatchRow, run: _BatchRun, lines: SessionLines, session: _SessionRun
    ) -> bool:
        if time.monotonic() < session.retry_at:
            return False  # looked at again when the retry is due (``_BatchRun.deferred``)
        tenant = self.admitter.tenancy.by_id(batch.tenant)
        if tenant is None:
            await self._fail_session(
                run, lines.key, ErrorCode.UNAUTHORIZED, "the tenant no longer exists"
            )
            return False
        if session.peak is None:
            # Sized from the calls as they will be published; a line that cannot be one is
            # failed when its turn comes (see ``_line_call``).
            session.peak = await asyncio.to_thread(self._peak_calls, batch, lines)
        left_s = (batch.expires_at - utcnow()).total_seconds()
        need = needs.for_batch(
            Tier(batch.tier), session.peak, lines=lines.total, widest=lines.widest, left_s=left_s
        )
        try:
            admitted = await self.admitter.admit(
                tenant,
                need,
                scope="batch",
                idle_timeout_s=self._idle_timeout_s,
                metadata={"batch": batch.id},
            )
        except Refused as exc:
            if exc.retry_after is None:  # waiting cannot help (the deadline is infeasible)
                await self._fail_session(run, lines.key, exc.code, exc.message)
                return False
            self._defer(run, lines.key, session, exc.retry_after)
            return False
        except RetryableError as exc:
            self._defer(run, lines.key, session, exc.retry_after or 5)
            return False
        session.lease = admitted.record.id
        return True

    def _defer(self, run: _BatchRun, key: str, session: _SessionRun, retry_after: float) -> None:
        session.retry_at = time.monotonic() + retry_after
        heapq.heappush(run.deferred, (session.retry_at, key))

    def _peak_calls(self, batch: BatchRow, lines: SessionLines) -> list[CallEnvelope]:
        """The calls of the session's open lines with the largest prompt and the largest
        output: all the need is sized from. Blocking (reads every open line's body)."""
        ids = [line.id for line in (*lines.pending, *lines.running) if not line.ended]
        by_id = {line.id: line for line in (*lines.pending, *lines.running)}
        prompt: CallEnvelope | None = None
        output: CallEnvelope | None = None
        for start in range(0, len(ids), PEAK_CHUNK):
            bodies = store.line_bodies(self.engine, ids[start : start + PEAK_CHUNK])
            for line_id, body in bodies.items():
                call = self._line_call(batch, by_id[line_id], body)
                if not isinstance(call, CallEnvelope):
                    continue
                if prompt is None or call.est_prompt_tokens > prompt.est_prompt_tokens:
                    prompt = call
                if output is None or call.max_tokens > output.max_tokens:
                    output = call
        return [call for call in (prompt, output) if call is not None]

    def _line_call(
        self, batch: BatchRow, line: OpenLine, body: dict[str, Any] | None
    ) -> CallEnvelope | InvalidRequest:
        """The line's call, or why it can never be one. Lines were validated on submit, but a
        line stored before a check existed, or under limits since lowered, must fail alone:
        raised, it would stop its batch (and its session's lease) on every tick."""
        try:
            return self._envelope(batch, line, body)
        except InvalidRequest as exc:
            return exc
        except Exception as exc:  # a body no check foresaw is still that line's failure only
            log.exception("batch %s line %d cannot be sent", batch.id, line.line_no)
            return InvalidRequest(f"the line cannot be sent: {exc}")

    def _envelope(
        self, batch: BatchRow, line: OpenLine, body: dict[str, Any] | None
    ) -> CallEnvelope:
        """The line's call, with its fixed call id and the batch window as its deadline; its
        session is named once admitted (built once, before admission sizes the session)."""
        if body is None:
            raise InvalidRequest("the line's body is gone")
        raw = msgspec.json.encode(body)
        chat = parse_chat_request(raw, self.settings)
        left_s = max(0.001, (batch.expires_at - utcnow()).total_seconds())
        call = to_envelope(
            chat,
            raw,
            self.settings,
            tier=Tier(batch.tier),
            timeout_s=left_s,
            session_id="",
        )
        return msgspec.structs.replace(call, call_id=line.call_id)

    async def _publish(self, batch: BatchRow, call: CallEnvelope) -> None:
        await self.publisher.publish(
            call,
            None,
            now_ms=int(time.time() * 1000),
            result_subject=f"{RESULT_SUBJECT_PREFIX}{batch.id}",
        )

    async def _fail_lines(
        self, run: _BatchRun, lines: list[OpenLine], code: ErrorCode, message: str
    ) -> None:
        """Pending lines that can never start."""
        await self._finish_lines(lines, code, message)
        run.lines.failed(lines)

    async def _fail_session(self, run: _BatchRun, key: str, code: ErrorCode, message: str) -> None:
        """Every open line of the session, running ones too (the first result still wins)."""
        lines = run.lines.end_session(key)
        await self._finish_lines(lines, code, message)

    async def _finish_lines(self, lines: list[OpenLine], code: ErrorCode, message: str) -> None:
        outcomes = [
            (line.call_id, LineStatus.FAILED, store.line_error(code.value, message), code.value)
            for line in lines
        ]
        await asyncio.to_thread(store.finish_lines, self.engine, outcomes, utcnow())

    async def _keep_leases(self, batch_id: str, run: _BatchRun) -> None:
        now_ms = int(time.time() * 1000)
        for key in run.lines.sessions:
            session = self._sessions.get((batch_id, key))
            if session is not None and session.lease is not None:
                await self.admitter.store_for(session.lease).touch(session.lease, now_ms)

    async def _end_lease(self, batch_id: str, key: str) -> None:
        session = self._sessions.pop((batch_id, key), None)
        if session is not None and session.lease is not None:
            store_ = self.admitter.store_for(session.lease)
            with contextlib.suppress(KvgateError):
                await store_.release(session.lease, SessionState.CLOSED, int(time.time() * 1000))

    async def _forget(self, batch_id: str) -> None:
        """Drop what this runner holds of a batch, and close its sessions' leases."""
        self._batches.pop(batch_id, None)
        for held, key in [k for k in self._sessions if k[0] == batch_id]:
            await self._end_lease(held, key)

    async def _cancel(self, batch: BatchRow, run: _BatchRun, now: datetime) -> None:
        await asyncio.to_thread(
            store.end_open_lines,
            self.engine,
            batch.id,
            LineStatus.CANCELLED,
            ErrorCode.CANCELLED.value,
            now,
            only_pending=True,
        )
        run.lines.end_pending()
        running = list(run.lines.running.values())
        for line in running:
            if line.call_id not in run.cancel_sent:
                run.cancel_sent.add(line.call_id)
                await self.nc.publish(f"{CANCEL_SUBJECT_PREFIX}{line.call_id}", b"")
        if not running:
            await self._finish(batch, now, BatchStatus.CANCELLED)

    async def _finish(
        self, batch: BatchRow, now: datetime, status: BatchStatus | None = None
    ) -> None:
        """End the batch, whose lines have all ended as far as this runner knows; the database
        has the last word (a line still open there means what is in memory is behind it: it is
        rebuilt next tick)."""
        counts = await asyncio.to_thread(store.line_counts, self.engine, batch.id)
        if any(counts[status] for status in store.OPEN_LINES):
            log.warning("batch %s has open lines this runner missed; reading it again", batch.id)
            self._batches.pop(batch.id, None)
            return
        if status is None:
            expired = counts[LineStatus.EXPIRED.value]
            status = BatchStatus.EXPIRED if expired else BatchStatus.COMPLETED
        await asyncio.to_thread(store.set_status, self.engine, batch.id, status, now)
        await self._forget(batch.id)
        log.info("batch %s %s", batch.id, status.value)

    # -- retention ---------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        retention_s = self.settings.batch_retention_s
        interval_s = max(self.settings.batch_tick_s, min(60.0, retention_s / 4))
        while True:
            try:
                await self.sweep(utcnow())
            except Exception:
                log.exception("batch retention sweep failed; retrying")
            await asyncio.sleep(interval_s)

    async def sweep(self, now: datetime) -> tuple[int, int]:
        """Delete what the retention has passed: ended batches (with their lines and results),
        then the uploaded files no batch names. Returns how many of each."""
        cutoff = now - timedelta(seconds=self.settings.batch_retention_s)
        batches = await self._sweep(store.delete_ended_before, cutoff)
        uploads = await self._sweep(files.delete_unused_before, cutoff)
        if batches or uploads:
            log.info("retention: deleted %d batches and %d files", batches, uploads)
        return batches, uploads

    async def _sweep(self, delete: Callable[[Engine, datetime, int], int], cutoff: datetime) -> int:
        total = 0
        while True:
            deleted = await asyncio.to_thread(delete, self.engine, cutoff, SWEEP_CHUNK)
            total += deleted
            if deleted < SWEEP_CHUNK:
                return total
