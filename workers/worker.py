"""The worker process shell: NATS connection, pull credit, one task per call, heartbeats, drain.

The loop: whenever something changes (a call arrives or ends, a pull request expires), ask
``plan_pulls`` how much credit to add per tier and send those pull requests. Calls then arrive
on their own; each runs in its own task that streams the engine's deltas to the caller's inbox
and acks at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from broker.settings import StreamSettings
from broker.streams import provision_calls, workers_bucket
from schemas.vocab import TIERS_BY_PRIORITY, ErrorCode, Tier
from schemas.wire import (
    CANCEL_SUBJECT_PREFIX,
    Header,
    Usage,
    WorkerHeartbeat,
    decode_call,
    encode,
)
from workers.engine import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineRequest,
    EngineRequestError,
)
from workers.puller import TierPuller
from workers.pullplan import TierView, plan_pulls
from workers.relay import ReplyRelay

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerOptions:
    nats_url: str
    worker_id: str = field(default_factory=default_worker_id)
    heartbeat_interval_s: float = 2.0
    pull_expires_s: float = 10.0
    drain_grace_s: float = 30.0
    nak_delay_s: float = 1.0
    stream: StreamSettings = field(default_factory=StreamSettings)


class _StopReason:
    CANCELLED = "cancelled"
    DRAIN = "drain"


@dataclass(eq=False)
class _InFlight:
    call_id: str
    task: asyncio.Task[None]
    stop_reason: str | None = None


class Worker:
    def __init__(self, engine: Engine, options: WorkerOptions) -> None:
        self.engine = engine
        self.options = options
        self._nc: NATS | None = None
        self._kv: KeyValue | None = None
        self._pullers: dict[Tier, TierPuller] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "worker is not connected"
        return self._nc

    def request_stop(self) -> None:
        """Begin the drain: stop asking for work, let in-flight calls finish within the grace."""
        self._stopping.set()
        self._changed.set()

    async def run(self) -> None:
        """Serve until ``request_stop()`` (or a dead engine, which is re-raised)."""
        self._nc = await nats.connect(
            self.options.nats_url,
            name=f"kvgate-worker {self.options.worker_id}",
            max_reconnect_attempts=-1,
        )
        try:
            js = self.nc.jetstream()
            await provision_calls(js, self.options.stream)
            self._kv = await workers_bucket(js, self.options.stream)
            cancel_sub = await self.nc.subscribe(f"{CANCEL_SUBJECT_PREFIX}*", cb=self._on_cancel)
            for tier in TIERS_BY_PRIORITY:
                puller = TierPuller(
                    self.nc,
                    tier,
                    self._on_call,
                    self._changed.set,
                    expires_s=self.options.pull_expires_s,
                )
                await puller.start()
                self._pullers[tier] = puller
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            log.info("worker %s serving %s", self.options.worker_id, self.engine.model_name)
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
            await self.nc.drain()
        if self._fatal is not None:
            raise self._fatal

    # -- intake --------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        capacity = self.engine.stats().max_num_seqs
        while not self._stopping.is_set():
            self._changed.clear()
            now = time.monotonic()
            for puller in self._pullers.values():
                puller.sweep(now)
            views = [
                TierView(tier, self._pullers[tier].outstanding, self._pullers[tier].backlog)
                for tier in TIERS_BY_PRIORITY
            ]
            free = capacity - len(self._inflight) - sum(v.outstanding for v in views)
            for tier, n in plan_pulls(free, views).items():
                await self._pullers[tier].request(n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.options.pull_expires_s)

    def _on_call(self, tier: Tier, msg: Msg) -> None:
        headers = msg.headers or {}
        call_id = headers.get(Header.CALL) or uuid.uuid4().hex
        if self._stopping.is_set() or call_id in self._inflight:
            # Arrived after the drain began (or a duplicate delivery): hand it straight back.
            asyncio.get_running_loop().create_task(msg.nak())
            return
        task = asyncio.get_running_loop().create_task(self._serve(tier, msg, call_id))
        self._inflight[call_id] = _InFlight(call_id, task)
        task.add_done_callback(lambda _: self._finished(call_id))

    def _finished(self, call_id: str) -> None:
        self._inflight.pop(call_id, None)
        self._changed.set()

    # -- one call ------------------------------------------------------------------------

    async def _serve(self, tier: Tier, msg: Msg, call_id: str) -> None:
        headers = msg.headers or {}
        inbox = headers.get(Header.REPLY)
        attempt = int(msg.metadata.num_delivered or 1)
        if not inbox:
            log.error("call %s has no %s header; terminating it", call_id, Header.REPLY)
            await msg.term()
            return
        relay = ReplyRelay(self.nc, inbox, attempt)
        try:
            call = decode_call(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await relay.fail(ErrorCode.INTERNAL_ERROR, f"malformed call message: {exc}")
            await msg.term()
            return
        if time.time() * 1000 >= call.deadline_ms:
            await relay.fail(ErrorCode.DEADLINE_EXCEEDED, "the call's deadline passed in queue")
            await msg.term()
            return

        request = EngineRequest(call_id, call.messages, call.sampling, priority=tier.priority)
        progress = asyncio.create_task(self._keep_in_progress(msg))
        try:
            async for delta in self.engine.generate(request):
                if delta.text or delta.new_tokens:
                    await relay.token(delta.text, delta.new_tokens)
                if delta.finish_reason is not None:
                    usage = Usage(delta.prompt_tokens, delta.completion_tokens)
                    await relay.done(delta.finish_reason, usage)
            if not relay.finished:
                raise EngineError("the engine ended the request without a finish reason")
            await msg.ack()
        except asyncio.CancelledError:
            await self._stopped(call_id, msg, relay)
        except EngineRequestError as exc:
            await relay.fail(exc.code, str(exc))
            await msg.term()
        except EngineDeadError as exc:
            # Hand the call back for another worker, then stop this one: nothing more can run.
            log.error("engine died: %s", exc)
            await msg.nak()
            self._fatal = exc
            self.request_stop()
        except EngineError as exc:
            await self._engine_failed(msg, relay, attempt, exc)
        finally:
            progress.cancel()

    async def _stopped(self, call_id: str, msg: Msg, relay: ReplyRelay) -> None:
        entry = self._inflight.get(call_id)
        reason = entry.stop_reason if entry else None
        if reason == _StopReason.CANCELLED:
            await relay.fail(ErrorCode.CANCELLED, "the call was cancelled by its caller")
            await msg.term()
        else:
            # Drain past its grace: another worker takes the call over.
            await msg.nak()

    async def _engine_failed(
        self, msg: Msg, relay: ReplyRelay, attempt: int, exc: EngineError
    ) -> None:
        if attempt >= self.options.stream.max_deliver:
            await relay.fail(
                ErrorCode.ENGINE_ERROR, f"engine failed on all {attempt} attempts: {exc}"
            )
            await msg.term()
        else:
            log.warning("engine error on attempt %d, handing back: %s", attempt, exc)
            await msg.nak(delay=self.options.nak_delay_s)

    async def _keep_in_progress(self, msg: Msg) -> None:
        interval = max(self.options.stream.ack_wait_s / 3, 0.1)
        while True:
            await asyncio.sleep(interval)
            await msg.in_progress()

    async def _on_cancel(self, msg: Msg) -> None:
        call_id = msg.subject.removeprefix(CANCEL_SUBJECT_PREFIX)
        entry = self._inflight.get(call_id)
        if entry is not None and entry.stop_reason is None:
            entry.stop_reason = _StopReason.CANCELLED
            entry.task.cancel()  # vLLM aborts the request when its generator is closed

    # -- drain ---------------------------------------------------------------------------

    async def _drain(self) -> None:
        for puller in self._pullers.values():
            await puller.stop()
        await self._put_heartbeat(draining=True)
        tasks = [entry.task for entry in self._inflight.values()]
        if tasks:
            log.info(
                "draining %d in-flight calls (grace %.0fs)", len(tasks), self.options.drain_grace_s
            )
            _, pending = await asyncio.wait(tasks, timeout=self.options.drain_grace_s)
            for entry in list(self._inflight.values()):
                if entry.task in pending:
                    entry.stop_reason = entry.stop_reason or _StopReason.DRAIN
                    entry.task.cancel()
            if pending:
                await asyncio.wait(pending)

    # -- heartbeat -----------------------------------------------------------------------

    def heartbeat(self, *, draining: bool = False) -> WorkerHeartbeat:
        stats = self.engine.stats()
        return WorkerHeartbeat(
            worker_id=self.options.worker_id,
            model=self.engine.model_name,
            sent_ms=int(time.time() * 1000),
            kv_cache_usage=stats.kv_cache_usage,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_num_seqs=stats.max_num_seqs,
            kv_capacity_tokens=stats.kv_capacity_tokens,
            draining=draining,
        )

    async def _put_heartbeat(self, *, draining: bool = False) -> None:
        if self._kv is not None:
            await self._kv.put(self.options.worker_id, encode(self.heartbeat(draining=draining)))

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._put_heartbeat()
            except Exception as exc:  # a missed beat must not stop serving; the TTL covers it
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.options.heartbeat_interval_s)

    async def _remove_heartbeat(self) -> None:
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.options.worker_id)
