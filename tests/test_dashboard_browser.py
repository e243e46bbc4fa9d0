"""The dashboard in a real browser: a stall injected on the server shows up within 2 s.

Policy: headless Debian Chromium (``/usr/bin/chromium``) driven by Playwright for Python,
which downloads no browser here. A frontend runs on 127.0.0.1:0 with its debug endpoints
on; the browser runs in a worker thread (Playwright's sync API must not run on the trio
loop, which keeps serving meanwhile). The page may fetch from its own origin only.
Screenshots go to ``artifacts/`` (gitignored). Without Chromium the test is skipped,
unless ``CI`` is set: then it fails, since ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from frontend_fixture import serve_frontend

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STALL_VISIBLE_WITHIN_S = 2.0
MODEL = "deepseek-v4"

#: True when the page shows a stall row whose text (summary or stack) names the frame.
HAS_INJECTED_ROW = """() => [...document.querySelectorAll('#stalls .stall')]
    .some(li => li.textContent.includes('inject_loop_stall'))"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _require_browser() -> Any:
    """The Playwright sync API module; skips (or fails in CI) when it cannot run."""
    problem = None
    if not CHROMIUM.exists():
        problem = f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        from playwright import sync_api
    except ImportError:
        problem = "the playwright package is not installed (pip install -e '.[browser]')"
    if problem is not None:
        if _in_ci():
            pytest.fail(f"CI is set but the browser test cannot run: {problem}")
        pytest.skip(problem)
    return sync_api


@dataclass
class Seen:
    """What the browser thread observed, for the assertions on the test's side."""

    appeared_after_s: float = -1.0
    stack_text: str = ""
    wide_overflow: tuple[int, int] = (0, 0)
    phone_overflow: tuple[int, int] = (0, 0)
    phone_rows: int = 0
    errors_text: str = ""
    routing_text: str = ""
    foreign_requests: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)


