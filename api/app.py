"""The front door's FastAPI application factory."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.engine import make_url

from api.batches.runner import BatchRunner
from api.calls import CallLine
from api.dashboard import DashboardSampler
from api.errors import install_error_handlers
from api.frontdoor import FrontDoor
from api.metrics import FrontDoorMetrics
from api.openapi import install_openapi
from api.replies import ReplyRouter
from api.routes import admin, batches, chat, dashboard, files, health, models, sessions
from api.tracing import RequestSpanMiddleware
from broker import natsconn
from broker.admission.admitter import Admitter
from broker.admission.leases import SessionLeases
from broker.admission.redis_store import RedisAdmissionState
from broker.admission.signals import FleetSignals
from broker.admission.state import AdmissionState, MemoryAdmissionState
from broker.admission.tenants import load_tenancy
from broker.db import engine_url, make_engine
from broker.errors import AdmissionUnavailable
from broker.fleet import FleetView, FleetWatcher
from broker.ledger import Ledger
from broker.publisher import CallPublisher
from broker.settings import ApiSettings, redacted_url
from broker.streams import provision_calls, provision_results, workers_bucket
from broker.telemetry import tracing_wanted

log = logging.getLogger(__name__)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or ApiSettings()
    tenancy = load_tenancy(settings.tenants_file, settings.dev_tenant_tier)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        on_reconnect: list[Callable[[], None]] = []

        async def reconnected() -> None:
            for hook in on_reconnect:
                hook()

        nc = await natsconn.connect(
            settings.nats_url,
            settings.nats,
            name="kvgate-api",
            max_reconnect_attempts=-1,
            reconnected_cb=reconnected,
        )
        try:
            js = nc.jetstream()
            await provision_calls(js, settings.stream)
            fleet = FleetView(settings.heartbeat_max_age_s)
            watcher = FleetWatcher(lambda: workers_bucket(js, settings.stream), fleet)
            await watcher.start()
            # The server may have restarted: its in-memory workers bucket is gone, and the
            # watch on it with it.
            on_reconnect.append(watcher.reopen)
            replies = ReplyRouter(nc)
            await replies.start()
            signals = FleetSignals(fleet)
            signals.start(js)
            metrics = FrontDoorMetrics(signals)
            metrics.watch_objectives(tenancy.tiers)
            ledger = Ledger(settings.database_url, max_queue=settings.ledger_queue)
            await ledger.start()
            metrics.watch_ledger(ledger)
            metrics.watch_replies(replies)
            state = admission_state(settings)
            await _require_noeviction(state)
            admitter = Admitter(
                settings,
                tenancy,
                state,
                signals,
                metrics.admission,
                ledger,
                shared=settings.redis_url is not None,
            )
            admitter.start(min(0.5, settings.heartbeat_max_age_s / 4))
            await provision_results(js, settings.stream)
            batch_engine = make_engine(settings.database_url)
            publisher = CallPublisher(js)
            runner = BatchRunner(settings, batch_engine, admitter, publisher, nc, js)
            leases = SessionLeases(admitter)
            leases.start()
            if settings.batch_runner:
                runner.start()
            sampler = DashboardSampler(
                signals, admitter, metrics, interval_s=settings.dashboard_sample_s
            )
            sampler.start()
            app.state.front_door = FrontDoor(
                settings=settings,
                nc=nc,
                js=js,
                calls=CallLine(
                    publisher=publisher,
                    replies=replies,
                    nc=nc,
                    stream_idle_timeout_s=settings.stream_idle_timeout_s,
                    metrics=metrics,
                    judge=admitter.judge_call,
                ),
                fleet=fleet,
                fleet_watcher=watcher,
                signals=signals,
                metrics=metrics,
                admitter=admitter,
                leases=leases,
                batch_engine=batch_engine,
                batch_runner=runner,
                started_s=int(time.time()),
                dashboard=sampler,
            )
            log.info(
                "kvgate api connected to %s; admission state %s; ledger %s",
                redacted_url(settings.nats_url),
                "in Redis" if settings.redis_url else "in-process",
                make_url(engine_url(settings.database_url)).render_as_string(),
            )
            # The start-up heap is frozen, as `vllm serve` does: no full collection walks
            # it while calls are served.
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                # Whatever ends the serving, an error included: left running, the collector's
                # subscription kept the drain below waiting for ever.
                await sampler.stop()
                await runner.stop()
                await leases.stop()
                batch_engine.dispose()
                await admitter.stop()
                await state.close()
                await ledger.stop()
                await signals.stop()
                await replies.stop()
                await watcher.stop()
        finally:
            await nc.drain()

    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    install_openapi(app)
    if tracing_wanted():
        app.add_middleware(RequestSpanMiddleware)
    app.include_router(chat.router)
    app.include_router(sessions.router)
    app.include_router(batches.router)
    app.include_router(files.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(dashboard.router)
    return app


async def _require_noeviction(state: AdmissionState) -> None:
    """Refuse to start on a Redis that evicts keys; one unreachable now is checked no further
    (admission degrades as documented until it is back)."""
    if isinstance(state, RedisAdmissionState):
        try:
            await state.require_noeviction()
        except AdmissionUnavailable as exc:
            log.warning("%s: its eviction policy could not be checked", exc)


def admission_state(settings: ApiSettings) -> AdmissionState:
    if settings.redis_url is None:
        return MemoryAdmissionState(retention_ms=int(settings.session_retention_s * 1000))
    return RedisAdmissionState(
        settings.redis_url,
        prefix=settings.redis_prefix,
        retention_ms=int(settings.session_retention_s * 1000),
        timeout_s=settings.redis_timeout_s,
        max_connections=settings.redis_max_connections,
    )
