"""``kvgate worker``: start the engine once, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import shlex
import signal

from broker.settings import WorkerSettings
from workers.engine import EngineDeadError
from workers.headroom import HeadroomPolicy
from workers.worker import Worker, WorkerOptions, default_worker_id

log = logging.getLogger(__name__)


def engine_config(settings: WorkerSettings) -> object:
    from workers.vllm_engine import VllmEngineConfig

    return VllmEngineConfig(
        model=str(settings.model),
        served_model_name=settings.served_model_name,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        block_size=settings.block_size,
        num_gpu_blocks_override=settings.num_gpu_blocks_override,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        dtype=settings.dtype,
        enforce_eager=settings.enforce_eager,
        cpu_kvcache_space_gib=settings.cpu_kvcache_space_gib,
        serve_args=tuple(shlex.split(settings.vllm_args)),
    )


async def serve(settings: WorkerSettings) -> int:
    """Exit status: 0 after a clean drain, 1 when the engine died."""
    from workers.vllm_engine import VllmEngine, VllmEngineConfig

    if not (settings.model / "config.json").is_file():
        log.error(
            "no model at %s (build one with `kvgate model build %s`)",
            settings.model,
            settings.model,
        )
        return 2
    config = engine_config(settings)
    assert isinstance(config, VllmEngineConfig)
    # A stop asked for while the engine loads (seconds) is honoured once it has loaded:
    # the engine is then shut down cleanly instead of being orphaned.
    stop_early = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_early.set)
    engine = await VllmEngine.start(config)
    if stop_early.is_set():
        engine.shutdown()
        return 0
    # As `vllm serve` does once it has started: the start-up heap (vLLM, torch, the serving
    # layer) is frozen, so that no full collection walks it while calls run. Unfrozen, such
    # collections paused this worker for tens of milliseconds (time to first token p99).
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    worker = Worker(
        engine,
        WorkerOptions(
            nats_url=settings.nats_url,
            worker_id=settings.worker_id or default_worker_id(),
            heartbeat_interval_s=settings.heartbeat_interval_s,
            headroom=HeadroomPolicy(
                high_water=settings.kv_high_water,
                low_water=settings.kv_low_water,
                max_waiting=settings.max_waiting,
                starvation_s=settings.starvation_s,
                guaranteed_reserve=settings.guaranteed_reserve,
            ),
            pull_expires_s=settings.pull_expires_s,
            drain_grace_s=settings.drain_grace_s,
            nak_delay_s=settings.nak_delay_s,
            stream=settings.stream,
        ),
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.run()
        log.info("worker drained, exiting")
        return 0
    except EngineDeadError:
        return 1
    finally:
        engine.shutdown()
