"""The console's shell: served from the package with a strict Content-Security-Policy, public while it
holds no data, and a login that takes a key of any scope and refuses an unknown one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect

from engram_fixtures.live import LiveServer
from tests.console.conftest import KEYS, screenshot


def test_the_shell_is_public_but_every_api_call_needs_a_key(console_server: LiveServer) -> None:
    with httpx.Client(base_url=console_server.base_url) as anonymous:
        page = anonymous.get("/ui/")
        assert page.status_code == 200 and "Engram console" in page.text
        policy = page.headers["content-security-policy"]
        assert "connect-src 'self'" in policy and "script-src 'self'" in policy and "default-src 'none'" in policy
        assert anonymous.get("/ui/static/js/app.js").status_code == 200
        assert anonymous.get("/ui").status_code in {200, 307}
        assert anonymous.get("/whoami").status_code == 401  # the data stays behind the key
        assert anonymous.post("/ui/").status_code in {401, 403, 405}  # only GET/HEAD of the shell is public


def test_whoami_names_the_key_and_its_scope(console_server: LiveServer) -> None:
    for scope, key in KEYS.items():
        answer = httpx.get(f"{console_server.base_url}/whoami", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200
        body = answer.json()
        assert body["auth"] is True and body["scope"] == scope and body["key"].startswith("key-")
        assert key not in answer.text


def test_login_shows_the_scope_and_refuses_an_unknown_key(console_page: Callable[..., Page], screenshot_dir: Path) -> None:
    page = console_page(None)
    screenshot(page, screenshot_dir, "login")
    page.fill("#login-key", "not-a-key-of-this-service")
    page.click("#login-form button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("refused")
    page.fill("#login-key", KEYS["read"])
    page.click("#login-form button[type=submit]")
    expect(page.get_by_test_id("identity")).to_contain_text("read")
    expect(page.locator("#nav a[data-section=audit]")).to_be_hidden()  # the audit log is for admins
    admin = console_page("admin")
    expect(admin.get_by_test_id("identity")).to_contain_text("admin")
    expect(admin.locator("#nav a[data-section=audit]")).to_be_visible()