def drive_browser(sync_api: Any, base_url: str, seen: Seen) -> None:
    """Runs in a worker thread: load the page, inject a stall, watch it appear."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})

            def on_request(req: Any) -> None:
                if not req.url.startswith(base_url):
                    seen.foreign_requests.append(req.url)

            context.on("request", on_request)
            page = context.new_page()
            page.on("pageerror", lambda exc: seen.page_errors.append(str(exc)))
            page.on(
                "console",
                lambda msg: seen.page_errors.append(msg.text) if msg.type == "error" else None,
            )
            page.goto(base_url + "/dashboard")
            page.wait_for_function(
                "() => document.getElementById('status').textContent === 'live'", timeout=10_000
            )
            assert not page.evaluate(HAS_INJECTED_ROW)
            seen.errors_text = page.text_content("#errors tbody") or ""
            seen.routing_text = page.text_content("#routing") or ""

            r = httpx.post(base_url + "/debug/stall", params={"ms": 150}, timeout=10)
            r.raise_for_status()
            injected = time.monotonic()
            page.wait_for_function(HAS_INJECTED_ROW, timeout=STALL_VISIBLE_WITHIN_S * 1000)
            seen.appeared_after_s = time.monotonic() - injected

            row = page.locator("#stalls .stall", has_text="inject_loop_stall").first
            row.locator("summary").click()
            pre = row.locator("pre")
            pre.wait_for(state="visible", timeout=2000)
            seen.stack_text = pre.text_content() or ""
            seen.wide_overflow = _overflow(page)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            phone = browser.new_context(
                viewport={"width": 390, "height": 844},
                device_scale_factor=2,
                is_mobile=True,
                has_touch=True,
            )
            phone.on("request", on_request)
            small = phone.new_page()
            small.on("pageerror", lambda exc: seen.page_errors.append(str(exc)))
            small.goto(base_url + "/dashboard")
            small.wait_for_function(HAS_INJECTED_ROW, timeout=10_000)
            small.locator("#stalls .stall summary").first.click()  # an open stack, too
            seen.phone_rows = small.locator("#stalls .stall").count()
            seen.phone_overflow = _overflow(small)
            small.evaluate("window.scrollTo(0, 0)")
            small.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"))
        finally:
            browser.close()


def _overflow(page: Any) -> tuple[int, int]:
    """(document scroll width, viewport width): equal when nothing spills sideways."""
    width, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    return int(width), int(inner)


@pytest.mark.slow
async def test_injected_stall_appears_on_the_dashboard() -> None:
    sync_api = _require_browser()
    seen = Seen()
    async with (
        serve_frontend(debug_endpoints=True, router="kv") as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        for stream in (False, True):  # some traffic, so every panel has data
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "stream": stream,
            }
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        refused = await c.post(
            "/v1/chat/completions",
            json={**body, "model": "no-such-model"},
            headers={"X-Request-Id": "dash-req-42"},
        )
        assert refused.status_code == 404
        with trio.fail_after(90):
            await trio.to_thread.run_sync(
                drive_browser, sync_api, url, seen, abandon_on_cancel=True
            )
        records = (await c.get("/debug/stalls")).json()

    assert 0 <= seen.appeared_after_s <= STALL_VISIBLE_WITHIN_S
    (injected,) = [r for r in records if any("inject_loop_stall" in f for f in r["stack"])]
    # The stack is shown as text, frame for frame: "<locals>" in a qualname stays text.
    assert seen.stack_text == "\n".join(injected["stack"])
    assert any("<locals>" in frame for frame in injected["stack"])
    # The KV router's line: requests routed by cache and the recent hit rate.
    assert re.match(r"router: kv · 2 routed by cache · .* hit rate \d+% ", seen.routing_text), (
        seen.routing_text
    )
    assert "dash-req-42" in seen.errors_text  # the recent errors name the request
    assert "/v1/chat/completions" in seen.errors_text
    assert seen.foreign_requests == []
    assert seen.page_errors == []
    assert seen.wide_overflow[0] <= seen.wide_overflow[1]
    assert seen.phone_overflow[0] <= seen.phone_overflow[1], "horizontal overflow on a phone"
    assert seen.phone_rows >= 1
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    assert (ARTIFACTS / "dashboard-phone.png").stat().st_size > 10_000


KEY = "dashboard-key-7f3a"
IS_LIVE = "() => document.getElementById('status').textContent === 'live'"


@dataclass
class KeyedSeen:
    """What the browser saw of a frontend started with an API key."""

    asked: bool = False
    refused_message: str = ""
    stored: str | None = None
    asked_after_reload: bool = True
    urls: list[str] = field(default_factory=list)
    data_authorizations: list[str | None] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)


def drive_keyed_browser(sync_api: Any, base_url: str, seen: KeyedSeen) -> None:
    """Runs in a worker thread: open the page, give a wrong key then the right one, reload."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()

            def on_request(req: Any) -> None:
                seen.urls.append(req.url)
                if req.url.split("?")[0].endswith("/dashboard/data"):
                    seen.data_authorizations.append(req.headers.get("authorization"))

            context.on("request", on_request)
            page = context.new_page()
            page.on("pageerror", lambda exc: seen.page_errors.append(str(exc)))
            page.goto(base_url + "/dashboard")
            page.wait_for_selector("#key-form", state="visible", timeout=10_000)
            seen.asked = True
            page.fill("#key-input", "not-the-key")
            page.press("#key-input", "Enter")
            page.wait_for_function(
                "() => document.getElementById('key-error').textContent !== ''", timeout=5000
            )
            seen.refused_message = page.text_content("#key-error") or ""
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            page.wait_for_function(IS_LIVE, timeout=5000)
            seen.stored = page.evaluate("sessionStorage.getItem('headwater.dashboard.apiKey')")
            page.reload()  # the tab keeps the key: no second prompt
            page.wait_for_function(IS_LIVE, timeout=5000)
            seen.asked_after_reload = page.is_visible("#key-form")
        finally:
            browser.close()


@pytest.mark.slow
async def test_with_an_api_key_the_page_asks_for_it_and_sends_it_in_a_header() -> None:
    sync_api = _require_browser()
    seen = KeyedSeen()
    async with serve_frontend(api_keys=(KEY,)) as (_, url), httpx.AsyncClient(base_url=url) as c:
        # The page and its files are open; its data is not.
        for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/dashboard/data")).status_code == 401
        with trio.fail_after(60):
            await trio.to_thread.run_sync(
                drive_keyed_browser, sync_api, url, seen, abandon_on_cancel=True
            )

    assert seen.asked
    assert "refused" in seen.refused_message
    assert seen.stored == KEY
    assert not seen.asked_after_reload
    assert f"Bearer {KEY}" in seen.data_authorizations
    assert seen.data_authorizations[0] is None  # the first poll, before the page had a key
    assert not [u for u in seen.urls if KEY in u], "the key went into a URL"
    assert seen.page_errors == []
