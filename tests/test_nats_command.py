"""`kvgate nats`: a supervisor's SIGTERM, or a terminal's Ctrl-C, stops the server and the
command promptly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from broker.procs import Proc
from kvgate.cli import COMMAND
from tests.procs import alive

EXIT_BOUND_S = 20.0
"""How soon the command must exit after the signal: the server stops in well under a second,
so this is slack for a loaded 2-core machine, and still half of the 10 s grace the server gets
before it is killed (a command stuck waiting out that grace fails it)."""
START_BOUND_S = 30.0


def serving(proc: Proc, store_dir: Path) -> int:
    """The pid of the nats-server that ``proc`` started, once the command says it serves."""
    deadline = time.monotonic() + START_BOUND_S
    while time.monotonic() < deadline:
        assert proc.alive(), proc.tail()
        if "NATS with JetStream on" in proc.tail():
            (ports,) = (store_dir / "ports").glob("*.ports")
            assert json.loads(ports.read_text())["nats"]
            return int(ports.stem.rsplit("_", 1)[1])
        time.sleep(0.05)  # polling a log file: there is nothing to await
    raise TimeoutError(f"kvgate nats did not serve within {START_BOUND_S}s:\n{proc.tail()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_stops_the_server_and_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    store_dir = tmp_path / "nats"
    command = Proc(
        "nats",
        [*COMMAND, "nats", "--port", "0", "--store-dir", str(store_dir)],
        {"PYTHONUNBUFFERED": "1"},
        tmp_path,
    )
    server_pid: int | None = None
    try:
        server_pid = serving(command, store_dir)
        command.signal(sig)  # the command's pid only, as a supervisor or a terminal sends it
        try:
            code = command.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_BOUND_S}s after {sig.name}:\n{command.tail()}")
        assert code == 0
        assert not alive(server_pid)
    finally:
        command.stop(1)
        # The server has a process group of its own: a stuck command leaves it behind.
        if server_pid is not None and alive(server_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)
