"""The worker process shell: NATS connection, pull credit, staging, one task per call,
heartbeats, drain.

Whenever something changes (a call arrives or ends, a pull request expires, a staged call's
deadline comes), the worker steps its pure scheduling state (``workers.core.WorkerCore``) and
carries out what it decides:

1. drops staged calls whose deadline passed (``term``, and an ``error`` event to the caller);
2. hands staged calls to the engine while ``workers.headroom`` says they fit, tier first;
3. opens the new credit per tier that ``workers.pullplan`` plans for the room that is left.

The core holds each call's scheduling state (staged or running, its load, its deadline); this
shell holds the same call's message, relay, tasks and trace, under the same id.

Calls then arrive on their own. Each is rendered and tokenized on arrival by vLLM's serving
layer (its cost is the prompt the engine will hold, tools included, plus its output budget),
staged, and started when it fits; its task relays the serving layer's output to the caller's
inbox, keeps the message alive with ``in_progress()``, and acks at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from broker import natsconn
from broker.streams import provision_calls, provision_results, workers_bucket
from schemas.vocab import TIERS_BY_PRIORITY, ErrorCode, Tier
from schemas.wire import (
    CANCEL_SUBJECT_PREFIX,
    INBOX_PREFIX,
    RESULT_SUBJECT_PREFIX,
    CallEnvelope,
    Header,
    Usage,
    WorkerHeartbeat,
    decode_call,
    encode,
)
from workers.acks import Settle, settle
from workers.core import WorkerCore
from workers.engine import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineRequestError,
    PreparedRequest,
)
from workers.headroom import engine_priority
from workers.puller import TierPuller
from workers.pullplan import TierView
from workers.relay import Relay, ReplyRelay
from workers.result_relay import ResultRelay
from workers.settings import WorkerSettings
from workers.tracing import CallTrace

log = logging.getLogger(__name__)

DRAIN_CANCEL_BOUND_S = 10.0
"""After the drain's grace, how long its cancelled calls may take to end before the worker
hands them back and stops regardless (an engine that does not answer an abort; seen once in
CI: a worker draining for ever)."""

# How often a call that is not streamed tells its caller that it is still generating (the
# engine yields at least this often too); far below the front door's idle timeout (60 s).
_PROGRESS_S = 5.0
# How long a cancel is remembered for a call this worker has not received yet: a cancel can
# overtake its call (the caller gave up while the call was still queued or being delivered).
_CANCEL_MEMORY_S = 600.0


class _StopReason:
    CANCELLED = "cancelled"
    CALLER_GONE = "caller_gone"
    DRAIN = "drain"
    ABANDONED = "abandoned"
    """Ended by the drain when its cancel did not end it: nothing more to do when it ends."""


@dataclass(eq=False)
class _Call:
    """A call this worker holds, staged or running (which of the two is the core's to say)."""

    msg: Msg
    envelope: CallEnvelope
    prepared: PreparedRequest
    relay: Relay
    progress: asyncio.Task[None]
    trace: CallTrace
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None

    @property
    def call_id(self) -> str:
        return self.envelope.call_id


@dataclass
class WorkerCounters:
    """Cumulative outcomes, for heartbeats, benchmarks and tests."""

    started: int = 0
    completed: int = 0
    deadline_dropped: int = 0
    cancelled: int = 0
    handed_back: int = 0
    rescued: int = 0
    """Calls started by the rescue rule (``workers.headroom``)."""
    failed: int = 0
    faulted: int = 0
    """Calls that a fault outside the engine's own errors interrupted (an ack or a publish that
    failed or timed out, a bug): handed back, or ended for good once answered, on the last
    attempt, or when it struck while the call was prepared (it would strike again)."""
    ended: int = 0
    """Calls ended for good here (acked or terminated), whatever their outcome: the counters
    above sort calls by outcome, and a call ended after a fault or refused by the serving
    layer is in none of completed, cancelled and deadline_dropped. Each call queued ends once,
    at one worker, or leaves the stream unstarted at its deadline (tests/chaos.py's
    accounting)."""
    max_committed_tokens: int = 0


class Worker:
    def __init__(self, engine: Engine, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.policy = settings.headroom.policy()
        self.counters = WorkerCounters()
        self._nc: NATS | None = None
        self._kv: KeyValue | None = None
        self._pullers: dict[Tier, TierPuller] = {}
        self._core = WorkerCore(self.policy)
        self._calls: dict[str, _Call] = {}
        """Every call the core holds, staged or running, by the same id."""
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._fatal: BaseException | None = None
        self._arrivals: set[asyncio.Task[None]] = set()
        self._cancelled: dict[str, float] = {}
        self._preparing: set[str] = set()

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "worker is not connected"
        return self._nc

    def request_stop(self) -> None:
        """Begin the drain: stop asking for work, let running calls finish within the grace.
        Asked again while draining (a second SIGTERM or Ctrl-C), the grace ends at once: the
        running calls are handed back for other workers."""
        if self._stopping.is_set() and not self._hurry.is_set():
            log.warning("stop asked again: handing back the running calls now")
            self._hurry.set()
        self._stopping.set()
        self._changed.set()

    async def run(self) -> None:
        """Serve until ``request_stop()`` (or a dead engine, which is re-raised)."""
        self._nc = await natsconn.connect(
            self.settings.nats_url,
            self.settings.nats,
            name=f"kvgate-worker {self.settings.worker_id}",
            max_reconnect_attempts=-1,
        )
        try:
            js = self.nc.jetstream()
            await provision_calls(js, self.settings.stream, self.engine.model_name)
            await provision_results(js, self.settings.stream)
            self._kv = await workers_bucket(js, self.settings.stream)
            cancel_sub = await self.nc.subscribe(f"{CANCEL_SUBJECT_PREFIX}*", cb=self._on_cancel)
            for tier in TIERS_BY_PRIORITY:
                puller = TierPuller(
                    self.nc,
                    tier,
                    self.engine.model_name,
                    self._on_message,
                    self._changed.set,
                    expires_s=self.settings.pull_expires_s,
                )
                await puller.start()
                self._pullers[tier] = puller
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            log.info("worker %s serving %s", self.settings.worker_id, self.engine.model_name)
            try:
                await self._intake_loop()
                await self._drain()
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
                await cancel_sub.unsubscribe()
                await self._remove_heartbeat()
        finally:
            await self._disconnect()
        if self._fatal is not None:
            raise self._fatal

    async def _disconnect(self) -> None:
        """Drain the connection: what its subscriptions hold is handled, its publishes (the
        last answers and acks) flushed. A connection that is reconnecting (the server is
        away) cannot drain, and raised out of ``run`` a stop that had otherwise gone well: it
        is closed instead, and what it had not sent is the server's to redeliver after the
        ack wait, as for a worker that died."""
        try:
            await self.nc.drain()
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError):
            log.warning("NATS is away: closing the connection without draining it")
            # nats.py's close writes what it buffered while reconnecting to the dead socket,
            # and raises; the client is closed by then all the same.
            with contextlib.suppress(ConnectionError):
                await self.nc.close()

    # -- intake --------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        while not self._stopping.is_set():
            self._changed.clear()
            now = time.monotonic()
            self._drop_expired_staged()
            self._start_what_fits(now)
            await self._open_credit(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._next_wake_s())

    def _start_what_fits(self, now: float) -> None:
        starts = self._core.start(self.engine.stats(), now)
        for start in starts:
            call = self._calls[start.call_id]
            call.trace.started(start.room_tokens, start.running, start.together, start.rescued)
            self.counters.started += 1
            self.counters.rescued += start.rescued
            call.task = asyncio.create_task(self._serve(call))
            call.task.add_done_callback(functools.partial(self._finished, call))
        if starts:
            self.counters.max_committed_tokens = max(
                self.counters.max_committed_tokens, self._committed_tokens()
            )

    def _committed_tokens(self) -> int:
        return self._core.committed_tokens(self.engine.stats().block_size)

    async def _open_credit(self, now: float) -> None:
        for puller in self._pullers.values():
            # A request whose expiry notice was lost (a reconnect, a server restart) would
            # count as open credit for ever, and the tier would never be asked for again.
            puller.sweep(now)
        plain = [
            TierView(t, self._pullers[t].outstanding, self._pullers[t].backlog)
            for t in TIERS_BY_PRIORITY
        ]
        for tier, n in self._core.pulls(self.engine.stats(), plain, now).items():
            await self._pullers[tier].request(n)

    def _next_wake_s(self) -> float:
        return self._core.next_wake_s(
            time.time() * 1000, self.settings.pull_expires_s, time.monotonic()
        )

    def _on_message(self, tier: Tier, msg: Msg) -> None:
        if self._stopping.is_set():
            # Arrived after the drain began: hand it straight back to another worker.
            self._spawn(self._nak(msg))
            return
        self._spawn(self._arrive(tier, msg))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._arrivals.add(task)
        task.add_done_callback(self._arrivals.discard)

    async def _nak(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            await msg.nak()

    async def _arrive(self, tier: Tier, msg: Msg) -> None:
        try:
            await self._take(tier, msg)
        except Exception:
            # NATS failed a term or a NAK, say: the server delivers the call again after the
            # ack wait. Logged here, not left to end the task unseen.
            call_id = msg.headers.get(Header.CALL) if msg.headers else None
            log.exception("call %s: its arrival failed in the worker", call_id)
        finally:
            # Whatever became of it, the call used a pull credit: plan again now, or a call
            # refused here (a bad field, a prompt too long) would leave its tier without
            # credit until the pull request expired (seen: the next call waited 10 s).
            self._changed.set()

    async def _take(self, tier: Tier, msg: Msg) -> None:
        headers = msg.headers or {}
        inbox = headers.get(Header.REPLY)
        result_subject = headers.get(Header.RESULT)
        attempt = int(msg.metadata.num_delivered or 1)
        if not inbox and not result_subject:
            log.error("call with neither %s nor %s; terminating it", Header.REPLY, Header.RESULT)
            await self._settle(msg, Settle.TERM)
            return
        # Answers go only where answers belong: a call naming another subject (a calls queue,
        # a cancel) would make this worker publish there (NATS's permissions refuse it too).
        if (inbox and not inbox.startswith(INBOX_PREFIX)) or (
            result_subject and not result_subject.startswith(RESULT_SUBJECT_PREFIX)
        ):
            log.error("call whose answer goes to %r; terminating it", inbox or result_subject)
            await self._settle(msg, Settle.TERM)
            return
        try:
            envelope = decode_call(msg.data)
            body = json.loads(envelope.body)
            if not isinstance(body, dict):
                raise msgspec.ValidationError("the request body is not a JSON object")
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            log.error("malformed call message, terminated: %s", exc)
            if inbox:
                await ReplyRelay(self.nc, inbox, attempt, self.settings.worker_id).fail(
                    ErrorCode.INTERNAL_ERROR, f"malformed call message: {exc}"
                )
            await self._settle(msg, Settle.TERM)
            return
        relay: Relay
        if result_subject:
            relay = ResultRelay(self.nc.jetstream(), result_subject, envelope.call_id, attempt)
        else:
            assert inbox is not None
            relay = ReplyRelay(
                self.nc,
                inbox,
                attempt,
                self.settings.worker_id,
                gather_tokens=self.settings.stream_gather_tokens,
            )
        call_id = envelope.call_id
        if self._core.holds(call_id) or call_id in self._preparing:
            # A second delivery while the first is still here: its ack wait lapsed (preparing a
            # call sends no ``in_progress()``). Handed back at once, it came straight back,
            # spending a pull credit and a delivery attempt each time until the copy here
            # ended; handed back after an ack wait, at most one more comes per ack wait.
            await msg.nak(delay=self.settings.stream.ack_wait_s)
            return
        spans = CallTrace.arrived(msg, envelope, attempt, self.settings.worker_id)
        if call_id in self._cancelled:
            self.counters.cancelled += 1
            spans.refused("cancelled")
            await relay.fail(ErrorCode.CANCELLED, "the call was cancelled by its caller")
            await self._settle(msg, Settle.TERM)
            return
        if time.time() * 1000 >= envelope.deadline_ms:
            await self._deadline_passed(msg, relay, spans)
            return
        try:
            await self._prepare(tier, msg, envelope, body, relay, spans)
        except Exception as exc:
            await self._arrival_fault(call_id, msg, relay, spans, exc)

    async def _prepare(
        self,
        tier: Tier,
        msg: Msg,
        envelope: CallEnvelope,
        body: dict[str, Any],
        relay: Relay,
        spans: CallTrace,
    ) -> None:
        """Has the engine's serving layer render the call, then stages it to start when it
        fits. Ends the call itself where the engine refused it or failed."""
        call_id = envelope.call_id
        session_ms = envelope.session_started_ms or envelope.created_ms
        request = EngineRequest(
            call_id,
            envelope.endpoint,
            body,
            envelope.max_tokens,
            engine_priority(tier, session_ms),
        )
        self._preparing.add(call_id)
        preparing_since = time.perf_counter()
        try:
            prepared = await self.engine.prepare(request)
        except EngineRequestError as exc:
            spans.refused(exc.code.value)
            await self._engine_refused(msg, relay, exc)
            return
        except EngineError as exc:
            spans.refused("engine_error")
            # Handed back on the last attempt too, the call would end only at its deadline.
            await self._engine_failed(msg, relay, exc)
            return
        finally:
            self._preparing.discard(call_id)
        if call_id in self._cancelled or self._stopping.is_set():
            # Cancelled, or the drain began, while the serving layer rendered it.
            await self.engine.discard(prepared)
            if call_id in self._cancelled:
                self.counters.cancelled += 1
                spans.refused("cancelled")
                await relay.fail(ErrorCode.CANCELLED, "the call was cancelled by its caller")
                await self._settle(msg, Settle.TERM)
            else:
                await msg.nak()
            return
        try:
            staged = self._core.stage(
                call_id,
                tier,
                prompt_tokens=prepared.prompt_tokens,
                max_tokens=prepared.max_tokens,
                block_size=self.engine.stats().block_size,
                session_started_ms=session_ms,
                deadline_ms=envelope.deadline_ms,
                now_s=time.monotonic(),
                ttft_objective_ms=envelope.ttft_objective_ms,
                waited_ms=max(0, time.time() * 1000 - spans.published_ms),
            )
        except Exception:
            await self.engine.discard(prepared)  # held at the engine's door: let it go
            raise
        progress = asyncio.create_task(self._keep_alive(call_id, msg, relay, envelope.created_ms))
        spans.staged(staged.cost, (time.perf_counter() - preparing_since) * 1000)
        self._calls[call_id] = _Call(msg, envelope, prepared, relay, progress, spans)
        self._changed.set()

    async def _arrival_fault(
        self, call_id: str, msg: Msg, relay: Relay, spans: CallTrace, exc: Exception
    ) -> None:
        """Ends a call that a fault outside the engine's own errors stopped before it was
        staged (a chat template that raised while the serving layer rendered the request, a
        bug): the caller is told and the message terminated. Such a fault recurs on every
        delivery, and unhandled it ended the task unseen: the call came back after each ack
        wait, and its caller heard nothing until its deadline."""
        attempt = int(msg.metadata.num_delivered or 1)
        self.counters.faulted += 1
        log.error(
            "call %s failed in the worker on arrival (attempt %d)", call_id, attempt, exc_info=exc
        )
        spans.refused(ErrorCode.INTERNAL_ERROR.value)
        try:
            try:
                await relay.fail(
                    ErrorCode.INTERNAL_ERROR,
                    f"the worker failed while preparing call {call_id}; its log has the cause",
                )
            finally:  # the relay may be what fails: end the message all the same
                await self._settle(msg, Settle.TERM)
        except Exception as again:
            # Out of this worker's hands: the server delivers it again after the ack wait.
            log.error("call %s: could not end its message after the fault: %r", call_id, again)

    async def _deadline_passed(self, msg: Msg, relay: Relay, spans: CallTrace) -> None:
        self.counters.deadline_dropped += 1
        spans.refused(ErrorCode.DEADLINE_EXCEEDED.value)
        await relay.fail(
            ErrorCode.DEADLINE_EXCEEDED, "the call's deadline passed before it started"
        )
        await self._settle(msg, Settle.TERM)

    def _drop_expired_staged(self) -> None:
        for call_id in self._core.expire(time.time() * 1000):
            call = self._calls.pop(call_id)
            call.progress.cancel()
            self._spawn(self.engine.discard(call.prepared))
            self._spawn(self._deadline_passed(call.msg, call.relay, call.trace))

    def _finished(self, call: _Call, _: object = None) -> None:
        self._core.finish(call.call_id)
        self._calls.pop(call.call_id, None)
        call.progress.cancel()
        self._changed.set()

    # -- one call ------------------------------------------------------------------------

    async def _serve(self, call: _Call) -> None:
        try:
            await self._generate(call)
        except Exception as exc:
            # Neither the engine's error nor a cancel (``_generate`` ends those calls itself),
            # or a fault while ending one. Unhandled, it ended the task unseen and the call
            # came back only after the ack wait.
            await self._worker_fault(call, exc)
        finally:
            # A request that never started (cancelled before its first output) is still held
            # at the engine's door: let it go. Harmless after a finished one.
            await self.engine.discard(call.prepared)
            call.trace.end()

    async def _generate(self, call: _Call) -> None:
        relay, msg, spans = call.relay, call.msg, call.trace
        queue_wait_ms: int | None = spans.queue_wait_ms()
        streamed = call.envelope.stream
        first_token = True
        try:
            if not streamed:
                # Names the worker and the queue wait now: the answer comes only at the end.
                await relay.token("", 0, queue_wait_ms)
                queue_wait_ms = None
            progress_at = time.monotonic() + _PROGRESS_S
            unsent = 0
            # Closed on every way out, a cancel during a publish included: the engine request
            # is aborted then, not when the iterator is garbage-collected.
            async with contextlib.aclosing(self.engine.generate(call.prepared)) as outputs:
                async for output in outputs:
                    self._core.generated(call.call_id, output.new_tokens)
                    if first_token and (output.sse or output.body is not None):
                        spans.first_token()
                        first_token = False
                    if output.sse:
                        await relay.token(output.sse, output.new_tokens, queue_wait_ms)
                        queue_wait_ms = None
                    elif not streamed and output.finish_reason is None:
                        # A progress event every few seconds, not one per engine step: nobody
                        # reads the tokens, but the front door must hear that the call is alive.
                        unsent += output.new_tokens
                        if time.monotonic() >= progress_at:
                            await relay.token("", unsent)
                            unsent = 0
                            progress_at = time.monotonic() + _PROGRESS_S
                    if output.finish_reason is not None:
                        usage = Usage(output.prompt_tokens, output.completion_tokens)
                        await relay.done(output.finish_reason, usage, output.body)
                        spans.finished(output.finish_reason.value, usage)
            if not relay.finished:
                raise EngineError("the engine ended the request without a finish reason")
            # Counted before the ack's round trip: the caller has its answer already.
            self.counters.completed += 1
            await self._settle(msg, Settle.ACK)
        except asyncio.CancelledError:
            spans.stopped(call.stop_reason or _StopReason.DRAIN)
            await self._stopped(call)
        except EngineRequestError as exc:
            spans.failed(exc)
            await self._engine_refused(msg, relay, exc)
        except EngineDeadError as exc:
            # Hand the call back for another worker, then stop this one: nothing more can run.
            log.error("engine died: %s", exc)
            spans.failed(exc)
            await msg.nak()
            self._fatal = exc
            self.request_stop()
        except EngineError as exc:
            spans.failed(exc)
            await self._engine_failed(call.msg, call.relay, exc)

    async def _settle(self, msg: Msg, how: Settle) -> None:
        """Ack or term ``msg``, confirmed by the server (workers/acks.py)."""
        # Counted before the round trip, as ``completed`` is: the call's end is decided here.
        self.counters.ended += 1
        await settle(self.nc, msg, how, bound_s=self.settings.stream.ack_wait_s)

    async def _stopped(self, call: _Call) -> None:
        if call.stop_reason == _StopReason.ABANDONED:
            return
        if call.stop_reason in (_StopReason.CANCELLED, _StopReason.CALLER_GONE):
            self.counters.cancelled += 1
            await call.relay.fail(ErrorCode.CANCELLED, "the call was cancelled by its caller")
            await self._settle(call.msg, Settle.TERM)
        else:
            # Drain past its grace: another worker takes the call over.
            self.counters.handed_back += 1
            await call.msg.nak()

    async def _engine_refused(self, msg: Msg, relay: Relay, exc: EngineRequestError) -> None:
        """Ends a call the serving layer refused (a bad field, a prompt too long), on arrival or
        mid-run: its caller is told why, and it is not delivered again, since it would be
        refused again."""
        self.counters.failed += 1
        await relay.fail(exc.code, str(exc), exc.param)
        await self._settle(msg, Settle.TERM)

    async def _engine_failed(self, msg: Msg, relay: Relay, exc: EngineError) -> None:
        attempt = int(msg.metadata.num_delivered or 1)
        if attempt >= self.settings.stream.max_deliver:
            self.counters.failed += 1
            await relay.fail(
                ErrorCode.ENGINE_ERROR, f"engine failed on all {attempt} attempts: {exc}"
            )
            await self._settle(msg, Settle.TERM)
        else:
            log.warning("engine error on attempt %d, handing back: %s", attempt, exc)
            self.counters.handed_back += 1
            await msg.nak(delay=self.settings.nak_delay_s)

    async def _worker_fault(self, call: _Call, exc: Exception) -> None:
        """Ends a call that a fault outside the engine interrupted: handed back with the NAK
        delay, so that it comes back soon, or terminated where a redelivery would answer the
        caller a second time."""
        self.counters.faulted += 1
        attempt = int(call.msg.metadata.num_delivered or 1)
        log.error("call %s failed in the worker on attempt %d", call.call_id, attempt, exc_info=exc)
        call.trace.failed(exc)
        try:
            if call.relay.finished:
                # The caller has its answer (the ack that follows it failed, say).
                await self._settle(call.msg, Settle.TERM)
            elif attempt < self.settings.stream.max_deliver:
                await call.msg.nak(delay=self.settings.nak_delay_s)
            else:
                try:
                    await call.relay.fail(
                        ErrorCode.INTERNAL_ERROR, f"the worker failed on all {attempt} attempts"
                    )
                finally:  # the relay may be what fails: end the message all the same
                    await self._settle(call.msg, Settle.TERM)
        except Exception as again:
            # Out of this worker's hands: the server delivers it again after the ack wait.
            log.error("call %s: could not end its message after the fault: %r", call.call_id, again)

    async def _keep_alive(self, call_id: str, msg: Msg, relay: Relay, created_ms: int) -> None:
        """While the call is held: keeps its message alive with ``in_progress()``, and asks
        every ``caller_probe_s``, counted from when its caller sent it (when it was last known
        to wait), whether its caller still waits. A front door that died (SIGKILL, a lost
        machine) sends no cancel, and its calls would run to their last token for nobody,
        holding KV and sequences that callers who wait could use."""
        progress_s = max(self.settings.stream.ack_wait_s / 3, 0.1)
        probe_s = self.settings.caller_probe_s
        next_progress = time.monotonic() + progress_s
        # A call that waited in the queue longer than the interval is asked at once, and ended
        # before it starts if nobody waits; a fresh one is not asked while it gets its first
        # token: the front door answers on the loop that relays tokens, and asking every call
        # at once measured 0.6-2.6 ms more added TTFT than not asking (bench_ttft, 3 pairs).
        waited_s = max(time.time() - created_ms / 1000, 0.0)
        next_probe = time.monotonic() + max(probe_s - waited_s, 0.0) if probe_s > 0 else math.inf
        while True:
            await asyncio.sleep(max(min(next_progress, next_probe) - time.monotonic(), 0.0))
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + progress_s
                with contextlib.suppress(Exception):
                    await msg.in_progress()
            if now >= next_probe:
                if await relay.caller_gone(timeout_s=probe_s):
                    log.info("call %s: its caller is gone, ending it", call_id)
                    await self._cancel(call_id, _StopReason.CALLER_GONE)
                    return
                next_probe = time.monotonic() + probe_s

    def _remember_cancel(self, call_id: str) -> None:
        now = time.monotonic()
        if len(self._cancelled) > 10_000 or (
            self._cancelled and next(iter(self._cancelled.values())) < now - _CANCEL_MEMORY_S
        ):
            self._cancelled = {
                k: t for k, t in self._cancelled.items() if t >= now - _CANCEL_MEMORY_S
            }
        self._cancelled[call_id] = now

    async def _on_cancel(self, msg: Msg) -> None:
        call_id = msg.subject.removeprefix(CANCEL_SUBJECT_PREFIX)
        self._remember_cancel(call_id)
        await self._cancel(call_id, _StopReason.CANCELLED)

    async def _cancel(self, call_id: str, reason: str) -> None:
        """Ends a call held here, staged or running, because its caller cancelled it or is
        gone; nothing for a call not held (yet)."""
        if self._core.unstage(call_id):
            staged = self._calls.pop(call_id)
            if staged.progress is not asyncio.current_task():
                staged.progress.cancel()
            self._spawn(self.engine.discard(staged.prepared))
            staged.trace.refused(reason)
            self.counters.cancelled += 1
            await staged.relay.fail(ErrorCode.CANCELLED, "the call was cancelled by its caller")
            await self._settle(staged.msg, Settle.TERM)
            self._changed.set()
            return
        running = self._calls.get(call_id) if self._core.is_running(call_id) else None
        if (
            running is not None
            and running.stop_reason is None
            and running.task is not None
            and not running.relay.finished  # answered already: it ends on its own
        ):
            running.stop_reason = reason
            running.task.cancel()  # closing the engine's iterator aborts the request

    # -- drain ---------------------------------------------------------------------------

    async def _drain(self) -> None:
        for puller in self._pullers.values():
            await puller.stop()
        if self._arrivals:
            await asyncio.wait(list(self._arrivals))
        await self._put_heartbeat(draining=True)
        for call_id in self._core.staged_ids():
            # Each call leaves the core before the first await of its hand-back: a cancel that
            # lands meanwhile finds it gone, and one for a call still staged ends that call,
            # which is then skipped here. Otherwise a call would end twice, and NATS refuses the
            # second ending of a message (the drain failed on it).
            if not self._core.unstage(call_id):
                continue  # cancelled meanwhile: that cancel ended it
            call = self._calls.pop(call_id)
            call.progress.cancel()
            await self.engine.discard(call.prepared)
            call.trace.refused("handed_back")
            self.counters.handed_back += 1
            await call.msg.nak()  # never started: hand back at once
        running = [self._calls[call_id] for call_id in self._core.running_ids()]
        tasks = [c.task for c in running if c.task is not None]
        if not tasks:
            return
        grace = self.settings.drain_grace_s
        log.info("draining %d running calls (grace %.0fs)", len(tasks), grace)
        pending = await self._within_grace(tasks, grace)
        stuck = [call for call in running if call.task in pending]
        for call in stuck:
            call.stop_reason = call.stop_reason or _StopReason.DRAIN
            call.task.cancel()  # type: ignore[union-attr]
        if not stuck:
            return
        _, pending = await asyncio.wait(pending, timeout=DRAIN_CANCEL_BOUND_S)
        # A call whose cancel did not end it (an engine that does not answer its abort) must
        # not keep the worker from stopping: it is ended now, as its cancel would have, and
        # not again should its task end after all.
        for call in stuck:
            if call.task in pending:
                log.error("call %s did not stop when cancelled; ending it now", call.call_id)
                with contextlib.suppress(Exception):
                    await self._stopped(call)
                call.stop_reason = _StopReason.ABANDONED

    async def _within_grace(
        self, tasks: list[asyncio.Task[None]], grace: float
    ) -> set[asyncio.Task[None]]:
        """Waits for ``tasks`` until the grace ends or a second stop cuts it short; returns
        those still running."""
        waits = {
            asyncio.ensure_future(asyncio.wait(tasks)),
            asyncio.ensure_future(self._hurry.wait()),
        }
        try:
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()  # the waits only: the calls' tasks run on
        return {task for task in tasks if not task.done()}

    # -- heartbeat -----------------------------------------------------------------------

    def heartbeat(self, *, draining: bool = False) -> WorkerHeartbeat:
        stats = self._core.reading(self.engine.stats())
        return WorkerHeartbeat(
            worker_id=self.settings.worker_id,
            model=self.engine.model_name,
            sent_ms=int(time.time() * 1000),
            kv_cache_usage=stats.kv_cache_usage,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_num_seqs=stats.max_num_seqs,
            kv_capacity_tokens=stats.kv_capacity_tokens,
            draining=draining,
            max_model_len=self.engine.max_model_len,
            staged=self._core.staged_count,
            committed_tokens=self._committed_tokens(),
            num_preemptions=stats.num_preemptions,
            generated_tokens=stats.generated_tokens,
            completed=self.counters.completed,
            deadline_dropped=self.counters.deadline_dropped,
            cancelled=self.counters.cancelled,
            handed_back=self.counters.handed_back,
            rescued=self.counters.rescued,
            failed=self.counters.failed,
            faulted=self.counters.faulted,
            ended=self.counters.ended,
        )

    async def _put_heartbeat(self, *, draining: bool = False) -> None:
        """Put this worker's heartbeat; a beat that fails is logged, and the bucket opened
        again for the next one: it is kept in memory, so a NATS server restart loses it, and
        front doors would never see this worker again (``workers_bucket`` creates it anew).
        A missed beat must not stop serving, or a drain: the TTL covers it."""
        if self._kv is None:
            return
        try:
            await self._kv.put(self.settings.worker_id, encode(self.heartbeat(draining=draining)))
        except Exception as exc:
            log.warning("heartbeat failed: %r", exc)
            with contextlib.suppress(Exception):
                self._kv = await workers_bucket(self.nc.jetstream(), self.settings.stream)

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every ``heartbeat_interval_s``, and one as soon as calls were staged,
        started or ended since the last, but no sooner than ``reading_interval_s`` after it.
        Admission reads what a worker has not committed from its last heartbeat, and counts a
        session it admitted after that reading as holding its whole reservation: with calls of
        about a second, readings 2 s apart showed the fleet fuller than it was, and deferred
        sessions the engine had room for. A quiet worker still beats every
        ``heartbeat_interval_s``; a busy one beats up to once a ``reading_interval_s``, which
        is what a large fleet pays for (docs/scale.md)."""
        every_s = self.settings.heartbeat_interval_s
        soonest_s = min(self.settings.reading_interval_s, every_s)
        while True:
            seen = self._load_mark()  # before the beat is built: a change during its put counts
            await self._put_heartbeat()
            put_at = time.monotonic()
            while True:
                left_s = every_s - (time.monotonic() - put_at)
                await asyncio.sleep(max(0.0, min(soonest_s, left_s)))
                if left_s <= soonest_s or self._load_mark() != seen:
                    break

    def _load_mark(self) -> tuple[int, int, int]:
        """Moves whenever a call is staged, started or ended: what a heartbeat tells
        admission has changed."""
        return (len(self._calls), self._core.staged_count, self.counters.started)

    async def _remove_heartbeat(self) -> None:
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.settings.worker_id)
