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

The features a request asks of an engine are listed in its ``needs``, for the pipeline to
check against the workers' declarations (:mod:`frontend.http.fields`); a
``response_format`` or a forcing ``tool_choice`` becomes its
:class:`~frontend.request.Constraint`.

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
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    SamplingParams,
    StructuredOutputs,
    TextPart,
    TokenizeRequest,
    ToolMessage,
    _Sampling,
)
from frontend.limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_PARTS, RequestLimits
from frontend.request import Constraint, ParsedRequest, SamplingOptions, TokenRequest
from headwater.wire import StructuredKind, StructuredOutput
from headwater.wire.capabilities import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    LOGPROBS,
    MIN_P,
    PRESENCE_PENALTY,
    PROMPT_LOGPROBS,
    REPETITION_PENALTY,
    SEED,
    STRUCTURED_OUTPUTS,
    TOP_K,
    needed,
)

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
                "objects and arrays in all",
                param,
            )
        if _depth(data) > MAX_JSON_DEPTH:
            raise bad_request(f"'{where}' is nested more than {MAX_JSON_DEPTH} deep", param)
        collecting = gc.isenabled()
        gc.disable()  # as for the body (see the module docstring)
        try:
            value = orjson.loads(data)  # msgspec checked it is JSON
        finally:
            if collecting:
                gc.enable()
        if isinstance(value, dict) and len(value) > MAX_PARTS:  # the schema's maxProperties
            raise bad_request(f"'{where}' has more than {MAX_PARTS} properties", param)
        return value


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
    structured: StructuredOutput | None = None,
) -> SamplingOptions:
    """The generation options both APIs share, from *s*: the OpenAI body itself, or the
    token-in API's ``sampling_params`` (*prefix* names it in errors). The caller reads
    *max_tokens* (OpenAI has two fields for it), the logprobs (each API has its own
    fields for them) and the token-in API's *structured*."""
    min_tokens = s.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'{prefix}min_tokens' must not exceed '{prefix}max_tokens'", prefix + "min_tokens"
        )
    n = s.n or 1
    if s.best_of is not None and s.best_of != n:
        # vLLM's V1 engine dropped best_of; honouring it means sampling candidates that
        # are never returned, and ranking them: refused rather than ignored.
        why = (
            "must not be less than 'n'"
            if s.best_of < n
            else "above 'n' is not supported: ask for 'n' choices and rank them by logprobs"
        )
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
        top_k=max(0, s.top_k or 0),  # vLLM's -1 and 0 both mean every token
        min_p=s.min_p or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        logit_bias=_logit_bias(s.logit_bias, prefix + "logit_bias"),
        structured=structured,
    )


def _logit_bias(bias: dict[str, float] | None, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) as (id, bias) pairs, by id."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not key.isdecimal() or len(key) > 10:
            raise bad_request(f"'{param}' keys must be token ids, got {key[:20]!r}", param)
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


#: Where each declared feature is asked for, by the field's name (the token-in API
#: prefixes ``sampling_params.``); an OpenAI request's structured output is asked for by
#: the field its Constraint names.
_FEATURE_FIELDS = {
    f: f
    for f in (
        SEED,
        TOP_K,
        MIN_P,
        PRESENCE_PENALTY,
        FREQUENCY_PENALTY,
        REPETITION_PENALTY,
        LOGIT_BIAS,
        STRUCTURED_OUTPUTS,
        LOGPROBS,
        PROMPT_LOGPROBS,
    )
}


def feature_needs(
    options: SamplingOptions, prefix: str, constraint: Constraint | None = None
) -> tuple[tuple[str, str], ...]:
    """The declared features *options* ask for, each with the field asking for it."""
    needs = [(feature, prefix + _FEATURE_FIELDS[feature]) for feature in needed(options)]
    if constraint is not None:
        needs.append((STRUCTURED_OUTPUTS, constraint.param))
    return tuple(needs)


