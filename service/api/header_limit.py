"""A cap on a request's head (request line and headers): a 431 past ``ENGRAM_MAX_HEADER_BYTES``.

httptools, the parser uvicorn runs, has no limit of its own: a 100 MB header is buffered whole and
answered. No ASGI middleware can refuse it, since the server has buffered the head before the app
is called, so the cap is in the server's protocol, on the bytes received: while a request's head is
open (from the end of the previous request to the end of this one's headers) it may take at most
``max_head_bytes`` bytes. Past them the connection is answered 431 and closed, so a connection
holds at most the cap plus one socket read of head (asyncio reads at most 256 KiB at a time).

A chunk that would cross the cap is fed in two parts: up to the cap, then (when that part closed the
head) the rest, so a small head followed by a large body in one read is never counted as head. The
bytes of a next request's head that arrive in the same read as the end of the previous request are
not counted (the parser does not say where in a read a request ended): a head may so reach at most
twice the cap, or the cap plus one read, still a bound.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

REASON = b"Request Header Fields Too Large"
PROBLEM_TYPES = "https://engram.dev/problems/"  # as service.api.problems spells every problem type


def header_limited_protocol(max_head_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the head of every request capped at ``max_head_bytes``."""

    class HeaderLimitedProtocol(_HeaderLimited):
        limit = max_head_bytes

    return HeaderLimitedProtocol


class _HeaderLimited(HttpToolsProtocol):
    limit = 0  # set by header_limited_protocol

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config, server_state, app_state, **kwargs)
        self._head_open = True  # the first request's head begins with the connection
        self._head_bytes = 0
        self._heads_closed = 0  # heads the parser finished on this connection

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused: nothing more is read
            return
        if not self._head_open:
            super().data_received(data)
            return
        room = self.limit - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        self._head_bytes, closed = self.limit, self._heads_closed
        if room > 0:
            super().data_received(data[:room])
            if self.transport.is_closing():  # the parser refused the head (a 400 is on its way)
                return
        if self._heads_closed == closed:  # the head is still open at the cap
            self._refuse()
            return
        self.data_received(data[room:])  # the head closed within the cap: the rest is body (or the next request)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._heads_closed += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes = True, 0  # what follows is the next request's head

    def _refuse(self) -> None:
        detail = (
            f"the request line and headers are longer than {self.limit} bytes (ENGRAM_MAX_HEADER_BYTES, a server "
            "setting): send shorter headers, or ask the operator to raise the limit"
        )
        problem = {"type": f"{PROBLEM_TYPES}header-too-large", "title": REASON.decode(), "status": 431, "detail": detail}
        body = json.dumps(problem).encode()
        head = [
            b"HTTP/1.1 431 " + REASON,
            b"content-type: application/problem+json",
            b"content-length: " + str(len(body)).encode(),
            b"connection: close",
        ]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        self.logger.warning("a request's head passed %d bytes (ENGRAM_MAX_HEADER_BYTES): answered 431", self.limit)
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
