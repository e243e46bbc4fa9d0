"""Parsing and validating request bodies into the frontend's request model.

Two APIs: OpenAI's chat and completions (:func:`parse_request`, a
:class:`~frontend.request.ParsedRequest`) and the token-in API
(:func:`parse_generate_request`, vLLM's ``/inference/v1/generate``, a
:class:`~frontend.request.TokenRequest`).

Each body is decoded straight into its route's model (:mod:`frontend.http.models`, the
same models ``GET /openapi.json`` publishes) by msgspec: strict about types (``true`` is
not an integer, ``"5"`` is not a number) and lenient about unknown fields, because clients
send many optional ones; an unknown field is skipped without building anything of it.
Then what a model cannot say: fields that depend on each other (``top_logprobs`` needs
``logprobs``; ``best_of`` may only repeat ``n``; prompt logprobs are not streamed), a
known field asking for what headwater cannot do is refused, and the configured limits
(:class:`~frontend.limits.RequestLimits`: ``max_tokens``, messages, tools, prompt
characters, stop strings and ids) are checked, before any template or tokenizer work.

What the parse costs is bounded before it starts: the HTTP layer counts a large body's
JSON values as it arrives (:func:`count_json_values`, ``max_json_values``), and the parse
builds only the models' own values, each list and string bounded, with the cyclic GC off
for its length (its young collections, triggered by the objects the parse makes, cost
more than the parse: 700,000 empty lists took 55 ms to build and 300 ms with the GC on).
A C parser holds the GIL throughout, so a thread would not spare the loop: the bound is
what keeps the loop free. Free-form JSON (tool parameters, object tool-call arguments,
``chat_template_kwargs``) is decoded last, once its text has counted against
``max_prompt_chars`` and its objects and arrays against
:data:`~frontend.limits.MAX_JSON_CONTAINERS`; its depth is then checked
(:data:`~frontend.limits.MAX_JSON_DEPTH`).

Every failure is a 400 naming the offending ``param``: the field's path through objects,
not into arrays (``sampling_params.max_tokens``, ``stream_options.include_usage``;
``messages`` for anything inside a message, whose exact place the message gives, as
``messages[2].content``). A limit's refusal is a
:class:`~frontend.errors.LimitExceeded`, which the HTTP layer counts by the limit's name.
"""

from __future__ import annotations

import gc
import json
import re
from itertools import accumulate
from typing import Any, cast, get_args

import msgspec
import orjson

from frontend.http.errors import ApiError, bad_request
from frontend.http.models import (
    REQUEST_MODELS,
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    TextPart,
    TokenizeRequest,
    ToolMessage,
    _Sampling,
)
from frontend.limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, RequestLimits
from frontend.request import ParsedRequest, SamplingOptions, TokenRequest

#: Where the token-in API keeps its generation options, as its errors name them.
SAMPLING_PARAMS = "sampling_params."
_DEFAULT_LIMITS = RequestLimits()
_NO_PARAMS = SamplingParams()

