"""The front door's cost per streamed token, in-process: the wait for a call's next reply
events (``ReplyStream.next_batch``) and the bound on each SSE write (``SseResponse``), each
timed over many rounds on the event loop the front door runs (uvloop), with nothing else in
the loop. CPU time, median of 5 rounds.

Run: ``.venv/bin/python -m loadtests.micro_relay`` (a few seconds). To time another checkout's
``next_batch``, run this file by its path from outside both trees, that checkout first on
``PYTHONPATH`` (``python -m`` from this tree would import this tree's ``api`` instead). The
write bound's two forms are timed side by side in one run, since only one is in the code.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio
import uvloop

from api.replies import ReplyStream
from schemas.wire import TokenDelta

ROUNDS = 50_000


async def _send(message: object) -> None:
    """An ASGI send that does not wait, as uvicorn's does while the socket takes the bytes."""


async def next_batch_us() -> float:
    stream = ReplyStream("call", "inbox")
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for seq in range(ROUNDS):
        loop.call_soon(stream.feed, TokenDelta(seq, 1, "x", 1))
        await stream.next_batch(60)
    return (time.process_time() - started) / ROUNDS * 1e6


async def fail_after_us() -> float:
    """The bound as it was: an anyio cancel scope around each write."""
    started = time.process_time()
    for seq in range(ROUNDS):
        with anyio.fail_after(30):
            await _send(seq)
    return (time.process_time() - started) / ROUNDS * 1e6


async def rescheduled_timeout_us() -> float:
    """The bound as ``SseResponse`` keeps it: one timer, armed around each write."""
    loop = asyncio.get_running_loop()
    bound = asyncio.timeout(None)
    started = time.process_time()
    async with bound:
        for seq in range(ROUNDS):
            bound.reschedule(loop.time() + 30)
            await _send(seq)
            bound.reschedule(None)
    return (time.process_time() - started) / ROUNDS * 1e6


async def median_us(measure: Callable[[], Awaitable[float]]) -> float:
    return statistics.median([await measure() for _ in range(5)])


async def main() -> None:
    print(f"next_batch: {await median_us(next_batch_us):.2f} us per batch")
    print(f"SSE write bound, anyio.fail_after per write: {await median_us(fail_after_us):.2f} us")
    print(
        "SSE write bound, one asyncio.timeout rescheduled: "
        f"{await median_us(rescheduled_timeout_us):.2f} us"
    )


if __name__ == "__main__":
    uvloop.run(main())
