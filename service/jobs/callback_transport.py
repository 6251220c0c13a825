"""The HTTP transport of callback deliveries: one deadline for the whole delivery, not per read.

httpx's timeouts bound each socket operation, so a receiver that sends a byte a second (of its
headers or its body) holds a delivery forever. Here every connect, write and read of a delivery
waits at most until the delivery's deadline (:func:`deadline`), set by the delivering thread around
its request: past it the operation raises httpx's own timeout (``ConnectTimeout``, ``WriteTimeout``,
``ReadTimeout``), whatever the receiver does. How much of an answer is read is the caller's to
bound (:mod:`service.jobs.callbacks` reads a few KB of the body, raw, and drops the connection).

The transport is httpx's own :class:`httpx.HTTPTransport` over a connection pool whose network
backend is wrapped; proxies from the environment are not used (callbacks go to the allowlisted host
itself, the address the allowlist judged).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("callback_deadline", default=None)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every socket operation of this thread's deliveries ends within ``seconds`` from now, together."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _remaining(timeout: float | None, what: type[Exception]) -> float | None:
    """``timeout`` cut to what is left of the delivery's deadline; ``what`` raised once none is."""
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise what("the callback delivery's deadline (ENGRAM_CALLBACK_TIMEOUT_S) passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _remaining(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _remaining(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        wrapped = self._stream.start_tls(ssl_context, server_hostname, _remaining(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(wrapped)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _remaining(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._backend.connect_tcp(host, port, left, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("callbacks are sent over TCP only")

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's transport whose connections keep to the delivery's :func:`deadline`."""

    def __init__(self, max_connections: int) -> None:
        super().__init__(trust_env=False)
        # httpx builds its pool without a way to pass a network backend: the same pool, with ours.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            network_backend=_DeadlineBackend(),
        )
