"""Heartbeats from workers that are not there: capacity for the front door to admit against
without an engine (admission decides from heartbeats alone), or a worker that never pulls."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.js.kv import KeyValue

from schemas.wire import WORKERS_BUCKET, WorkerHeartbeat, encode


def idle_heartbeat(worker_id: str, capacity: int, max_num_seqs: int = 16) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        model="kvgate-dev",
        sent_ms=int(time.time() * 1000),
        kv_cache_usage=0.0,
        num_running=0,
        num_waiting=0,
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=capacity,
    )


async def put_heartbeat(kv: KeyValue, beat: WorkerHeartbeat) -> None:
    await kv.put(beat.worker_id, encode(beat))


async def stuck_worker_heartbeat(nats_url: str) -> None:
    """A heartbeat from a worker that will never pull (hung, or cut off from the stream)."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(WORKERS_BUCKET)
        await put_heartbeat(kv, idle_heartbeat("stuck", capacity=2048))
    finally:
        await nc.close()


async def keep_beating(
    kv: KeyValue, worker_id: str, capacity: int, *, max_num_seqs: int, interval_s: float
) -> None:
    """An idle worker's heartbeat every ``interval_s``, until cancelled (paced, as a worker's
    loop is)."""
    while True:
        await put_heartbeat(kv, idle_heartbeat(worker_id, capacity, max_num_seqs=max_num_seqs))
        await asyncio.sleep(interval_s)
