"""Parsing and validating request bodies into the frontend's request model.

Two APIs: OpenAI's chat and completions (:func:`parse_request`, a
:class:`~frontend.request.ParsedRequest`) and the token-in API
(:func:`parse_generate_request`, vLLM's ``/inference/v1/generate``, a
:class:`~frontend.request.TokenRequest`).

Each body is checked against its route's model (:mod:`frontend.http.models`, the same
models ``GET /openapi.json`` publishes): strict about types (``true`` is not an integer,
``"5"`` is not a number) and lenient about unknown fields, because clients send many
optional ones. Then what a model cannot say: a known field asking for what headwater
cannot do (``n`` > 1 is the model's, logprobs and ``echo`` are here) is refused, the
configured limits (:class:`~frontend.limits.RequestLimits`: ``max_tokens``, messages,
prompt characters, stop strings) are checked, before any template or tokenizer work, and
the features the request asks of an engine are listed in its ``needs``, for the
pipeline to check against the workers' declarations (:mod:`frontend.http.fields`). A
``response_format`` or a forcing ``tool_choice`` becomes the request's
:class:`~frontend.request.Constraint`.

Every failure is a 400 naming the offending ``param``: the field's path through objects,
not into arrays (``sampling_params.max_tokens``, ``stream_options.include_usage``;
``messages`` for anything inside a message, whose exact place the message gives, as
``messages[2].content``). A limit's refusal is a
:class:`~frontend.errors.LimitExceeded`, which the HTTP layer counts by the limit's name.
"""

from __future__ import annotations

import re
from typing import Any, cast

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
    _Sampling,
)
from frontend.limits import RequestLimits
from frontend.request import Constraint, ParsedRequest, SamplingOptions, TokenRequest
from headwater.wire import StructuredKind, StructuredOutput
from headwater.wire.capabilities import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    MIN_P,
    PRESENCE_PENALTY,
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


def _convert(body: Any, model: type[msgspec.Struct]) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return msgspec.convert(body, model)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def _sampling(
    s: _Sampling,
    max_tokens: int | None,
    prefix: str = "",
    structured: StructuredOutput | None = None,
) -> SamplingOptions:
    """The generation options both APIs share, from *s*: the OpenAI body itself, or the
    token-in API's ``sampling_params`` (*prefix* names it in errors). The caller reads
    *max_tokens* (OpenAI has two fields for it) and the token-in API's *structured*."""
    min_tokens = s.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'{prefix}min_tokens' must not exceed '{prefix}max_tokens'", prefix + "min_tokens"
        )
    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=tuple(s.stop_token_ids or ()),
        ignore_eos=bool(s.ignore_eos),
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        seed=s.seed,
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
_FEATURE_FIELDS = {f: f for f in (SEED, TOP_K, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY,
                                  REPETITION_PENALTY, LOGIT_BIAS, STRUCTURED_OUTPUTS)}


def _needs(options: SamplingOptions, prefix: str, constraint: Constraint | None = None
           ) -> tuple[tuple[str, str], ...]:  # fmt: skip
    """The declared features *options* ask for, each with the field asking for it."""
    needs = [(feature, prefix + _FEATURE_FIELDS[feature]) for feature in needed(options)]
    if constraint is not None:
        needs.append((STRUCTURED_OUTPUTS, constraint.param))
    return tuple(needs)


