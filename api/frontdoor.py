"""What the front door holds while it runs: connections and the views built on them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.engine import Engine

from api.batches.runner import BatchRunner
from api.calls import CallLine
from api.chat_request import check_known_model
from api.dashboard import DashboardSampler
from api.metrics import FrontDoorMetrics
from broker.admission.admitter import Admitter
from broker.admission.leases import SessionLeases
from broker.admission.signals import FleetSignals
from broker.errors import NoWorkers
from broker.fleet import FleetView, FleetWatcher
from broker.settings import ApiSettings


@dataclass
class FrontDoor:
    """Everything a request handler reaches through ``FrontDoorDep``."""

    settings: ApiSettings
    nc: NATS
    js: JetStreamContext
    calls: CallLine
    fleet: FleetView
    fleet_watcher: FleetWatcher
    signals: FleetSignals
    metrics: FrontDoorMetrics
    admitter: Admitter
    leases: SessionLeases
    batch_engine: Engine
    batch_runner: BatchRunner
    started_s: int
    dashboard: DashboardSampler

    def known_models(self) -> set[str]:
        """The models calls may name: those the fleet's workers serve, and the one this front
        door is configured to expect even before any of its workers is up."""
        return self.fleet.known_models() | {self.settings.served_model_name}

    def check_model(self, model: str) -> None:
        """Raise ``model_not_found`` (404) for a model this fleet does not serve, and defer
        (503 ``no_workers``) a known one while no live worker serves it."""
        if model in self.fleet.models(int(time.time() * 1000)):
            return
        check_known_model(model, self.known_models())
        raise NoWorkers(
            f"no live worker serves model {model!r}",
            decision="defer",
            retry_after=math.ceil(self.admitter.policy.default_retry_after_s),
        )
