"""``kvgate worker``: start the engine once, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from workers.engine import EngineDeadError
from workers.settings import WorkerSettings
from workers.worker import Worker

log = logging.getLogger(__name__)


async def serve(settings: WorkerSettings) -> int:
    """Exit status: 0 after a clean drain, 1 when the engine died."""
    from workers.vllm_engine import VllmEngine

    model = settings.engine.model
    if not (model / "config.json").is_file():
        log.error("no model at %s (build one with `kvgate model build %s`)", model, model)
        return 2
    # A stop asked for while the engine loads (seconds) is honoured once it has loaded:
    # the engine is then shut down cleanly instead of being orphaned.
    stop_early = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_early.set)
    engine = await VllmEngine.start(settings.engine)
    if stop_early.is_set():
        engine.shutdown()
        return 0
    # As `vllm serve` does once it has started: the start-up heap (vLLM, torch, the serving
    # layer) is frozen, so that no full collection walks it while calls run. Unfrozen, such
    # collections paused this worker for tens of milliseconds (time to first token p99).
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    worker = Worker(engine, settings)
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
