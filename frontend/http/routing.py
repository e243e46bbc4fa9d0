"""Route matching without garbage: werkzeug's matcher, with a memo of static routes.

Why: Quart matches every request's path with werkzeug's ``StateMachineMatcher``, whose
``match`` defines a recursive inner function that refers to itself through a closure
cell. Each call leaves that function, its cells, a set and a tuple as a reference cycle
(8 objects) that only the cyclic GC frees, so a busy frontend grows its young
generation by 8 objects per request until a collection walks it all at once: 30-50 ms
on the event loop in the default group, measured with
``headwater_frontend_gc_pause_seconds`` (docs/performance.md, "Where the time goes").

Every generation route is static (``/v1/chat/completions``, no converters), so its match
depends on the path and the method alone: :class:`MemoMatcher` answers those from a
bounded memo and leaves everything else (paths with arguments, redirects, misses) to
werkzeug. ``tests/test_hypercorn_seam.py`` fingerprints the werkzeug code this relies on.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Final

from quart import Quart
from werkzeug.routing import Rule
from werkzeug.routing.matcher import StateMachineMatcher

#: Static matches remembered; the routes times the methods they answer is far fewer.
MEMO_SIZE: Final = 256


class MemoMatcher(StateMachineMatcher):
    """``StateMachineMatcher`` that remembers matches of rules with no arguments.

    Only a match that werkzeug would return as ``(rule, {})`` is remembered: a rule with
    no converters, no defaults and no alias. Misses and redirects raise from werkzeug as
    before, every time, and are never remembered, so unknown paths cannot grow the memo;
    it stops growing at :data:`MEMO_SIZE` entries. Adding rules forgets it.
    """

    def __init__(self, merge_slashes: bool) -> None:
        super().__init__(merge_slashes)
        self._memo: dict[tuple[str, str, str, bool], Rule] = {}

    def add(self, rule: Rule) -> None:
        self._memo.clear()
        super().add(rule)

    def update(self) -> None:
        self._memo.clear()
        super().update()

    def match(
        self, domain: str, path: str, method: str, websocket: bool
    ) -> tuple[Rule, MutableMapping[str, Any]]:
        key = (domain, path, method, websocket)
        rule = self._memo.get(key)
        if rule is not None:
            return rule, {}
        rule, values = super().match(domain, path, method, websocket)
        static = not rule.arguments and not rule.defaults and not rule.alias
        if static and len(self._memo) < MEMO_SIZE:
            self._memo[key] = rule
        return rule, values


def use_memo_matcher(app: Quart) -> None:
    """Give ``app``'s URL map a :class:`MemoMatcher` (before its routes are added: the
    rules it holds already are carried over)."""
    url_map = app.url_map
    matcher = MemoMatcher(url_map.merge_slashes)
    for rule in url_map.iter_rules():  # Quart's own static-files rule, if it added one
        matcher.add(rule)
    url_map._matcher = matcher  # werkzeug's Map keeps its matcher here (fingerprinted)