def _constraint(req: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
    """What ``response_format`` and, in chat, ``tool_choice`` ask the answer to be."""
    fmt = req.response_format
    constraint = None
    if isinstance(fmt, JsonObjectFormat) or (
        isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema is None
    ):
        constraint = Constraint("json_object", "response_format")
    elif isinstance(fmt, JsonSchemaFormat):
        constraint = Constraint("json_schema", "response_format", fmt.json_schema.schema)
    if not isinstance(req, ChatCompletionRequest):
        return constraint
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return constraint
    offered = [t.function.name for t in req.tools or ()]
    if not offered:
        raise bad_request("'tool_choice' asks for a tool call, but 'tools' offers none",
                          "tool_choice")  # fmt: skip
    kind = "tool_calls"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in offered:
            raise bad_request(f"'tool_choice' names {choice.function.name!r}, which is not "
                              "among 'tools'", "tool_choice")  # fmt: skip
        kind, offered = "tool_call", [choice.function.name]
    if constraint is not None:
        # vLLM lets the call win and drops the format; refused here instead of ignored.
        raise bad_request("'response_format' cannot constrain an answer that 'tool_choice' "
                          "makes a tool call", "response_format")  # fmt: skip
    return Constraint(kind, "tool_choice", tools=tuple(dict.fromkeys(offered)))


def _structured_outputs(so: StructuredOutputs | None, param: str) -> StructuredOutput | None:
    """The token-in API's ``structured_outputs`` (vLLM's): exactly one constraint."""
    if so is None:
        return None
    given = [(name, value) for name in _STRUCTURED_FIELDS
             if (value := getattr(so, name)) is not None]  # fmt: skip
    if len(given) != 1:
        raise bad_request(f"'{param}' must set exactly one of "
                          f"{', '.join(_STRUCTURED_FIELDS)}", param)  # fmt: skip
    name, value = given[0]
    kind = StructuredKind(name)
    if kind is StructuredKind.JSON_OBJECT:
        if value is not True:
            raise bad_request(f"'{param}.json_object' must be true", param)
        return StructuredOutput(kind)
    if kind is StructuredKind.CHOICE:
        if not value:
            raise bad_request(f"'{param}.choice' must not be empty", param)
        return StructuredOutput(kind, orjson.dumps(value).decode())
    if kind is StructuredKind.JSON and not isinstance(value, str):
        return StructuredOutput(kind, orjson.dumps(value).decode())
    if not value:
        raise bad_request(f"'{param}.{name}' must not be empty", param)
    return StructuredOutput(kind, value)


_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


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


def _message_chars(messages: list[ChatMessage]) -> int:
    """The characters of text in *messages*: contents, reasoning, tool-call arguments."""
    total = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text) for part in content)
        if isinstance(m, AssistantMessage):
            total += len(m.reasoning_content or "")
            for call in m.tool_calls or ():
                if isinstance(call.function.arguments, str):
                    total += len(call.function.arguments)
    return total


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
               _convert(body, model or REQUEST_MODELS[endpoint]))  # fmt: skip
    messages = prompt = tools = effort = suffix = None
    kwargs: dict[str, Any] = {}
    parallel = True
    if isinstance(req, ChatCompletionRequest):
        limits.check_messages(len(req.messages))
        limits.check_prompt_chars(_message_chars(req.messages), "messages")
        # The client's own dicts: a template may read fields the model does not declare.
        messages = body["messages"]
        tools = body.get("tools")
        kwargs = body.get("chat_template_kwargs") or {}
        effort, parallel = req.reasoning_effort, req.parallel_tool_calls is not False
        if req.logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
    elif isinstance(req, CompletionRequest):
        prompt, suffix = req.prompt, req.suffix
        text = [prompt] if isinstance(prompt, str) else prompt
        limits.check_prompt_chars(sum(len(p) for p in text if isinstance(p, str)), "prompt")
        if req.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if req.echo:
            raise bad_request("echo is not supported by this server", "echo")
    else:
        raise TypeError(f"not an OpenAI request model: {type(req).__name__}")
    if req.top_logprobs is not None:
        raise bad_request("top_logprobs are not supported by this server", "top_logprobs")
    stop = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else req.stop
    if stop:
        limits.check_stop(stop)
    sampling = _sampling(req, _max_tokens(req, limits))
    constraint = _constraint(req)

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
        tool_choice=body.get("tool_choice") if tools else None,
        parallel_tool_calls=parallel,
        constraint=constraint,
        reasoning_effort=effort,
        suffix=suffix,
        needs=_needs(sampling, "", constraint),
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
    ``temperature``, ``top_p``, ``seed``, ``stop_token_ids`` and ``ignore_eos``; ``top_k``,
    ``min_p``, the penalties, ``logit_bias`` and ``structured_outputs`` go to engines that
    declare them (``needs``: the pipeline refuses them elsewhere); the fields it does
    not know (``skip_special_tokens``, ...) are ignored. It refuses ``n`` or ``best_of``
    above 1, any ``logprobs`` or ``prompt_logprobs``, and stop strings (``stop``, here or
    at the top level): there is no text to match them on. ``null`` or ``[]`` ask for none of
    these and pass (a client that serializes a whole vLLM ``SamplingParams`` sends them).
    """
    req = cast(GenerateRequest, _convert(body, model or REQUEST_MODELS["generate"]))
    p = SAMPLING_PARAMS
    params = req.sampling_params or _NO_PARAMS
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise bad_request(f"{name} are not supported by this server", p + name)
    for stop, param in ((params.stop, p + "stop"), (req.stop, "stop")):
        if stop not in (None, []):
            raise bad_request(
                "stop strings do not apply to token ids: use 'sampling_params.stop_token_ids'",
                param,
            )
    limits.check_max_tokens(params.max_tokens, p + "max_tokens")
    structured = _structured_outputs(params.structured_outputs, p + "structured_outputs")
    sampling = _sampling(params, params.max_tokens, p, structured)

    return TokenRequest(
        token_ids=req.token_ids,
        request_id=req.request_id,
        model=req.model,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        sampling=sampling,
        needs=_needs(sampling, p),
    )
