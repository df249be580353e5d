"""Admission's background step (pressure, windows, pace, lease expiry) outlives an error it
did not expect: before, the first one ended the task and froze all four, silently."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from broker.admission.admitter import Admitter
from broker.admission.metrics import AdmissionMetrics
from broker.admission.signals import FleetSignals
from broker.admission.state import MemoryAdmissionState
from broker.admission.tenants import load_tenancy
from broker.fleet import FleetView
from broker.settings import ApiSettings
from schemas.vocab import Tier
from tests.polling import poll_until


class _SweepFailsTwice(MemoryAdmissionState):
    def __init__(self) -> None:
        super().__init__()
        self.sweeps = 0

    async def sweep(self, now_ms: int) -> int:
        self.sweeps += 1
        if self.sweeps <= 2:
            raise RuntimeError("a store fault nobody planned for")
        return await super().sweep(now_ms)


async def test_the_admission_step_goes_on_after_an_unexpected_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _SweepFailsTwice()
    admitter = Admitter(
        ApiSettings(),
        load_tenancy(None, Tier.STANDARD),
        state,
        FleetSignals(FleetView(6.0)),
        AdmissionMetrics(CollectorRegistry()),
        None,
        shared=False,
    )
    with caplog.at_level(logging.ERROR, logger="broker.admission.admitter"):
        admitter.start(0.01)
        try:
            await poll_until(lambda: asyncio.sleep(0, state.sweeps), lambda n: n >= 5, timeout_s=10)
        finally:
            await admitter.stop()
    logged = [r for r in caplog.records if "background step failed" in r.getMessage()]
    assert len(logged) == 1  # the same error twice is logged once
    assert "a store fault nobody planned for" in caplog.text