def _constraint(
    req: ChatCompletionRequest | CompletionRequest,
    free: FreeForm,
    limits: RequestLimits,
    chars: int,
) -> tuple[Constraint | None, int]:
    """What ``response_format`` and, in chat, ``tool_choice`` ask the answer to be; and
    *chars*, the request's text so far, with a JSON schema's text counted in (checked
    against ``max_prompt_chars`` before it is decoded, as the tools' parameters are)."""
    fmt = req.response_format
    constraint = None
    param = "response_format"
    if isinstance(fmt, JsonObjectFormat) or (
        isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema is msgspec.UNSET
    ):
        constraint = Constraint("json_object", param)
    elif isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        raw = cast(msgspec.Raw, spec.schema)
        chars += len(raw) + len(spec.description or "")
        limits.check_prompt_chars(chars, param)
        schema = free.decode(raw, param, "response_format.json_schema.schema")
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be an object", param)
        constraint = Constraint("json_schema", param, schema)
    if not isinstance(req, ChatCompletionRequest):
        return constraint, chars
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return constraint, chars
    offered = [t.function.name for t in req.tools or ()]
    if not offered:
        raise bad_request(
            "'tool_choice' asks for a tool call, but 'tools' offers none", "tool_choice"
        )
    kind = "tool_calls"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in offered:
            raise bad_request(
                f"'tool_choice' names {choice.function.name!r}, which is not among 'tools'",
                "tool_choice",
            )
        kind, offered = "tool_call", [choice.function.name]
    if constraint is not None:
        # vLLM lets the call win and drops the format; refused here instead of ignored.
        raise bad_request(
            "'response_format' cannot constrain an answer that 'tool_choice' makes a tool call",
            "response_format",
        )
    return Constraint(kind, "tool_choice", tools=tuple(dict.fromkeys(offered))), chars


def _structured_outputs(
    so: StructuredOutputs | None, param: str, limits: RequestLimits
) -> StructuredOutput | None:
    """The token-in API's ``structured_outputs`` (vLLM's): exactly one constraint, its
    text (a schema, a regex, a grammar, a tag) counted against ``max_prompt_chars``."""
    if so is None:
        return None
    given = [
        (name, value)
        for name in _STRUCTURED_FIELDS
        if (value := getattr(so, name)) not in (None, msgspec.UNSET)
    ]
    if len(given) != 1:
        raise bad_request(
            f"'{param}' must set exactly one of {', '.join(_STRUCTURED_FIELDS)}", param
        )
    name, value = given[0]
    kind = StructuredKind(name)
    if kind is StructuredKind.JSON_OBJECT:
        if value is not True:
            raise bad_request(f"'{param}.json_object' must be true", param)
        return StructuredOutput(kind)
    if kind is StructuredKind.CHOICE:
        if not value:
            raise bad_request(f"'{param}.choice' must not be empty", param)
        text = orjson.dumps(value).decode()
    elif kind is StructuredKind.JSON:  # a schema object, or its JSON text
        limits.check_prompt_chars(len(value), param)
        schema = FreeForm().decode(value, param, param + ".json")
        if not isinstance(schema, dict | str):
            raise bad_request(f"'{param}.json' must be a schema object or its text", param)
        text = schema if isinstance(schema, str) else orjson.dumps(schema).decode()
    else:
        text = value
    if not text:
        raise bad_request(f"'{param}.{name}' must not be empty", param)
    limits.check_prompt_chars(len(text), param)
    return StructuredOutput(kind, text)


_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _max_tokens(
    req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits
) -> int | None:
    """OpenAI's two fields for it: the smaller one given wins; each within the cap."""
    max_tokens, mct = req.max_tokens, req.max_completion_tokens
    if max_tokens is not None:
        limits.check_max_tokens(max_tokens, "max_tokens")
    if mct is not None:
        limits.check_max_tokens(mct, "max_completion_tokens")
        max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    return max_tokens


ChatText = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], int]


