"""Parsing and validating request bodies into the frontend's request model.

Two APIs: OpenAI's chat and completions (:func:`parse_request`, a
:class:`~frontend.request.ParsedRequest`) and the token-in API
(:func:`parse_generate_request`, vLLM's ``/inference/v1/generate``, a
:class:`~frontend.request.TokenRequest`). The generation options both share are read
by one function, :func:`_sampling`.

Validation is strict about types (``true`` is not an integer, ``"5"`` is not a
number) and lenient about unknown fields, because clients send many optional ones;
a known field asking for what headwater cannot do (``n`` > 1, logprobs) is refused.
Every failure is an :class:`ApiError` 400 naming the offending ``param``; a field
inside the token-in API's ``sampling_params`` is named ``sampling_params.<field>``.
"""

from __future__ import annotations

import math
from typing import Any

from frontend.http.errors import bad_request
from frontend.request import ParsedRequest, SamplingOptions, TokenRequest

MAX_STOP_STRINGS = 16
#: Where the token-in API keeps its generation options, as its errors name them.
SAMPLING_PARAMS = "sampling_params."


def _int(
    body: dict[str, Any], name: str, *, minimum: int | None = None, prefix: str = ""
) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    param = prefix + name
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{param}' must be an integer", param)
    if minimum is not None and v < minimum:
        raise bad_request(f"'{param}' must be at least {minimum}, got {v}", param)
    return v


def _number(
    body: dict[str, Any], name: str, lo: float, hi: float, default: float, prefix: str = ""
) -> float:
    v = body.get(name)
    if v is None:
        return default
    param = prefix + name
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{param}' must be a number", param)
    if not lo <= v <= hi:
        raise bad_request(f"'{param}' must be between {lo:g} and {hi:g}, got {v:g}", param)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool = False, prefix: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{prefix + name}' must be a boolean", prefix + name)
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


def _token_ids(v: Any) -> bool:
    """*v* is a list of non-negative ints (not bools). One pass in C per check: a
    prompt may hold 100k ids."""
    return isinstance(v, list) and set(map(type, v)) <= {int} and (not v or min(v) >= 0)


def _stop_token_ids(body: dict[str, Any], prefix: str = "") -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not _token_ids(v):
        param = prefix + "stop_token_ids"
        raise bad_request(f"'{param}' must be a list of non-negative integers", param)
    return tuple(v)


def _include_usage(body: dict[str, Any]) -> bool:
    stream_options = body.get("stream_options")
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return _bool(stream_options, "include_usage", prefix="stream_options.")


def _sampling(body: dict[str, Any], max_tokens: int | None, prefix: str = "") -> SamplingOptions:
    """The generation options both APIs share, from *body*: the OpenAI body itself, or
    the token-in API's ``sampling_params`` (*prefix* names it in errors). The caller
    reads *max_tokens* (OpenAI has two fields for it)."""
    min_tokens = _int(body, "min_tokens", minimum=0, prefix=prefix) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'{prefix}min_tokens' must not exceed '{prefix}max_tokens'", prefix + "min_tokens"
        )
    for name in ("presence_penalty", "frequency_penalty"):  # accepted, not applied
        _number(body, name, -2.0, 2.0, 0.0, prefix)
    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=_stop_token_ids(body, prefix),
        ignore_eos=_bool(body, "ignore_eos", prefix=prefix),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0, prefix),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, prefix),
        seed=_int(body, "seed", prefix=prefix),
    )


def _refuse_many(body: dict[str, Any], prefix: str = "") -> None:
    """One completion per request: ``n`` and ``best_of`` above 1 are refused."""
    for name in ("n", "best_of"):
        if _int(body, name, minimum=1, prefix=prefix) not in (None, 1):
            raise bad_request(f"only {name}=1 is supported", prefix + name)


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

    _refuse_many(body)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported by this server", "logprobs")
    if endpoint == "completions" and body.get("echo") not in (None, False):
        raise bad_request("echo is not supported by this server", "echo")

    max_tokens = _int(body, "max_tokens", minimum=1)
    mct = _int(body, "max_completion_tokens", minimum=1)
    if mct is not None:
        max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    sampling = _sampling(body, max_tokens)

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

    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        messages=messages,
        prompt=prompt,
        stream=_bool(body, "stream"),
        include_usage=_include_usage(body),
        sampling=sampling,
        stop=_stop(body),
        user=user,
        chat_template_kwargs=kwargs,
        tools=tools,
    )


def parse_generate_request(body: Any) -> TokenRequest:
    """Validate a decoded JSON *body* for the token-in API, shaped as vLLM's
    ``GenerateRequest``: ``token_ids`` (required), ``sampling_params`` (an object; absent:
    every default), ``request_id``, ``model``, ``stream``, ``stream_options``.

    Of ``sampling_params``, headwater applies ``max_tokens``, ``min_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``stop_token_ids`` and ``ignore_eos``, checks
    the penalties' ranges, and ignores the fields it does not know (``top_k``,
    ``skip_special_tokens``, ...). It refuses ``n`` or ``best_of`` above 1, any
    ``logprobs`` or ``prompt_logprobs``, and stop strings (``stop``, here or at the top
    level): there is no text to match them on. ``null`` or ``[]`` ask for none of
    these and pass (a client that serializes a whole vLLM ``SamplingParams`` sends them).
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty string", "model")
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise bad_request("'request_id' must be a non-empty string", "request_id")

    token_ids = body.get("token_ids")
    if token_ids is None:
        raise bad_request("'token_ids' is required", "token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise bad_request("'token_ids' must be a non-empty list of token ids", "token_ids")
    if not _token_ids(token_ids):
        raise bad_request("'token_ids' must hold non-negative integers", "token_ids")

    params = body.get("sampling_params")
    if params is None:
        params = {}
    elif not isinstance(params, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params")
    p = SAMPLING_PARAMS
    _refuse_many(params, p)
    for name in ("logprobs", "prompt_logprobs"):
        if params.get(name) is not None:
            raise bad_request(f"{name} are not supported by this server", p + name)
    for where, param in ((params, p + "stop"), (body, "stop")):
        if where.get("stop") not in (None, []):
            raise bad_request(
                "stop strings do not apply to token ids: use 'sampling_params.stop_token_ids'",
                param,
            )
    sampling = _sampling(params, _int(params, "max_tokens", minimum=1, prefix=p), p)

    return TokenRequest(
        token_ids=token_ids,
        request_id=request_id,
        model=model,
        stream=_bool(body, "stream"),
        include_usage=_include_usage(body),
        sampling=sampling,
    )
