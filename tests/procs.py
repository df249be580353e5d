"""Real kvgate processes for tests: the front door and workers as subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

from broker.procs import Proc, free_port, wait_http
from kvgate.cli import COMMAND
from workers.settings import worker_env


def start_api(nats_url: str, log_dir: Path, **env: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        f"api-{port}",
        [*COMMAND, "api", "--port", str(port)],
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


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def start_worker(nats_url: str, model: Path, log_dir: Path, name: str, **env: str) -> Proc:
    return Proc(
        f"worker-{name}",
        [*COMMAND, "worker", "--model", str(model), "--worker-id", name],
        {"KVGATE_NATS_URL": nats_url, **WORKER_ENV, **env},
        log_dir,
    )


# A small engine: 16 sequences, 64 blocks of 32 tokens (2,048 KV tokens), 1,024-token context.
WORKER_ENV = {
    **worker_env(
        max_num_seqs=16,
        block_size=32,
        num_gpu_blocks_override=64,
        max_model_len=1024,
        enforce_eager=True,
        heartbeat_interval_s=0.5,
        drain_grace_s=10,
    ),
    # One OpenMP thread, unbound: by default the CPU engine binds a spinning thread to every
    # core, which on a 2-core CI machine starves the front door and the worker's own event
    # loop (and a second engine) of CPU.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def mib(n: int) -> float:
    """Bytes in MiB, one decimal: for reports."""
    return round(n / 2**20, 1)


def resident_bytes(pid: int) -> int:
    """A process's resident memory (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
