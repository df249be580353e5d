"""``kvgate up``: the embedded NATS server, one worker and the front door, as one command.

Each child runs in its own process group, so a Ctrl-C in the terminal reaches only this
supervisor, which then stops the children in dependency order: the front door first (no new
calls), then the worker (drains what it holds, then shuts its engine down), then NATS.

NATS runs with one user per role (``broker.natsauth``): the passwords the environment sets, or
ones made at start and handed to the children in their NATS URLs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from broker.natsauth import NatsRole, NatsUsers
from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from kvgate.cli import COMMAND


class Supervisor:
    def __init__(
        self,
        *,
        data_dir: Path,
        model_dir: Path | None,
        host: str,
        port: int,
        nats_port: int = 0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.data_dir = data_dir
        self.model_dir = model_dir or data_dir / "model"
        self.host = host
        self.port = port
        self.nats_port = nats_port
        self.ready_timeout_s = ready_timeout_s
        self._children: dict[str, Proc] = {}
        self._stop_signal: int | None = None

    def run(self) -> int:
        from workers.devmodel import DevModelSpec, build, is_built

        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not is_built(self.model_dir) and not (self.model_dir / "config.json").is_file():
            print(f"building the development model at {self.model_dir} ...", flush=True)
            build(self.model_dir, DevModelSpec())

        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        nats = EmbeddedNats(
            self.data_dir / "nats",
            port=self.nats_port,
            log_file=self.data_dir / "nats.log",
            users=NatsUsers.from_env(os.environ) or NatsUsers.generate(),
        )
        try:
            nats.start()
            print(f"NATS (JetStream) on {nats.url}, a user per role", flush=True)
            self._spawn(
                "worker",
                [*COMMAND, "worker", "--model", str(self.model_dir), "--enforce-eager"],
                {"KVGATE_NATS_URL": nats.url_for(NatsRole.WORKER)},
            )
            self._spawn(
                "api",
                [*COMMAND, "api", "--host", self.host, "--port", str(self.port)],
                {"KVGATE_NATS_URL": nats.url_for(NatsRole.FRONT_DOOR)},
            )
            code = self._wait_ready()
            if code is None:
                url = f"http://{self.host}:{self.port}"
                print(f"kvgate is ready: {url}/v1  (Ctrl-C stops everything)", flush=True)
                code = self._wait_until_stopped()
            return code
        finally:
            self._stop_children()
            nats.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            print("kvgate stopped", flush=True)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self._stop_signal = signum

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        # Its output is this terminal's; its own process group keeps the terminal's Ctrl-C
        # from reaching it, so the children stop in the order ``_stop_children`` says.
        self._children[name] = Proc(name, cmd, env, None)

    def _exited(self) -> tuple[str, int] | None:
        for name, proc in self._children.items():
            if proc.returncode is not None:
                return name, proc.returncode
        return None

    def _wait_ready(self) -> int | None:
        """None once /readyz says ready; an exit code if a child died or we were stopped."""
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.host}:{self.port}/readyz"
        while time.monotonic() < deadline:
            if self._stop_signal is not None:
                return 0
            exited = self._exited()
            if exited is not None:
                print(f"kvgate {exited[0]} exited during start-up ({exited[1]})", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return None
            except (urllib.error.URLError, OSError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        print(f"kvgate was not ready within {self.ready_timeout_s:.0f}s", file=sys.stderr)
        return 1

    def _wait_until_stopped(self) -> int:
        while self._stop_signal is None:
            exited = self._exited()
            if exited is not None:
                print(f"kvgate {exited[0]} exited ({exited[1]}); stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0

    def _stop_children(self) -> None:
        # Front door first, so nothing new is queued while the worker drains; NATS after both.
        for name, grace in (("api", 15.0), ("worker", 60.0)):
            proc = self._children.pop(name, None)
            if proc is None:
                continue
            proc.stop(grace)
            if proc.killed:
                print(f"kvgate {name} did not stop within {grace:.0f}s; killed", file=sys.stderr)
