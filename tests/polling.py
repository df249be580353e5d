"""Waiting for state that lives in another process (HTTP, Redis, a database file), which can
only be polled, never awaited."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx

T = TypeVar("T")

READY_BOUND_S = 20.0
"""How long a front door may take to see a worker: its KV watch delivers a heartbeat within
milliseconds, a first worker still connects and provisions first; generous for a loaded
2-core machine."""


async def poll_until(
    read: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
) -> T:
    """Call ``read`` until ``done`` holds for its value; the last value, or ``TimeoutError``."""
    async with asyncio.timeout(timeout_s):
        while True:
            value = await read()
            if done(value):
                return value
            await asyncio.sleep(interval_s)


async def wait_ready(base_url: str, *, timeout_s: float = READY_BOUND_S) -> None:
    """Until the front door at ``base_url`` answers ``/readyz`` with 200: it sees a live,
    non-draining worker (its heartbeat, from a real worker or put by the test)."""
    async with httpx.AsyncClient(base_url=base_url) as client:
        await poll_until(
            lambda: client.get("/readyz"), lambda r: r.status_code == 200, timeout_s=timeout_s
        )


@contextlib.asynccontextmanager
async def bounded(seconds: float, what: str) -> AsyncIterator[None]:
    """Fails with ``AssertionError`` if the block runs longer than ``seconds``, after printing
    the stack of every task on the loop: a hang then says where it waits. pytest-timeout's
    report shows only the event loop's idle ``select`` (seen in CI)."""
    loop = asyncio.get_running_loop()
    dump = loop.call_later(seconds, _print_tasks, what)
    timeout = asyncio.timeout(seconds + 1)  # a moment after the dump
    try:
        async with timeout:
            yield
    except TimeoutError:
        if not timeout.expired():
            raise  # the block's own
        raise AssertionError(
            f"{what}: still waiting after {seconds:g} s; every task's stack is printed above"
        ) from None
    finally:
        dump.cancel()


def _print_tasks(what: str) -> None:
    print(f"\n--- {what}: still waiting; the stack of every task ---", file=sys.stdout)
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stdout)
