"""The scripted engine's script: which answer goes with which prompt.

A script is a JSON Lines file, one rule per line::

    {"prompt_contains": "<tool_result>", "text": "It is 22 degrees in Paris."}
    {"prompt_contains": "weather", "text": "<｜DSML｜tool_calls>..."}
    {"default": true, "text": "I only know about the weather."}

The first rule whose ``prompt_contains`` occurs in the prompt's text answers; the
``default`` rule (at most one, anywhere in the file) answers when none does; without
one, the prompt has no answer. Blank lines are skipped.

:func:`parse_script` checks the whole file up front and raises :class:`ScriptError`
with one line naming the file, the line and the problem: not JSON, not an object, an
unknown key (a typo would otherwise never match), no ``text``, neither or both of
``prompt_contains`` and ``default``, a second default, and a rule that can never
answer because an earlier rule's ``prompt_contains`` occurs in its own.

Pure: no I/O but :func:`load_script`'s read of the file, no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_KEYS = frozenset({"prompt_contains", "default", "text"})


class ScriptError(ValueError):
    """The script cannot be used; the message is one line naming the file and the line."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One line of a script: the answer ``text``, given when ``prompt_contains`` occurs
    in the prompt (None: the default rule). ``line`` is its line number in the file."""

    text: str
    prompt_contains: str | None
    line: int

    @property
    def is_default(self) -> bool:
        return self.prompt_contains is None


@dataclass(frozen=True, slots=True)
class Script:
    """A parsed script: its rules in file order (the default one among them), and the
    file it came from, as named in messages."""

    source: str
    rules: tuple[Rule, ...]

    @property
    def default(self) -> Rule | None:
        return next((r for r in self.rules if r.is_default), None)

    def match(self, prompt: str) -> Rule | None:
        """The rule that answers *prompt*: the first whose ``prompt_contains`` occurs in
        it, else the default rule, else None. Cost: one substring search per rule."""
        for rule in self.rules:
            if rule.prompt_contains is not None and rule.prompt_contains in prompt:
                return rule
        return self.default


def load_script(path: str | Path) -> Script:
    """Read and parse the script at *path*. Raises ScriptError (unreadable, or bad)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ScriptError(f"script {path}: cannot read it: {exc.strerror or exc}") from exc
    return parse_script(data, str(path))


def parse_script(data: bytes, source: str) -> Script:
    """Parse a script's bytes; *source* names it in messages. Raises ScriptError."""
    rules: list[Rule] = []
    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        rule = _parse_line(raw, number, source)
        _check_reachable(rule, rules, source)
        rules.append(rule)
    if not rules:
        raise ScriptError(f"script {source}: no rules (one JSON object per line)")
    return Script(source, tuple(rules))


def _parse_line(raw: bytes, number: int, source: str) -> Rule:
    where = f"script {source}, line {number}"
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ScriptError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ScriptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ScriptError(
            f"{where}: unknown key {unknown[0]!r} (keys: prompt_contains or default, and text)"
        )
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        raise ScriptError(f'{where}: needs "text", a non-empty string (the answer)')
    has_default = "default" in obj
    if has_default and obj["default"] is not True:
        raise ScriptError(f'{where}: "default" can only be true')
    needle = obj.get("prompt_contains")
    if has_default == ("prompt_contains" in obj):
        raise ScriptError(f'{where}: needs either "prompt_contains" or "default": true')
    if not has_default and (not isinstance(needle, str) or not needle):
        raise ScriptError(f'{where}: "prompt_contains" must be a non-empty string')
    return Rule(text=text, prompt_contains=needle, line=number)


def _check_reachable(rule: Rule, earlier: list[Rule], source: str) -> None:
    """Refuse a rule that can never answer: a second default, or one that every prompt
    it matches is matched by an earlier rule first."""
    where = f"script {source}, line {rule.line}"
    for before in earlier:
        if rule.is_default and before.is_default:
            raise ScriptError(
                f"{where}: a second default rule (the first is on line {before.line})"
            )
        if (
            rule.prompt_contains is not None
            and before.prompt_contains is not None
            and before.prompt_contains in rule.prompt_contains
        ):
            raise ScriptError(
                f"{where}: never answers: line {before.line}'s prompt_contains "
                f"{before.prompt_contains!r} occurs in its own, and comes first"
            )
