"""Serve the console's static files under ``/ui``, with a Content-Security-Policy that keeps its
script's network access to the service's own origin."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).parent / "static"
CONSOLE_URL = "/ui"

# 'self' only: no CDN, no inline script or style, no fetch, image or frame from elsewhere. Images the
# console draws from authenticated bytes (maps, fronts) come as blob: URLs it made itself.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob: data:",
        "connect-src 'self'",
        "font-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    b"content-security-policy": CONTENT_SECURITY_POLICY.encode(),
    b"x-content-type-options": b"nosniff",
    b"referrer-policy": b"no-referrer",
    b"cache-control": b"no-cache",  # revalidate: a new release's script is never mixed with an old page
}


class ConsoleHeaders:
    """Adds :data:`SECURITY_HEADERS` to every answer under ``/ui``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == CONSOLE_URL or path.startswith(CONSOLE_URL + "/")):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(name, value) for name, value in SECURITY_HEADERS.items() if name not in names]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install_console(app: FastAPI) -> None:
    """``/ui`` (the page), ``/ui/static/...`` (its assets); hidden from the OpenAPI document: it is not API."""
    index = STATIC_DIR / "index.html"

    @app.get(CONSOLE_URL, include_in_schema=False)
    def console_redirect() -> RedirectResponse:
        return RedirectResponse("ui/")  # relative: right under a proxy's path prefix too

    @app.get(CONSOLE_URL + "/", include_in_schema=False)
    def console_page() -> FileResponse:
        return FileResponse(index, media_type="text/html; charset=utf-8")

    app.mount(CONSOLE_URL + "/static", StaticFiles(directory=STATIC_DIR), name="console-static")
    app.add_middleware(ConsoleHeaders)
