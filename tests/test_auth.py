"""API keys: which routes need one, OpenAI's 401, and the keys' sources.

Test policy: a real frontend on 127.0.0.1:0 in the test's nursery (frontend_fixture),
httpx on loopback.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from frontend.http.auth import ApiKeys, exposure_warning, load_api_keys, watch_keys_file

from frontend_fixture import serve_frontend

CHAT = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_come_from_options_the_environment_and_a_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# rotated 2026-12-01\nk-file-1\n\n  k-file-2  \nk-opt\n")
    assert load_api_keys(["k-opt"], env="k-env-1, k-env-2", file=f) == (
        "k-opt",
        "k-env-1",
        "k-env-2",
        "k-file-1",
        "k-file-2",
    )
    assert load_api_keys() == ()
    for bad in (["a b"], [" "]):
        with pytest.raises(ValueError, match="API key"):
            load_api_keys(bad)
    with pytest.raises(OSError):
        load_api_keys(file=tmp_path / "missing")


def test_only_a_bearer_token_that_is_a_key_is_allowed() -> None:
    keys = ApiKeys(["k1", "longer-key-2"])
    assert keys.allows(b"Bearer k1")
    assert keys.allows(b"bearer longer-key-2")
    for header in (
        None,
        b"",
        b"Bearer",
        b"Bearer ",
        b"Bearer k2",
        b"Basic k1",
        b"k1",
        b"Bearer k1x",
        b"Bearer longer-key-",
    ):
        assert not keys.allows(header), header
    assert not ApiKeys([])


def test_binding_beyond_loopback_without_keys_is_warned_about() -> None:
    warning = exposure_warning("0.0.0.0", ())
    assert warning is not None
    assert "WITHOUT API KEYS" in warning
    assert exposure_warning("127.0.0.1", ()) is None
    assert exposure_warning("::1", ()) is None
    assert exposure_warning("0.0.0.0", ("k",)) is None


async def test_with_keys_every_route_but_the_probes_needs_one() -> None:
    async with (
        serve_frontend(api_keys=("secret-1", "secret-2")) as (fe, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        # Probes, (by default) scrapes and the dashboard's page without its data stay
        # open: a browser loads the page, which asks for the key.
        for path in (
            "/live",
            "/health",
            "/metrics",
            "/dashboard",
            "/dashboard/dashboard.js",
            "/dashboard/dashboard.css",
        ):
            assert (await c.get(path)).status_code == 200, path
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/v1/completions", {"model": "deepseek-v4", "prompt": "hi"}),
            ("POST", "/inference/v1/generate", {"token_ids": [5, 6]}),
            ("GET", "/dashboard/data", None),
            ("GET", "/dashboard/nothing.js", None),
            ("GET", "/debug/workers", None),
            ("GET", "/debug/stalls", None),
            ("GET", "/debug/runtime", None),
            ("GET", "/no/such/path", None),
        ):
            r = await c.request(method, path, json=body)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            error = r.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error",
                "invalid_api_key",
                None,
            )
            assert "didn't provide an API key" in error["message"]
        wrong = await c.post("/v1/chat/completions", json=CHAT, headers=bearer("secret-3"))
        assert wrong.status_code == 401
        assert wrong.json()["error"]["message"] == "Incorrect API key provided."
        ok = await c.post("/v1/chat/completions", json=CHAT, headers=bearer("secret-2"))
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 2
        assert (await c.get("/v1/models", headers=bearer("secret-1"))).status_code == 200
        assert (await c.get("/dashboard/data", headers=bearer("secret-1"))).status_code == 200
        refused = fe.metrics.rejected_requests_total.labels("unauthorized")._value.get()
        assert refused == 11  # the ten routes above and the wrong key


async def test_metrics_can_need_a_key_too() -> None:
    async with (
        serve_frontend(api_keys=("s",), metrics_auth=True) as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers=bearer("s"))).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_without_keys_nothing_needs_one() -> None:
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.get("/debug/workers")).status_code == 200


async def test_a_keys_file_is_followed_and_a_bad_one_keeps_the_keys_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "keys"
    f.write_text("k-old\n")
    keys = ApiKeys([])
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(watch_keys_file, keys, ("k-fixed",), str(f), period=0.01))
        assert keys.allows(b"Bearer k-old")
        assert keys.allows(b"Bearer k-fixed")

        async def until(condition: Callable[[], bool]) -> None:
            with trio.fail_after(5):
                while not condition():
                    await trio.sleep(0.01)

        # A rotation by atomic rename: the new key works, then the old one stops.
        (tmp_path / "next").write_text("k-old\nk-new\n")
        (tmp_path / "next").replace(f)
        await until(lambda: keys.allows(b"Bearer k-new"))
        assert keys.allows(b"Bearer k-old")
        f.write_text("k-new\n")  # an edit in place
        await until(lambda: not keys.allows(b"Bearer k-old"))
        assert keys.allows(b"Bearer k-new")
        assert keys.allows(b"Bearer k-fixed")
        # A bad line, a missing file: the keys in force stay.
        for damage in ("k-new\nbad key\n", None):
            caplog.clear()
            if damage is None:
                f.unlink()
            else:
                f.write_text(damage)
            await until(lambda: "not reloaded" in caplog.text)
            assert keys.allows(b"Bearer k-new")
            assert len(keys) == 2
        # An emptied file revokes its keys; the fixed ones stay.
        f.write_text("# all revoked\n")
        await until(lambda: len(keys) == 1)
        assert keys.allows(b"Bearer k-fixed")
        assert not keys.allows(b"Bearer k-new")
        # Without fixed keys, emptying the file would serve anyone: refused.
        alone = ApiKeys([])
        f.write_text("k-alone\n")
        await nursery.start(partial(watch_keys_file, alone, (), str(f), period=0.01))
        caplog.clear()
        f.write_text("\n")
        await until(lambda: "holds no key" in caplog.text)
        assert alone.allows(b"Bearer k-alone")
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_served_frontend_takes_a_rotated_key_without_a_restart(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k-1\n")
    async with (
        serve_frontend(api_keys_file=str(f)) as (_, url),
        httpx.AsyncClient(base_url=url) as c,
    ):
        assert (await c.get("/v1/models", headers=bearer("k-1"))).status_code == 200
        assert (await c.get("/v1/models", headers=bearer("k-2"))).status_code == 401
        f.write_text("k-2\n")
        with trio.fail_after(10):  # KEYS_FILE_POLL is 2 s
            while (await c.get("/v1/models", headers=bearer("k-2"))).status_code != 200:
                await trio.sleep(0.1)
        assert (await c.get("/v1/models", headers=bearer("k-1"))).status_code == 401
