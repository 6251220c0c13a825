"""The console's browser tests: a live server with three API keys (read, write, admin) serving the
mini-TOFU demo's folder, and Debian's Chromium driven by Playwright (never a downloaded browser).

Every page a test opens goes through :func:`console_page`: its browser context aborts any request that
leaves the server's origin and records it, and the test fails if one was attempted (the console must
work with its network restricted to its own origin). Screenshots go to ``ENGRAM_SCREENSHOT_DIR``
(default: a ``console-screenshots`` folder of pytest's temporary directory for the session).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Route, sync_playwright

from engram_fixtures.live import LiveServer, running_server

CHROMIUM = Path(os.environ.get("ENGRAM_CHROMIUM", "/usr/bin/chromium"))
# The flags the machine's notes give for a headless Chromium as root on a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEYS = {
    "read": "console-read-key-0123456789",
    "write": "console-write-key-0123456789",
    "admin": "console-admin-key-0123456789",
}


@pytest.fixture(scope="module")
def console_server(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real server (embedded) with keys of each scope; its model root holds ``demo/`` (the README's)."""
    keys = ",".join(f"{key}:{scope}" for scope, key in KEYS.items())
    with running_server(tmp_path_factory.mktemp("console"), mini_tofu_demo, ENGRAM_API_KEYS=keys) as live:
        live.client.headers["Authorization"] = f"Bearer {KEYS['admin']}"
        yield live


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium; .ci/run does)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("ENGRAM_SCREENSHOT_DIR")
    folder = Path(configured) if configured else tmp_path_factory.mktemp("console-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def console_page(browser: Browser, console_server: LiveServer) -> Iterator[Callable[..., Page]]:
    """``console_page(scope)`` opens the console logged in with that scope's key (``None``: not logged in)."""
    contexts: list[BrowserContext] = []
    outside: list[str] = []
    errors: list[str] = []
    origin = urlsplit(console_server.base_url)

    def open_page(scope: str | None = "write", path: str = "") -> Page:
        context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 900})
        contexts.append(context)

        def only_own_origin(route: Route) -> None:
            target = urlsplit(route.request.url)
            if target.scheme in {"blob", "data"} or (target.scheme, target.netloc) == (origin.scheme, origin.netloc):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_own_origin)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.goto(f"{console_server.base_url}/ui/{path}")
        if scope is not None:
            login(page, KEYS[scope])
        return page

    yield open_page
    for context in contexts:
        context.close()
    assert not outside, f"the console asked for something outside its origin: {outside}"
    # A refused request (a 403 the test provoked) logs a console error in Chromium; script errors never pass.
    script_errors = sorted({e for e in errors if "Failed to load resource" not in e})
    assert not script_errors, f"the console's script failed: {script_errors}"


def login(page: Page, key: str) -> None:
    page.fill("#login-key", key)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("[data-testid=identity]:not(:empty)")


def screenshot(page: Page, folder: Path, name: str) -> Path:
    """Save the whole page as ``<folder>/<name>.png``."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
