"""The soak's traffic: a seeded mix of short, long, streaming, cancelled, reset and invalid
requests, each a :class:`~scripts.soak.client.RequestPlan`.

Prompts come from :mod:`scripts.bench.prompts` (a real DeepSeek-V4 token count per
text), built once per run; every request then gets a distinct opening
(``Soak request <n>:``), so no cache on the way (the prefix cache of the workers, a
tokenizer's cache) ever sees the same text twice, and a cache that keeps what it sees
grows through the run as it would in production.

Kinds and their default weights (:data:`DEFAULT_WEIGHTS`):

- ``short_unary`` / ``short_stream``: a ~100-token chat turn (a quarter of them as
  ``/v1/completions``), read to the end;
- ``long_unary`` / ``long_stream``: one of the long sizes (4k, 12k, 40k tokens);
- ``cancel``: a stream the client closes after 1-6 events (short or long prompt);
- ``reset_stream``: the same, but the connection is reset (RST), not closed;
- ``reset_wait``: reset 0.05-1.5 s after the request was sent, mostly during a long
  prompt's tokenization or prefill;
- ``reset_upload``: reset half-way through uploading a long prompt's body;
- ``invalid``: a body or request the server must refuse with a 4xx
  (:data:`INVALID`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from scripts.bench import prompts
from scripts.soak.client import How, RequestPlan

MODEL = prompts.DEFAULT_MODEL
CHAT = prompts.ENDPOINT_PATHS["chat"]
COMPLETIONS = prompts.ENDPOINT_PATHS["completions"]

DEFAULT_WEIGHTS: Mapping[str, float] = {
    "short_unary": 22,
    "short_stream": 22,
    "long_unary": 7,
    "long_stream": 7,
    "cancel": 12,
    "reset_stream": 8,
    "reset_wait": 6,
    "reset_upload": 4,
    "invalid": 12,
}
DEFAULT_LONG_TOKENS = (4_000, 12_000, 40_000)


@dataclass(frozen=True, slots=True)
class Invalid:
    """A request the server must refuse with *status* (a 4xx and an OpenAI error body)."""

    name: str
    status: int
    body: bytes
    method: str = "POST"
    path: str = CHAT
    content_type: str = "application/json"


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


_HELLO = [{"role": "user", "content": "hello"}]

INVALID: Sequence[Invalid] = (
    Invalid("malformed_json", 400, b'{"model": "deepseek-v4", "messages": [{"role": '),
    Invalid("not_an_object", 400, b"[1, 2, 3]"),
    Invalid("no_messages", 400, _json({"model": MODEL})),
    Invalid("empty_messages", 400, _json({"model": MODEL, "messages": []})),
    Invalid(
        "bad_role", 400, _json({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]})
    ),
    Invalid(
        "negative_max_tokens", 400, _json({"model": MODEL, "messages": _HELLO, "max_tokens": -1})
    ),
    Invalid(
        "string_temperature", 400, _json({"model": MODEL, "messages": _HELLO, "temperature": "hot"})
    ),
    Invalid("unknown_model", 404, _json({"model": "no-such-model", "messages": _HELLO})),
    Invalid("completion_without_prompt", 400, _json({"model": MODEL}), path=COMPLETIONS),
    Invalid("text_plain", 415, b"hello", content_type="text/plain"),
    Invalid("get_on_post_route", 405, b"", method="GET"),
    Invalid("unknown_path", 404, _json({"model": MODEL}), path="/v1/no-such-route"),
)


@dataclass(frozen=True, slots=True)
class MixSettings:
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    long_tokens: tuple[int, ...] = DEFAULT_LONG_TOKENS
    #: Distinct texts built per long size and for short prompts (each request then gets
    #: its own opening on top).
    prompts_per_size: int = 4
    short_prompts: int = 32
    seed: int = 20261205


@dataclass(frozen=True, slots=True)
class PromptPool:
    short: tuple[prompts.Prompt, ...]
    long: Mapping[int, tuple[prompts.Prompt, ...]]


def build_prompts(settings: MixSettings) -> PromptPool:
    """Synthesise the prompts (blocking: a second or two per 40k-token text set)."""
    short = prompts.make_prompts("short", settings.short_prompts, seed=settings.seed)
    long = {
        size: prompts.make_prompts(
            "long", settings.prompts_per_size, tokens=size, seed=settings.seed + size
        ).prompts
        for size in settings.long_tokens
    }
    return PromptPool(short.prompts, long)


class Mix:
    """Draws the next request of the mix; deterministic for a given seed and pool."""

    def __init__(self, pool: PromptPool, settings: MixSettings) -> None:
        unknown = set(settings.weights) - set(DEFAULT_WEIGHTS)
        if unknown:
            known = ", ".join(DEFAULT_WEIGHTS)
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {known}")
        self._kinds = [k for k, w in settings.weights.items() if w > 0]
        if not self._kinds:
            raise ValueError("every weight is zero")
        self._weights = [settings.weights[k] for k in self._kinds]
        self._pool = pool
        self._rng = random.Random(settings.seed)
        self._serial = 0

    def next(self) -> RequestPlan:
        rng = self._rng
        kind = rng.choices(self._kinds, self._weights)[0]
        self._serial += 1
        if kind == "invalid":
            bad = rng.choice(INVALID)
            return RequestPlan(
                f"invalid:{bad.name}",
                bad.method,
                bad.path,
                bad.body,
                stream=False,
                expect="client_error",
                content_type=bad.content_type,
            )
        if kind in ("short_unary", "short_stream"):
            return self._plan(
                kind, long=False, stream=kind == "short_stream", max_tokens=rng.randint(8, 64)
            )
        if kind in ("long_unary", "long_stream"):
            return self._plan(
                kind, long=True, stream=kind == "long_stream", max_tokens=rng.randint(4, 32)
            )
        if kind in ("cancel", "reset_stream"):
            how: How = "cancel" if kind == "cancel" else "reset_events"
            return self._plan(
                kind,
                long=rng.random() < 1 / 3,
                stream=True,
                max_tokens=256,
                how=how,
                after_events=rng.randint(1, 6),
            )
        if kind == "reset_wait":
            return self._plan(
                kind,
                long=rng.random() < 0.8,
                stream=rng.random() < 0.5,
                max_tokens=64,
                how="reset_wait",
                after_s=round(rng.uniform(0.05, 1.5), 3),
            )
        assert kind == "reset_upload"
        return self._plan(
            kind,
            long=True,
            stream=False,
            max_tokens=16,
            how="reset_upload",
            upload_fraction=round(rng.uniform(0.1, 0.9), 3),
        )

    def _plan(
        self,
        kind: str,
        *,
        long: bool,
        stream: bool,
        max_tokens: int,
        how: How = "complete",
        after_events: int = 0,
        after_s: float = 0.0,
        upload_fraction: float = 0.5,
    ) -> RequestPlan:
        rng = self._rng
        if long:
            size = rng.choice(sorted(self._pool.long))
            prompt = rng.choice(self._pool.long[size])
            kind = f"{kind}:{size // 1000}k"
        else:
            prompt = rng.choice(self._pool.short)
        unique = prompts.Prompt(f"Soak request {self._serial}: {prompt.user}", prompt.user_tokens)
        completions = not long and rng.random() < 0.25
        make = prompts.completion_body if completions else prompts.chat_body
        body = orjson.dumps(make(unique, stream=stream, max_tokens=max_tokens, model=MODEL))
        return RequestPlan(
            kind,
            "POST",
            COMPLETIONS if completions else CHAT,
            body,
            stream=stream,
            how=how,
            after_events=after_events,
            after_s=after_s,
            upload_fraction=upload_fraction,
        )


def kind_family(kind: str) -> str:
    """``long_stream:40k`` → ``long_stream``; ``invalid:text_plain`` → ``invalid``."""
    return kind.split(":", 1)[0]
