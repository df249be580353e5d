"""The front door's FastAPI application factory."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
from fastapi import FastAPI

from api.errors import install_error_handlers
from api.metrics import FrontDoorMetrics
from api.replies import ReplyRouter
from api.routes import admin, chat, health, models
from api.state import FrontDoor
from broker.fleet import FleetView, FleetWatcher
from broker.publisher import CallPublisher
from broker.settings import ApiSettings
from broker.streams import provision_calls, workers_bucket

log = logging.getLogger(__name__)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or ApiSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nc = await nats.connect(settings.nats_url, name="kvgate-api", max_reconnect_attempts=-1)
        try:
            js = nc.jetstream()
            await provision_calls(js, settings.stream)
            kv = await workers_bucket(js, settings.stream)
            fleet = FleetView(settings.heartbeat_max_age_s)
            watcher = FleetWatcher(kv, fleet)
            await watcher.start()
            replies = ReplyRouter(nc)
            await replies.start()
            metrics = FrontDoorMetrics(fleet)
            metrics.start(js)
            app.state.front_door = FrontDoor(
                settings=settings,
                nc=nc,
                js=js,
                publisher=CallPublisher(js),
                replies=replies,
                fleet=fleet,
                fleet_watcher=watcher,
                metrics=metrics,
                started_s=int(time.time()),
            )
            log.info("kvgate api connected to %s", settings.nats_url)
            yield
            await metrics.stop()
            await replies.stop()
            await watcher.stop()
        finally:
            await nc.drain()

    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    return app
