"""What the front door holds while it runs: connections and the views built on them."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.engine import Engine

from api.admission import Admitter
from api.batch_runner import BatchRunner
from api.metrics import FrontDoorMetrics
from api.replies import ReplyRouter
from broker.fleet import FleetView, FleetWatcher
from broker.publisher import CallPublisher
from broker.settings import ApiSettings


@dataclass
class FrontDoor:
    settings: ApiSettings
    nc: NATS
    js: JetStreamContext
    publisher: CallPublisher
    replies: ReplyRouter
    fleet: FleetView
    fleet_watcher: FleetWatcher
    metrics: FrontDoorMetrics
    admitter: Admitter
    batch_engine: Engine
    batch_runner: BatchRunner
    started_s: int
