"""Waiting for state that lives in another process (HTTP, Redis, a database file), which can
only be polled, never awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
