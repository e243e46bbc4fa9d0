"""Parsing and validating OpenAI request bodies into the frontend's request model.

Validation is strict about types (``true`` is not an integer, ``"5"`` is not a
number) and lenient about unknown fields, because OpenAI clients send many optional
ones. Every failure is an :class:`ApiError` 400 naming the offending ``param``. The
result is a :class:`~frontend.request.ParsedRequest`.
"""

from __future__ import annotations

import math
from typing import Any

from frontend.http.errors import bad_request
from frontend.request import ParsedRequest

MAX_STOP_STRINGS = 16


def _int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer", name)
    if minimum is not None and v < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {v}", name)
    return v


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a number", name)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo:g} and {hi:g}, got {v:g}", name)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" for s in items):
        raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(items)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v
    ):
        raise bad_request("'stop_token_ids' must be a list of non-negative integers",
                          "stop_token_ids")
    return tuple(v)


def parse_request(body: Any, endpoint: str) -> ParsedRequest:
    """Validate a decoded JSON *body* for ``chat`` or ``completions``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")

    messages = prompt = None
    if endpoint == "chat":
        messages = body.get("messages")
        if messages is None:
            raise bad_request("'messages' is required", "messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' is required", "prompt")

    n = _int(body, "n", minimum=1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported by this server", "logprobs")
    if endpoint == "completions" and body.get("echo") not in (None, False):
        raise bad_request("echo is not supported by this server", "echo")
    best_of = _int(body, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")

    max_tokens = _int(body, "max_tokens", minimum=1)
    mct = _int(body, "max_completion_tokens", minimum=1)
    if mct is not None:
        max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    min_tokens = _int(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("'min_tokens' must not exceed 'max_tokens'", "min_tokens")

    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool(stream_options, "include_usage")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    seed = _int(body, "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2.0, 2.0, 0.0)

    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        messages=messages,
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        seed=seed,
        user=user,
        chat_template_kwargs=kwargs,
        tools=tools,
    )