# msgspec's ValidationError text: "<detail>" or "<detail> - at `<path>`" (or "- at `key`
# in `<path>`" for a mapping's key), the path a JSONPath from `$`; a missing field is
# "Object missing required field `<name>`" at its parent. tests/test_schema.py pins it.
_ERROR = re.compile(r"^(?P<detail>.*?)(?: - at `(?:key` in `)?(?P<path>\$[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """The 400 for a body that does not match its model: its message names the exact
    place, its ``param`` the field (see the module docstring)."""
    match = _ERROR.match(str(exc))
    assert match is not None  # the pattern matches any text
    detail, path = match["detail"], match["path"] or "$"
    if missing := _MISSING.match(detail):
        path += "." + missing["field"]
    where = path.removeprefix("$").removeprefix(".")
    if not where:
        return bad_request("the request body must be a JSON object")
    param = where.split("[", 1)[0] or None
    if missing:
        return bad_request(f"'{where}' is required", param)
    return bad_request(f"Invalid value for '{where}': {detail}", param)


def count_json_values(piece: bytes | bytearray) -> int:
    """An upper bound of the JSON values that *piece* of a body adds: every value but the
    first of an array or object follows a comma, and every array or object opens with a
    bracket (those inside strings are counted too: a bound, not a count)."""
    return piece.count(b",") + piece.count(b"[") + piece.count(b"{")


def decode(body: bytes | bytearray | memoryview | Any, model: type[msgspec.Struct]) -> Any:
    """*body*, a request body's bytes, decoded into *model* (a 400 if malformed or not
    its shape). A body already decoded (a test's dict) is encoded first, as Python's
    ``json`` would send it (``Infinity`` for an infinite float, which JSON has not)."""
    data = body if isinstance(body, bytes | bytearray | memoryview) else json.dumps(body).encode()
    collecting = gc.isenabled()
    gc.disable()  # see the module docstring; nothing else runs meanwhile on this thread
    try:
        return msgspec.json.decode(data, type=model)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Malformed JSON body: {exc}") from None
    except RecursionError:  # msgspec's own bound on nesting, far above the models'
        raise bad_request("the request body is nested too deep") from None
    finally:
        if collecting:
            gc.enable()


class FreeForm:
    """Decodes one request's free-form JSON, each part once its size is known: at most
    :data:`~frontend.limits.MAX_JSON_CONTAINERS` objects and arrays in all (counted on the
    text, before the decode), at most :data:`~frontend.limits.MAX_JSON_DEPTH` deep."""

    def __init__(self) -> None:
        self.containers = 0

    def decode(self, raw: msgspec.Raw, param: str, where: str) -> Any:
        data = bytes(raw)
        self.containers += data.count(b"[") + data.count(b"{")
        if self.containers > MAX_JSON_CONTAINERS:
            raise bad_request(
                f"'{where}': the request's free-form JSON (tool parameters, object "
                f"arguments, chat_template_kwargs) holds more than {MAX_JSON_CONTAINERS} "
                "objects and arrays in all", param,
            )  # fmt: skip
        if _depth(data) > MAX_JSON_DEPTH:
            raise bad_request(f"'{where}' is nested more than {MAX_JSON_DEPTH} deep", param)
        collecting = gc.isenabled()
        gc.disable()  # as for the body (see the module docstring)
        try:
            return orjson.loads(data)  # msgspec checked it is JSON
        finally:
            if collecting:
                gc.enable()


# What keeps the nesting of JSON text: quotes and brackets (a string's brackets are
# inside quotes; its escaped quotes and backslashes are removed first).
_SKELETON = bytes(range(256)).translate(None, b'"[]{}')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def _depth(data: bytes) -> int:
    """How deep the JSON text *data* nests (a scalar: 0), from its text alone: C-speed
    passes over it, then one over its brackets outside strings (bounded by the count of
    objects and arrays)."""
    skeleton = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _SKELETON)
    brackets = b"".join(skeleton.split(b'"')[::2])  # outside strings
    steps = (1 if b == 1 else -1 for b in brackets.translate(_STEP))
    return max(accumulate(steps), default=0)


def _sampling(
    s: _Sampling,
    max_tokens: int | None,
    prefix: str = "",
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingOptions:
    """The generation options both APIs share, from *s*: the OpenAI body itself, or the
    token-in API's ``sampling_params`` (*prefix* names it in errors). The caller reads
    *max_tokens* (OpenAI has two fields for it) and the logprobs (each API has its own
    fields for them)."""
    min_tokens = s.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'{prefix}min_tokens' must not exceed '{prefix}max_tokens'", prefix + "min_tokens"
        )
    n = s.n or 1
    if s.best_of is not None and s.best_of != n:
        # vLLM's V1 engine dropped best_of; honouring it means sampling candidates that
        # are never returned, and ranking them: refused rather than ignored.
        why = ("must not be less than 'n'" if s.best_of < n
               else "above 'n' is not supported: ask for 'n' choices and rank them by logprobs")
        raise bad_request(f"'{prefix}best_of' {why}", prefix + "best_of")
    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=tuple(s.stop_token_ids or ()),
        ignore_eos=bool(s.ignore_eos),
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        seed=s.seed,
        n=n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _max_tokens(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits
                ) -> int | None:  # fmt: skip
    """OpenAI's two fields for it: the smaller one given wins; each within the cap."""
    max_tokens, mct = req.max_tokens, req.max_completion_tokens
    if max_tokens is not None:
        limits.check_max_tokens(max_tokens, "max_tokens")
    if mct is not None:
        limits.check_max_tokens(mct, "max_completion_tokens")
        max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    return max_tokens


ChatText = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], int]


