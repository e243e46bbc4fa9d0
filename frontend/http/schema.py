"""Parsing and validating request bodies into the frontend's request model.

Two APIs: OpenAI's chat and completions (:func:`parse_request`, a
:class:`~frontend.request.ParsedRequest`) and the token-in API
(:func:`parse_generate_request`, vLLM's ``/inference/v1/generate``, a
:class:`~frontend.request.TokenRequest`).

Each body is checked against its route's model (:mod:`frontend.http.models`, the same
models ``GET /openapi.json`` publishes): strict about types (``true`` is not an integer,
``"5"`` is not a number) and lenient about unknown fields, because clients send many
optional ones. Then what a model cannot say: fields that depend on each other
(``top_logprobs`` needs ``logprobs``; ``best_of`` may only repeat ``n``; prompt
logprobs are not streamed), a known field asking for what headwater cannot do is
refused, and the configured limits (:class:`~frontend.limits.RequestLimits`:
``max_tokens``, messages, prompt characters, stop strings) are checked, before any
template or tokenizer work.

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

from frontend.http.errors import ApiError, bad_request
from frontend.http.models import (
    REQUEST_MODELS,
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    _Sampling,
)
from frontend.limits import RequestLimits
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
    messages = prompt = tools = None
    kwargs: dict[str, Any] = {}
    logprobs = prompt_logprobs = None
    echo = False
    if isinstance(req, ChatCompletionRequest):
        limits.check_messages(len(req.messages))
        limits.check_prompt_chars(_message_chars(req.messages), "messages")
        # The client's own dicts: a template may read fields the model does not declare.
        messages = body["messages"]
        tools = body.get("tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs:  # vLLM's rule: 0 asks for nothing, so it passes alone
            raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    elif isinstance(req, CompletionRequest):
        prompt = req.prompt
        text = [prompt] if isinstance(prompt, str) else prompt
        limits.check_prompt_chars(sum(len(p) for p in text if isinstance(p, str)), "prompt")
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
        tool_choice=body.get("tool_choice") if tools else None,
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
    req = cast(GenerateRequest, _convert(body, model or REQUEST_MODELS["generate"]))
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
