"""The HTTP side of :class:`~engram_client.EngramClient`: the connection, retries, redirects and pages.

Every resource of the client (``engram_client.resources``) is a mixin over :class:`Transport`, so
how a request is sent, retried and parsed is written once, here.

Idempotent GETs are retried with exponential backoff on connection errors and 503 (the service
answers 503 while its storage or broker is away, which is usually brief); writes never are, because
a POST that timed out may still have been applied.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from api_schemas import MAX_PAGE_SIZE, NEXT_CURSOR_HEADER
from engram_client.errors import EngramAPIError, EngramConnectionError, EngramError, _Transient

__all__ = ["DEFAULT_URL", "FINISHED", "PNG_SIGNATURE", "Page", "Transport"]

DEFAULT_URL = "http://127.0.0.1:8000"
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
CHUNK_BYTES = 1 << 20
MAX_RETRY_AFTER_S = 30.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class Page(list[M], Generic[M]):
    """A list the service answered page by page: its items, and ``next_cursor``, the cursor of the
    page after them (``None`` when they end the list, always so for a list read whole)."""

    def __init__(self, items: Iterable[M] = (), next_cursor: str | None = None) -> None:
        super().__init__(items)
        self.next_cursor = next_cursor


class Transport:
    """One service's connection: sends requests, retries what is safe to retry, parses the answers.

    The arguments are :class:`~engram_client.EngramClient`'s (its docstring says what each does).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60,
        transport: httpx.BaseTransport | None = None,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        page_size: int = MAX_PAGE_SIZE,
    ) -> None:
        self.base_url = (base_url or os.environ.get("ENGRAM_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("ENGRAM_API_KEY")
        headers = {"Accept": "application/json", "User-Agent": "engram-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.retries, self.backoff_s, self.timeout = retries, backoff_s, timeout
        self.page_size = page_size
        # Redirects are followed by hand (see _stream): the Authorization header must never reach another host.
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport, follow_redirects=False
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _request(self, method: str, path: str, *, retry: bool | None = None, **kwargs: Any) -> httpx.Response:
        """Send one request; a non-2xx answer raises :class:`EngramAPIError`. GETs retry unless ``retry=False``."""
        retry = method == "GET" if retry is None else retry

        def send() -> httpx.Response:
            response = self._http.request(method, path, **kwargs)
            if retry and response.status_code == 503:
                raise _Transient(EngramAPIError.from_response(response), _retry_after(response))
            return response

        response = self._retrying(send, retry)
        if not response.is_success:
            raise EngramAPIError.from_response(response)
        return response

    def _retrying(self, attempt: Callable[[], T], retry: bool) -> T:
        """Run ``attempt``; on a connection error or :class:`_Transient`, back off and try again."""
        delays = [self.backoff_s * 2**n for n in range(self.retries)] if retry else []
        for n in range(len(delays) + 1):
            last = n == len(delays)
            try:
                return attempt()
            except httpx.TransportError as exc:
                if last:
                    raise self._connection_error(exc) from exc
                delay = delays[n]
            except _Transient as transient:
                if last:
                    raise transient.error from None
                delay = max(delays[n], transient.retry_after)
            time.sleep(delay)
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _connection_error(self, exc: httpx.TransportError) -> EngramConnectionError:
        timed_out = isinstance(exc, httpx.TimeoutException)
        what = "did not answer in time" if timed_out else "could not be reached"
        return EngramConnectionError(
            f"the Engram service at {self.base_url} {what} ({type(exc).__name__}: {exc})", timed_out
        )

    @contextmanager
    def _stream(self, path: str) -> Iterator[httpx.Response]:
        """GET ``path`` as a stream, following redirects by hand; 503 is :class:`_Transient`, other errors raise."""
        request = self._http.build_request("GET", path)
        for _ in range(MAX_REDIRECTS + 1):
            response = self._http.send(request, stream=True)
            if response.status_code in REDIRECTS and "location" in response.headers:
                response.close()
                request = self._redirected(request, response.headers["location"])
                continue
            try:
                if not response.is_success:
                    response.read()
                    error = EngramAPIError.from_response(response)
                    if response.status_code == 503:
                        raise _Transient(error, _retry_after(response))
                    raise error
                yield response
            finally:
                response.close()
            return
        raise EngramError(f"GET {path}: more than {MAX_REDIRECTS} redirects")

    def _redirected(self, previous: httpx.Request, location: str) -> httpx.Request:
        """The request for a redirect's target; the API key goes only to the service's own origin.

        A presigned S3 URL carries its own credentials: forwarding the key would leak it to the
        storage host (and S3 rejects a request that has two authentication mechanisms).
        """
        url = previous.url.join(location)
        request = self._http.build_request("GET", url)
        if not _same_origin(url, self._http.base_url):
            request.headers.pop("Authorization", None)
        return request

    def _list(
        self, model: type[M], path: str, params: Mapping[str, Any] | None, limit: int | None, cursor: str | None
    ) -> Page[M]:
        """A paginated list: every page, followed to the end, when neither ``limit`` nor ``cursor`` is
        given; else the one page of up to ``limit`` items (:attr:`page_size` unless given) starting
        at ``cursor`` (a previous page's ``next_cursor``; ``None``: the first page).

        Each item of a list that existed when paging began is returned once, even while others are
        added (the service pages in a stable order). A server without pagination answers the whole
        list at once, which this returns as it is.
        """
        one_page = limit is not None or cursor is not None
        query: dict[str, Any] = {**(params or {}), "limit": limit if limit is not None else self.page_size}
        items: list[M] = []
        while True:
            if cursor is not None:
                query["cursor"] = cursor
            response = self._request("GET", path, params=query)
            items.extend(self._parse_list(model, response))
            cursor = response.headers.get(NEXT_CURSOR_HEADER) or None
            if one_page or cursor is None:
                return Page(items, cursor)

    @staticmethod
    def _parse(model: type[M], response: httpx.Response) -> M:
        return model.model_validate_json(response.content)

    @staticmethod
    def _parse_list(model: type[M], response: httpx.Response) -> list[M]:
        return TypeAdapter(list[model]).validate_json(response.content)  # type: ignore[valid-type]


# ---------------------------------------------------------------- helpers


def _quote(segment: str) -> str:
    """A path segment for the URL; model IDs keep their one ``/`` (``org/name``), which the routes accept."""
    return quote(segment, safe="/")


def _set_only(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _retry_after(response: httpx.Response) -> float:
    """Seconds from a ``Retry-After`` header (only the delta-seconds form), capped; 0 when absent."""
    try:
        return min(max(float(response.headers.get("retry-after", 0)), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return 0.0


def _same_origin(url: httpx.URL, base: httpx.URL) -> bool:
    return (url.scheme, url.host, url.port) == (base.scheme, base.host, base.port)
