"""The front door keeps idle connections longer than clients keep theirs (``KVGATE_KEEP_ALIVE_S``,
``broker/settings.py``): a client that reuses its connection after a pause is answered, not
reset, and an idle connection is still closed once the setting's time has passed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from broker.natsserver import EmbeddedNats
from tests.procs import start_api

CLIENT_IDLE_S = 6.0
"""A pause longer than uvicorn's default keep-alive (5 s), which equals httpx's (OpenAI's SDK):
the pause after which the default would have closed the connection under the client."""
CLOSE_BOUND_S = 15.0
"""For a front door kept to a 1 s keep-alive to close an idle connection: generous for a loaded
2-core machine."""

_PROBE = b"GET /healthz HTTP/1.1\r\nHost: kvgate\r\n\r\n"


async def _answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """Sends a probe on the open connection; its status line (empty if the server closed it)."""
    writer.write(_PROBE)
    await writer.drain()
    status = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def test_a_connection_idle_past_the_clients_own_keep_alive_is_still_served(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc, base = start_api(nats_server.url, tmp_path)
    host, port = base.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(CLIENT_IDLE_S)
            assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
    finally:
        proc.stop()


async def test_an_idle_connection_is_closed_after_the_keep_alive(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc, base = start_api(nats_server.url, tmp_path, KVGATE_KEEP_ALIVE_S="1")
    host, port = base.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
            # Nothing more is sent: the server ends the connection, which reads as its end.
            assert await asyncio.wait_for(reader.read(), CLOSE_BOUND_S) == b""
        finally:
            writer.close()
    finally:
        proc.stop()