def chat_text(req: ChatCompletionRequest | TokenizeRequest, limits: RequestLimits) -> ChatText:
    """The messages, tools and template kwargs of *req* as the chat template takes them,
    and their characters of text, checked against ``max_prompt_chars`` as they add up:
    contents, reasoning and tool-call arguments (a string's characters, an object's JSON
    text) under ``messages``, then the tools' names, descriptions and parameters (JSON
    text) under ``tools``, then the kwargs' JSON text under ``chat_template_kwargs``.
    Free-form JSON is decoded only once its text has counted."""
    free = FreeForm()
    messages: list[dict[str, Any]] = []
    arguments: list[tuple[dict[str, Any], msgspec.Raw, str]] = []  # decoded once counted
    chars = 0
    for i, m in enumerate(req.messages or ()):  # (a /tokenize body may have none)
        out: dict[str, Any] = {"role": _ROLES[type(m)], "content": _content(m.content)}
        chars += _content_chars(m.content)
        if m.name is not None:
            out["name"] = m.name
        if isinstance(m, ToolMessage) and m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if isinstance(m, AssistantMessage):
            for name in ("reasoning_content", "reasoning"):
                if (text := getattr(m, name)) is not None:
                    out[name] = text
                    chars += len(text)
            if m.tool_calls is not None:
                out["tool_calls"] = calls = []
                for k, call in enumerate(m.tool_calls):
                    function: dict[str, Any] = {"name": call.function.name}
                    calls.append({"function": function} | _set(id=call.id, type=call.type))
                    raw = call.function.arguments
                    if bytes(memoryview(raw)[:1]) == b'"':  # OpenAI's form, a string: no containers
                        function["arguments"] = text = msgspec.json.decode(raw, type=str)
                        chars += len(text)
                    else:  # an object: its JSON text counts, then it is decoded
                        chars += len(raw)
                        where = f"messages[{i}].tool_calls[{k}].function.arguments"
                        arguments.append((function, raw, where))
        messages.append(out)
    limits.check_prompt_chars(chars, "messages")
    for function, raw, where in arguments:
        function["arguments"] = value = free.decode(raw, "messages", where)
        if not isinstance(value, dict):
            raise bad_request(f"'{where}' must be a JSON string or an object", "messages")

    tools = None
    if req.tools is not None:
        limits.check_tools(len(req.tools))
        for tool in req.tools:
            f = tool.function
            chars += len(f.name) + len(f.description or "")
            chars += 0 if f.parameters is msgspec.UNSET else len(f.parameters)
        limits.check_prompt_chars(chars, "tools")
        tools = []
        for j, tool in enumerate(req.tools):
            f = tool.function
            function = {"name": f.name} | _set(description=f.description)
            if f.parameters is not msgspec.UNSET:
                where = f"tools[{j}].function.parameters"
                function["parameters"] = value = free.decode(f.parameters, "tools", where)
                if not isinstance(value, dict | None):
                    raise bad_request(f"'{where}' must be an object", "tools")
            tools.append({"function": function} | _set(type=tool.type))

    kwargs: dict[str, Any] = {}
    if req.chat_template_kwargs is not msgspec.UNSET:
        chars += len(req.chat_template_kwargs)
        param = "chat_template_kwargs"
        limits.check_prompt_chars(chars, param)
        value = free.decode(req.chat_template_kwargs, param, param)
        if not isinstance(value, dict | None):
            raise bad_request(f"'{param}' must be an object", param)
        kwargs = value or {}
    return messages, tools, kwargs, chars


def _tool_choice(req: ChatCompletionRequest | CompletionRequest) -> Any:
    """OpenAI's ``tool_choice`` as the client sent it: a string, or the named function."""
    choice = getattr(req, "tool_choice", None)
    if choice is None or isinstance(choice, str):
        return choice
    return {"function": {"name": choice.function.name}} | _set(type=choice.type)


#: Each message model's role.
_ROLES = {cls: cls.__struct_config__.tag for cls in get_args(ChatMessage)}


def _set(**fields: Any) -> dict[str, Any]:
    """*fields* that are not None."""
    return {name: value for name, value in fields.items() if value is not None}


def _content(content: str | list[TextPart] | None) -> str | list[dict[str, str]] | None:
    if content is None or isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _content_chars(content: str | list[TextPart] | None) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content)


