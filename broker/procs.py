"""Child processes, each in a process group of its own inside the caller's session, stopped by
SIGTERM, a wait, then SIGKILL to whatever is left of the group. The one supervisor of child
processes: ``kvgate up`` and the embedded NATS server use it, and so do the tests and the load
harness (kvgate's own processes, vLLM's server)."""

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
    """A child process whose output goes to ``log_dir/<name>.log`` (shown when a test needs
    it), or to this process's own output with no ``log_dir``. Its input is closed.

    It runs in a process group of its own: a terminal's Ctrl-C (sent to the foreground group)
    reaches only the parent, which stops its children in the order it chooses, and
    ``os.killpg`` reaches what the child started (an engine core). It stays in this process's
    session: with the kernel's session autogroups on, a child in a session of its own competes
    for CPU as a group, and on a 2-core machine a busy engine's group was seen to stall the
    other processes for ~120 ms at a time."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        log_dir: Path | None,
        *,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = None if log_dir is None else log_dir / f"{name}.log"
        self._log = None if self.log_path is None else self.log_path.open("wb")
        self.killed = False
        """Whether ``stop`` had to kill it: it did not exit within its grace."""
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=None if self._log is None else subprocess.STDOUT,
            process_group=0,
            cwd=cwd,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 60) -> str:
        if self.log_path is None:
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, up to ``timeout`` to exit, then SIGKILL to the whole process group (also
        whatever the child left behind when it exited: an engine core whose parent died)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._log is not None:
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