def chat_text(
    req: ChatCompletionRequest | TokenizeRequest,
    limits: RequestLimits,
    free: FreeForm | None = None,
) -> ChatText:
    """The messages, tools and template kwargs of *req* as the chat template takes them,
    and their characters of text, checked against ``max_prompt_chars`` as they add up:
    contents, reasoning and tool-call arguments (a string's characters, an object's JSON
    text) under ``messages``, then the tools' names, descriptions and parameters (JSON
    text) under ``tools``, then the kwargs' JSON text under ``chat_template_kwargs``.
    Free-form JSON is decoded only once its text has counted, by *free* (the request's,
    which counts its objects and arrays in all)."""
    free = free or FreeForm()
    messages: list[dict[str, Any]] = []
    arguments: list[tuple[dict[str, Any], msgspec.Raw, str]] = []  # decoded once counted
    chars = 0
    for i, m in enumerate(req.messages or ()):  # (UNSET: a /tokenize body's prompt)
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
    req = cast(
        ChatCompletionRequest | CompletionRequest, decode(body, model or REQUEST_MODELS[endpoint])
    )
    messages = prompt = tools = effort = suffix = None
    kwargs: dict[str, Any] = {}
    text_chars: int | None = None
    logprobs = prompt_logprobs = None
    echo = False
    parallel = True
    free = FreeForm()
    if isinstance(req, ChatCompletionRequest):
        limits.check_messages(len(req.messages))
        messages, tools, kwargs, text_chars = chat_text(req, limits, free)
        effort, parallel = req.reasoning_effort, req.parallel_tool_calls is not False
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs:  # vLLM's rule: 0 asks for nothing, so it passes alone
            raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    elif isinstance(req, CompletionRequest):
        prompt, suffix = req.prompt, req.suffix
        text = [prompt] if isinstance(prompt, str) else prompt
        text_chars = sum(len(p) for p in text if isinstance(p, str))
        limits.check_prompt_chars(text_chars, "prompt")
        if suffix is not None:  # text of the prompt too (fill in the middle)
            text_chars += len(suffix)
            limits.check_prompt_chars(text_chars, "suffix")
        if req.logprobs is True:
            raise bad_request(
                "'logprobs' is an integer on /v1/completions: how many of the most likely "
                "tokens to list at each position (0 to 20)",
                "logprobs",
            )
        if req.top_logprobs is not None:
            raise bad_request(
                "'top_logprobs' is a chat field: on /v1/completions 'logprobs' is the "
                "count of most likely tokens",
                "top_logprobs",
            )
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
    sampling = _sampling(
        req, _max_tokens(req, limits), logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    constraint, text_chars = _constraint(req, free, limits, text_chars or 0)

    return ParsedRequest(
        endpoint=endpoint,
        model=req.model,
        messages=messages,
        prompt=prompt,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        sampling=sampling,
        stop=tuple(stop),
        user=req.user,
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=_tool_choice(req) if tools else None,
        text_chars=text_chars,
        echo=echo,
        parallel_tool_calls=parallel,
        constraint=constraint,
        reasoning_effort=effort,
        suffix=suffix,
        # A completion's prompt logprobs are asked for by echo (with logprobs).
        needs=tuple(
            (f, "echo" if f == PROMPT_LOGPROBS else p)
            for f, p in feature_needs(sampling, "", constraint)
        ),
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
    place for them); ``top_k``, ``min_p``, the penalties, ``logit_bias`` and
    ``structured_outputs`` go to engines that declare them (``needs``: the pipeline
    refuses them elsewhere, as it does logprobs on an engine without them); the fields it
    does not know (``skip_special_tokens``, ...) are ignored. It refuses ``best_of``
    other than ``n``, and stop strings (``stop``, here or at the top level): there is no
    text to match them on. ``null`` or ``[]`` ask for none of these and pass (a client
    that serializes a whole vLLM ``SamplingParams`` sends them).
    """
    req = cast(GenerateRequest, decode(body, model or REQUEST_MODELS["generate"]))
    p = SAMPLING_PARAMS
    params = req.sampling_params or _NO_PARAMS
    if req.stream and params.prompt_logprobs is not None:
        raise bad_request("prompt logprobs are not available when streaming", p + "prompt_logprobs")
    for stop, param in ((params.stop, p + "stop"), (req.stop, "stop")):
        if stop not in (None, []):
            raise bad_request(
                "stop strings do not apply to token ids: use 'sampling_params.stop_token_ids'",
                param,
            )
    limits.check_max_tokens(params.max_tokens, p + "max_tokens")
    limits.check_stop_token_ids(len(params.stop_token_ids or ()), p + "stop_token_ids")
    structured = _structured_outputs(params.structured_outputs, p + "structured_outputs", limits)
    sampling = _sampling(
        params,
        params.max_tokens,
        p,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        structured=structured,
    )

    return TokenRequest(
        token_ids=req.token_ids,
        request_id=req.request_id,
        model=req.model,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        sampling=sampling,
        needs=feature_needs(sampling, p),
    )
