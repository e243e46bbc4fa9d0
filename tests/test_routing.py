"""Route matching (frontend/http/routing.py): werkzeug's answers, without its garbage."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, RequestRedirect
from werkzeug.routing.matcher import StateMachineMatcher

from frontend.config import FrontendConfig
from frontend.http.routing import MEMO_SIZE, MemoMatcher, use_memo_matcher
from frontend.server import Frontend

from frontend_fixture import shared_tokenizer


def real_map() -> Map:
    """The URL map of the frontend's real app (every route it serves)."""
    frontend = Frontend(FrontendConfig(port=0), tokenizer=shared_tokenizer())
    return frontend.app.url_map


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def outcome(url_map: Map, path: str, method: str) -> Any:
    """What routing ``method path`` gives: (endpoint, arguments), or the error raised."""
    adapter = url_map.bind("localhost")
    try:
        return adapter.match(path, method=method)
    except RequestRedirect as redirect:
        return ("redirect", redirect.new_url)
    except HTTPException as exc:
        return (type(exc).__name__, exc.code)


REQUESTS = [
    ("/v1/chat/completions", "POST"),
    ("/v1/chat/completions", "GET"),  # 405
    ("/v1/completions", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/deepseek-v4", "GET"),  # a route with an argument, if the app has one
    ("/v1//chat/completions", "POST"),  # merge_slashes: a redirect
    ("/v1/chat/completions/", "POST"),
    ("/health", "GET"),
    ("/metrics", "GET"),
    ("/nope", "GET"),  # 404
    ("/inference/v1/generate", "POST"),
]


def test_the_real_app_uses_the_memo_and_routes_as_werkzeug_does() -> None:
    url_map = real_map()
    assert isinstance(url_map._matcher, MemoMatcher)
    plain = real_map()
    plain_matcher = StateMachineMatcher(plain.merge_slashes)
    for rule in plain.iter_rules():
        plain_matcher.add(rule)
    plain._matcher = plain_matcher
    plain._remap = True
    for path, method in REQUESTS * 2:  # the second pass answers from the memo
        assert outcome(url_map, path, method) == outcome(plain, path, method), (path, method)


@pytest.mark.slow
def test_matching_a_generation_route_leaves_no_cycle_for_the_gc(no_automatic_gc: None) -> None:
    url_map = real_map()
    adapter = url_map.bind("localhost")
    adapter.match("/v1/chat/completions", method="POST")  # the first one fills the memo
    gc.collect()
    for _ in range(1000):
        adapter.match("/v1/chat/completions", method="POST")
    # werkzeug's own matcher leaves 8 objects in a cycle per call: 8,000 here.
    assert gc.collect() < 10


@pytest.mark.slow
def test_werkzeugs_matcher_does_leave_them(no_automatic_gc: None) -> None:
    """The reason for the memo: if werkzeug stops making cycles, drop frontend/http/routing."""
    url_map = real_map()
    plain = StateMachineMatcher(url_map.merge_slashes)
    for rule in url_map.iter_rules():
        plain.add(rule)
    plain.update()
    gc.collect()
    for _ in range(100):
        plain.match("", "/v1/chat/completions", "POST", False)
    assert gc.collect() >= 100


def test_only_static_matches_are_remembered_and_the_memo_is_bounded() -> None:
    app = QuartTrio("bounded")
    use_memo_matcher(app)
    for i in range(MEMO_SIZE + 10):
        app.add_url_rule(f"/static{i}", f"s{i}", lambda: "", methods=["GET"])
    app.add_url_rule("/item/<int:n>", "item", lambda n: "", methods=["GET"])
    matcher = app.url_map._matcher
    assert isinstance(matcher, MemoMatcher)
    adapter = app.url_map.bind("localhost")
    assert adapter.match("/item/3") == ("item", {"n": 3})
    assert adapter.match("/item/4") == ("item", {"n": 4})
    for path in ("/missing", "/item/x"):
        with pytest.raises(HTTPException):
            adapter.match(path)
    assert matcher._memo == {}
    for i in range(MEMO_SIZE + 10):
        assert adapter.match(f"/static{i}") == (f"s{i}", {})
    assert len(matcher._memo) == MEMO_SIZE
    # Adding a rule forgets what was remembered (a new rule may change a match).
    app.add_url_rule("/late", "late", lambda: "", methods=["GET"])
    assert matcher._memo == {}
    assert adapter.match("/static0") == ("s0", {})
