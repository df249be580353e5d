"""Child processes with a log file each, in a process group of their own inside the caller's
session, stopped by SIGTERM, a wait, then SIGKILL to whatever is left of the group. Used by the
tests and the load harness to run kvgate's own processes and vLLM's server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Proc:
    """A child process whose output goes to a log file, shown when a test needs it.

    It runs in a process group of its own (so that ``os.killpg`` reaches an engine core it
    started) but in this process's session: with the kernel's session autogroups on, a child in
    a session of its own competes for CPU as a group, and on a 2-core machine a busy engine's
    group was seen to stall the measuring process for ~120 ms at a time."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # Whatever is left of the process group (an engine core whose parent died) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_http(url: str, proc: Proc, *, timeout: float, status: int = 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}):\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=1).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer {status} within {timeout}s:\n{proc.tail()}")