def parse_request(
    body: Any,
    endpoint: str,
    limits: RequestLimits = _DEFAULT_LIMITS,
    *,
    model: type[msgspec.Struct] | None = None,
) -> ParsedRequest:
    """Validate a decoded JSON *body* for ``chat`` or ``completions`` against *model*
    (default: that endpoint's in :data:`~frontend.http.models.REQUEST_MODELS`) and
    *limits*. Raises :class:`ApiError` (400) or
    :class:`~frontend.errors.LimitExceeded`."""
    req = cast(ChatCompletionRequest | CompletionRequest,
               decode(body, model or REQUEST_MODELS[endpoint]))  # fmt: skip
    messages = prompt = tools = None
    kwargs: dict[str, Any] = {}
    text_chars: int | None = None
    logprobs = prompt_logprobs = None
    echo = False
    if isinstance(req, ChatCompletionRequest):
        limits.check_messages(len(req.messages))
        messages, tools, kwargs, text_chars = chat_text(req, limits)
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs:  # vLLM's rule: 0 asks for nothing, so it passes alone
            raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    elif isinstance(req, CompletionRequest):
        prompt = req.prompt
        text = [prompt] if isinstance(prompt, str) else prompt
        text_chars = sum(len(p) for p in text if isinstance(p, str))
        limits.check_prompt_chars(text_chars, "prompt")
        if req.logprobs is True:
            raise bad_request(
                "'logprobs' is an integer on /v1/completions: how many of the most likely "
                "tokens to list at each position (0 to 20)", "logprobs",
            )  # fmt: skip
        if req.top_logprobs is not None:
            raise bad_request(
                "'top_logprobs' is a chat field: on /v1/completions 'logprobs' is the "
                "count of most likely tokens", "top_logprobs",
            )  # fmt: skip
        logprobs = None if req.logprobs is False else req.logprobs
        echo = bool(req.echo)
        if echo and logprobs is not None:  # the prompt's tokens come first, with theirs
            prompt_logprobs = logprobs
    else:
        raise TypeError(f"not an OpenAI request model: {type(req).__name__}")
    stop = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else req.stop
    if stop:
        limits.check_stop(stop)
    limits.check_stop_token_ids(len(req.stop_token_ids or ()), "stop_token_ids")

    return ParsedRequest(
        endpoint=endpoint,
        model=req.model,
        messages=messages,
        prompt=prompt,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        sampling=_sampling(
            req, _max_tokens(req, limits), logprobs=logprobs, prompt_logprobs=prompt_logprobs
        ),
        stop=tuple(stop),
        user=req.user,
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=_tool_choice(req) if tools else None,
        text_chars=text_chars,
        echo=echo,
    )


def parse_generate_request(
    body: Any,
    limits: RequestLimits = _DEFAULT_LIMITS,
    *,
    model: type[msgspec.Struct] | None = None,
) -> TokenRequest:
    """Validate a decoded JSON *body* for the token-in API, shaped as vLLM's
    ``GenerateRequest`` (:class:`~frontend.http.models.GenerateRequest`):
    ``token_ids`` (required), ``sampling_params`` (an object; absent: every default),
    ``request_id``, ``model``, ``stream``, ``stream_options``.

    Of ``sampling_params``, headwater applies ``max_tokens``, ``min_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``stop_token_ids``, ``ignore_eos``, ``n``,
    ``logprobs`` and ``prompt_logprobs`` (not with ``stream``: vLLM's stream has no
    place for them), checks the penalties' ranges, and ignores the fields it does not
    know (``top_k``, ``skip_special_tokens``, ...). It refuses ``best_of`` other than
    ``n``, and stop strings (``stop``, here or at the top level): there is no text to
    match them on. ``null`` or ``[]`` ask for none of these and pass (a client that
    serializes a whole vLLM ``SamplingParams`` sends them).
    """
    req = cast(GenerateRequest, decode(body, model or REQUEST_MODELS["generate"]))
    p = SAMPLING_PARAMS
    params = req.sampling_params or _NO_PARAMS
    if req.stream and params.prompt_logprobs is not None:
        raise bad_request(
            "prompt logprobs are not available when streaming", p + "prompt_logprobs"
        )
    for stop, param in ((params.stop, p + "stop"), (req.stop, "stop")):
        if stop not in (None, []):
            raise bad_request(
                "stop strings do not apply to token ids: use 'sampling_params.stop_token_ids'",
                param,
            )
    limits.check_max_tokens(params.max_tokens, p + "max_tokens")
    limits.check_stop_token_ids(len(params.stop_token_ids or ()), p + "stop_token_ids")

    return TokenRequest(
        token_ids=req.token_ids,
        request_id=req.request_id,
        model=req.model,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        sampling=_sampling(
            params,
            params.max_tokens,
            p,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
        ),
    )
