"""The HTTP/1.1 protocol the front door serves with: uvicorn's httptools protocol, with the
request head (request line and headers) bounded.

uvicorn bounds a request head only in its h11 protocol; its httptools protocol (the faster one,
which uvicorn picks when httptools is installed) keeps every byte a client sends before the
end of its headers: an 8 MiB header was accepted, and a client that never ends its headers
could grow the process without limit. This subclass counts the head's bytes as they arrive and
answers ``431`` and closes the connection once they pass ``max_head_bytes``. Everything else is
uvicorn's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\ncontent-length: 36\r\nconnection: close\r\n\r\n"
    b"the request's headers are too large\n"
)


def bounded_head_protocol(max_head_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, refusing a request head past ``max_head_bytes``."""

    class BoundedHeadProtocol(HttpToolsProtocol):
        def __init__(
            self,
            config: Config,
            server_state: ServerState,
            app_state: dict[str, Any],
            _loop: asyncio.AbstractEventLoop | None = None,
        ) -> None:
            super().__init__(config, server_state, app_state, _loop)
            self._in_head = True
            self._head_bytes = 0
            self._heads_ended = 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads_ended += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # a next request on the connection

        def data_received(self, data: bytes) -> None:
            # Counted after the parser has read the chunk, and only where the chunk ended no
            # head: one that ends a head may carry a body after it, or whole requests, which
            # are not a head's bytes (bodies have their own bound). At most one read past the
            # bound is held.
            in_head, heads_ended = self._in_head, self._heads_ended
            super().data_received(data)
            if in_head and self._heads_ended == heads_ended and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self.transport.write(_REFUSAL)
                    self.transport.close()

    return BoundedHeadProtocol
