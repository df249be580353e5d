"""A worker host for the rehearsal (``loadtests/rehearsal.py``): many workers on simulated
engines in one process, started a few a second, until SIGTERM; then each drains, as ``kvgate
worker`` does.

    python -m loadtests.fleethost --workers K --name h00 --stats h00.json --nats-url URL

The process counts, at the client, the pull requests its workers send and the answers they get
(a call, or a status: 408 the request expired, 409 the server refused it, 100 an idle
heartbeat), and writes them to ``--stats`` (JSON) four times a second. The puller keeps no
such counters of its own; the host wraps its two methods that send a request and receive an
answer. The stream layout comes from ``KVGATE_STREAM_*``, as for any worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from workers.puller import TierPuller
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, SimEngineConfig
from workers.worker import Worker

MODEL = "kvgate-sim"


def count_pulls(counts: Counter[str]) -> None:
    request, receive = TierPuller.request, TierPuller._receive

    async def counted_request(self: TierPuller, n: int) -> None:
        before = self.outstanding
        await request(self, n)
        # Counted only if sent: a tier held back after a MaxWaiting refusal sends nothing.
        if self.outstanding > before:
            counts["pull_requests"] += 1
            counts["pull_credit"] += n

    async def counted_receive(self: TierPuller, msg: Any) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        counts["delivered" if status is None else f"status_{status}"] += 1
        if status == "409" and "MaxWaiting" in headers.get("Description", ""):
            counts["refused_max_waiting"] += 1
        await receive(self, msg)

    TierPuller.request = counted_request  # type: ignore[method-assign]
    TierPuller._receive = counted_receive  # type: ignore[method-assign]


async def serve(args: argparse.Namespace) -> None:
    counts: Counter[str] = Counter()
    count_pulls(counts)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    workers: list[Worker] = []
    tasks: list[asyncio.Task[None]] = []

    def write_stats() -> None:
        crashed = sum(1 for t in tasks if t.done() and not t.cancelled() and t.exception())
        data = {"at": time.time(), "workers": len(workers), "crashed": crashed, **counts}
        tmp = args.stats.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(args.stats)

    async def keep_writing() -> None:
        while True:
            write_stats()
            await asyncio.sleep(0.25)

    writer = asyncio.create_task(keep_writing())
    config = SimEngineConfig(
        served_model_name=MODEL,
        max_num_seqs=args.seqs,
        kv_capacity_tokens=args.kv_tokens,
        step_s=args.step_s,
    )
    for i in range(args.workers):
        if stop.is_set():
            break
        settings = WorkerSettings(
            nats_url=args.nats_url,
            worker_id=f"{args.name}-{i:04d}",
            heartbeat_interval_s=args.heartbeat_s,
        )
        workers.append(Worker(SimEngine(config), settings))
        tasks.append(asyncio.create_task(workers[-1].run()))
        await asyncio.sleep(1 / args.start_rate)
    await stop.wait()
    for worker in workers:
        worker.request_stop()
    await asyncio.wait(tasks, timeout=30)
    writer.cancel()
    write_stats()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--name", required=True, help="worker ids are NAME-0000, NAME-0001, ...")
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("--nats-url", required=True)
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=8192)
    p.add_argument("--step-s", type=float, default=0.002)
    p.add_argument("--start-rate", type=float, default=25.0, help="workers started a second")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
