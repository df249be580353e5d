"""Real kvgate processes for tests: the front door and workers as subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KVGATE = [sys.executable, "-m", "broker.cli"]


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


def start_api(nats_url: str, log_dir: Path, **env: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        f"api-{port}",
        [*KVGATE, "api", "--port", str(port)],
        {
            "KVGATE_NATS_URL": nats_url,
            # A ledger of its own, so that front doors of different tests never share a file.
            "KVGATE_DATABASE_URL": f"sqlite:///{log_dir}/ledger-{port}.db",
            **env,
        },
        log_dir,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", proc, timeout=30)
    return proc, base


def start_worker(nats_url: str, model: Path, log_dir: Path, name: str, **env: str) -> Proc:
    return Proc(
        f"worker-{name}",
        [*KVGATE, "worker", "--model", str(model), "--worker-id", name],
        {"KVGATE_NATS_URL": nats_url, **WORKER_ENV, **env},
        log_dir,
    )


# A small engine: 16 sequences, 64 blocks of 32 tokens (2,048 KV tokens), 1,024-token context.
WORKER_ENV = {
    "KVGATE_WORKER_MAX_NUM_SEQS": "16",
    "KVGATE_WORKER_BLOCK_SIZE": "32",
    "KVGATE_WORKER_NUM_GPU_BLOCKS_OVERRIDE": "64",
    "KVGATE_WORKER_MAX_MODEL_LEN": "1024",
    "KVGATE_WORKER_ENFORCE_EAGER": "true",
    "KVGATE_WORKER_HEARTBEAT_INTERVAL_S": "0.5",
    "KVGATE_WORKER_DRAIN_GRACE_S": "10",
    # One OpenMP thread, unbound: by default the CPU engine binds a spinning thread to every
    # core, which on a 2-core CI machine starves the front door and the worker's own event
    # loop (and a second engine) of CPU.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


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
