"""``kvgate api`` stops within its stated grace on a supervisor's SIGTERM and on a terminal's
Ctrl-C (SIGINT), with status 0. (``kvgate nats``: tests/test_nats_command.py; ``kvgate worker``:
tests/test_faults.py; ``kvgate up``: tests/test_up.py.)"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from broker.natsserver import EmbeddedNats
from tests.procs import start_api

API_GRACE_S = 10.0
"""``kvgate api``'s stated grace: uvicorn's ``timeout_graceful_shutdown``."""
EXIT_BOUND_S = API_GRACE_S + 10.0
"""The grace, and slack for a loaded 2-core machine to stop a Python process."""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_the_front_door_exits_within_its_grace(
    nats_server: EmbeddedNats, tmp_path: Path, sig: signal.Signals
) -> None:
    proc, _ = start_api(nats_server.url, tmp_path)
    try:
        proc.signal(sig)
        assert proc.wait(timeout=EXIT_BOUND_S) == 0, proc.tail()
    finally:
        proc.stop()
