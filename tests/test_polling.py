"""The tests' own waiting helpers (tests/polling.py) fail the way they promise."""

from __future__ import annotations

import asyncio

import pytest

from tests.polling import bounded


async def a_wait_that_never_ends() -> None:
    await asyncio.Event().wait()


async def test_a_bounded_block_that_hangs_fails_and_prints_where_it_waits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(AssertionError, match=r"the stuck part: still waiting after 0\.1 s"):
        async with bounded(0.1, "the stuck part"):
            await a_wait_that_never_ends()
    assert "a_wait_that_never_ends" in capsys.readouterr().out


async def a_wait_that_times_out_on_its_own() -> None:
    async with bounded(30, "a block with its own timeout"), asyncio.timeout(0.01):
        await a_wait_that_never_ends()


async def test_a_bounded_blocks_own_timeout_passes_through() -> None:
    with pytest.raises(TimeoutError):
        await a_wait_that_times_out_on_its_own()
