"""``kvgate up``: the embedded NATS server, one worker and the front door, as one command.

What the terminal shows is for a person: one line per component as it starts, a spinner while
the worker's engine loads (a line per phase when the output is not a terminal), then a banner
with the URLs and an example call. Each process's own (JSON) log goes to a file under
``<data dir>/logs/``, whose path the line for it names; a child that dies shows its log's last
lines here.

Each child runs in its own process group, so a Ctrl-C in the terminal reaches only this
supervisor, which then stops the children in dependency order: the front door first (no new
calls), then the worker (drains what it holds, then shuts its engine down), then NATS.

NATS runs with one user per role (``broker.natsauth``): the passwords the environment sets, or
ones made at start and handed to the children in their NATS URLs.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from rich.status import Status

from broker.natsauth import NatsRole, NatsUsers
from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from kvgate.cli import COMMAND

DIED_LOG_LINES = 20
"""How much of a dead child's log start-up shows: its traceback, usually."""


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
        self.log_dir = data_dir / "logs"
        self._children: dict[str, Proc] = {}
        self._stop_signal: int | None = None

    def run(self) -> int:
        from workers.devmodel import DevModelSpec, build, is_built

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        if not is_built(self.model_dir) and not (self.model_dir / "config.json").is_file():
            print(f"building the development model at {self.model_dir} ...", flush=True)
            build(self.model_dir, DevModelSpec())

        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        nats = EmbeddedNats(
            self.data_dir / "nats",
            port=self.nats_port,
            log_file=self.log_dir / "nats.log",
            users=NatsUsers.from_env(os.environ) or NatsUsers.generate(),
        )
        # The dashboard is behind the admin token: one made here unless the operator set one.
        given_token = os.environ.get("KVGATE_ADMIN_TOKEN")
        admin_token = given_token or secrets.token_urlsafe(18)
        started = time.monotonic()
        try:
            nats.start()
            self._say("nats", f"NATS with JetStream on {nats.url}, a user per role", "nats")
            self._spawn(
                "worker",
                [*COMMAND, "worker", "--model", str(self.model_dir), "--enforce-eager"],
                {"KVGATE_NATS_URL": nats.url_for(NatsRole.WORKER)},
            )
            self._say("worker", f"vLLM on {self.model_dir}", "worker")
            self._spawn(
                "api",
                [*COMMAND, "api", "--host", self.host, "--port", str(self.port)],
                {
                    "KVGATE_NATS_URL": nats.url_for(NatsRole.FRONT_DOOR),
                    "KVGATE_ADMIN_TOKEN": admin_token,
                },
            )
            self._say("api", f"the front door on {self.base_url}", "api")
            code = self._wait_ready()
            if code is None:
                shown = "KVGATE_ADMIN_TOKEN" if given_token else admin_token
                print(self._banner(time.monotonic() - started, shown), flush=True)
                code = self._wait_until_stopped()
            return code
        finally:
            self._stop_children()
            nats.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            print("kvgate stopped", flush=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _say(self, component: str, what: str, log: str) -> None:
        print(f"  {component:<7} {what}  (log: {self.log_dir / log}.log)", flush=True)

    def _banner(self, took_s: float, admin_token: str) -> str:
        """``admin_token``: the one made here, or the name of the variable that set it (a
        token the operator chose is not printed into a terminal's scrollback or a log)."""
        model = _served_model(self.base_url) or "<model>"
        example = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        )
        rows = [
            ("API", f"{self.base_url}/v1  (OpenAI-compatible)"),
            ("dashboard", f"{self.base_url}/dashboard  (admin token: {admin_token})"),
            ("metrics", f"{self.base_url}/metrics"),
        ]
        traces = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if traces:
            rows.append(("traces", f"OTLP to {traces}"))
        rows.append(("logs", str(self.log_dir)))
        return "\n".join(
            [
                f"kvgate is ready in {took_s:.0f} s",
                *(f"  {name:<10} {value}" for name, value in rows),
                "  try:",
                f"    curl -s {self.base_url}/v1/chat/completions \\",
                f"      -H 'content-type: application/json' -d '{example}'",
                "Ctrl-C stops everything",
            ]
        )

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self._stop_signal = signum

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        # Its own process group keeps the terminal's Ctrl-C from reaching it, so the children
        # stop in the order ``_stop_children`` says.
        self._children[name] = Proc(name, cmd, env, self.log_dir)

    def _died(self, name: str, code: int, when: str) -> None:
        print(f"kvgate {name} exited {when} ({code}); the end of its log:", file=sys.stderr)
        log = self.log_dir / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        for line in lines[-DIED_LOG_LINES:]:
            print(f"  | {line}", file=sys.stderr)

    def _exited(self) -> tuple[str, int] | None:
        for name, proc in self._children.items():
            if proc.returncode is not None:
                return name, proc.returncode
        return None

    def _wait_ready(self) -> int | None:
        """None once /readyz says ready; an exit code if a child died or we were stopped."""
        deadline = time.monotonic() + self.ready_timeout_s
        with _Progress() as progress:
            while time.monotonic() < deadline:
                if self._stop_signal is not None:
                    return 0
                exited = self._exited()
                if exited is not None:
                    progress.stop()
                    self._died(*exited, "during start-up")
                    return 1
                status = _readyz(self.base_url)
                if status == 200:
                    return None
                progress.show(
                    "waiting for the front door" if status is None
                    else "waiting for the worker's engine to load the model"
                )  # fmt: skip
                time.sleep(0.5)
        print(f"kvgate was not ready within {self.ready_timeout_s:.0f}s", file=sys.stderr)
        return 1

    def _wait_until_stopped(self) -> int:
        while self._stop_signal is None:
            exited = self._exited()
            if exited is not None:
                self._died(*exited, "")
                print("stopping", file=sys.stderr)
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


def _readyz(base_url: str) -> int | None:
    """The front door's /readyz status, None while it does not answer."""
    try:
        with urllib.request.urlopen(base_url + "/readyz", timeout=1) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def _served_model(base_url: str) -> str | None:
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as resp:
            data = json.load(resp)["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None
    return str(data[0]["id"]) if data else None


class _Progress:
    """What start-up is waiting for: a spinner with the seconds waited on a terminal, a line
    per change of phase otherwise (a log file, CI)."""

    def __init__(self) -> None:
        self._live = sys.stdout.isatty()
        self._status: Status | None = None
        self._phase: str | None = None
        self._since = time.monotonic()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def show(self, phase: str) -> None:
        waited = f"{time.monotonic() - self._since:.0f} s"
        if not self._live:
            if phase != self._phase:
                print(f"  ... {phase}", flush=True)
        elif self._status is None:
            self._status = Status(f"{phase} ({waited})")
            self._status.start()
        else:
            self._status.update(f"{phase} ({waited})")
        self._phase = phase

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
