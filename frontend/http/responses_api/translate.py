"""A Responses request, as the chat pipeline's request.

The conversation, in order (docs/api.md, "OpenAI Responses", has the whole table):

1. ``instructions``, as a system message (never carried over from a previous
   response, as OpenAI's are not);
2. the conversation of ``previous_response_id`` (:class:`~.store.ResponseStore`), if
   given: every earlier turn's input and output;
3. ``input``: a string is a user message; items are messages (``input_text`` and
   ``output_text`` parts), ``function_call_output`` (a tool message for its
   ``call_id``), and an earlier answer's ``reasoning``, ``message`` and
   ``function_call`` items, which together are one assistant turn (its
   ``reasoning_content``, ``content`` and ``tool_calls``).

A reasoning item's text is its ``content``, or its ``encrypted_content`` when headwater
made one (``include: ["reasoning.encrypted_content"]``, for clients that do not store
responses: the reasoning's text, base64-encoded, marked as headwater's; opaque to the
client, not a secret). ``reasoning.effort`` picks DeepSeek-V4's mode: ``none`` its chat
mode, ``minimal`` to ``high`` its thinking mode, ``xhigh`` and ``max`` thinking at its
maximum effort (the template's ``reasoning_effort``). ``parallel_tool_calls: false`` and
``max_tool_calls`` bound the calls an answer keeps.

A ``tool_choice`` that forces a call (``required``, a named function) and ``text.format``
``json_object``/``json_schema`` hold the answer by constrained decoding, as their chat
equivalents do, on engines that declare it (checked before dispatch, as a chat request's
``needs``). Refused with a 400 naming the field: images and files, ``item_reference``,
``truncation: auto``, ``background``, logprobs. No I/O.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import msgspec

from frontend.http.errors import ApiError, bad_request
from frontend.http.responses_api.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContent,
    InputItem,
    InputText,
    ItemHead,
    ItemReference,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    ResponsesWire,
    TextFormat,
    ToolChoiceFunction,
)
from frontend.http.responses_api.store import ChainBroken, ResponseStore
from frontend.http.schema import FreeForm, feature_needs, validation_error
from frontend.limits import RequestLimits
from frontend.request import Constraint, ParsedRequest, SamplingOptions

#: What marks an ``encrypted_content`` as headwater's reasoning text.
ENCRYPTED_PREFIX = "hw1:"
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
#: ``include`` values with nothing to include here (their items are never produced),
#: and the one honoured; any other is refused.
INCLUDES = frozenset(
    {
        ENCRYPTED_INCLUDE,
        "web_search_call.action.sources",
        "web_search_call.results",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
_THINKING = {"none": False}
_MAX_EFFORT = {"xhigh": "max", "max": "max"}


def encrypt(reasoning: str) -> str:
    """An answer's reasoning as its ``encrypted_content`` (see the module docstring)."""
    return ENCRYPTED_PREFIX + base64.b64encode(reasoning.encode()).decode()


def decrypt(content: str, where: str) -> str:
    if content.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(content[len(ENCRYPTED_PREFIX) :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    raise bad_request(
        f"{where}.encrypted_content was not made by this server: send the "
        "reasoning's content instead",
        "input",
    )


def decode_items(raws: list[msgspec.Raw]) -> list[InputItem]:
    """The input items, each decoded from its text on its own: an item with no
    ``type`` but a ``role`` is a message (OpenAI's "easy" input message), any other by
    its ``type``. Raises ApiError (400) naming the item's place."""
    items: list[InputItem] = []
    for i, raw in enumerate(raws):
        try:
            head = msgspec.json.decode(raw, type=ItemHead)
            kind: Any = MessageItem if head.type is None and head.role is not None else InputItem
            items.append(msgspec.json.decode(raw, type=kind))
        except msgspec.ValidationError as exc:
            raise validation_error(_within(exc, f"input[{i}]")) from None
    return items


def _within(exc: msgspec.ValidationError, where: str) -> msgspec.ValidationError:
    """*exc*, an error of one item decoded on its own, with its path from the body's."""
    text = str(exc)
    if " - at `$" in text:
        return msgspec.ValidationError(text.replace(" - at `$", f" - at `$.{where}", 1))
    return msgspec.ValidationError(f"{text} - at `$.{where}`")


@dataclass(frozen=True, slots=True)
class Translated:
    """A Responses request in the pipeline's terms, and what its answer needs."""

    parsed: ParsedRequest
    turn: list[dict[str, Any]]  # this request's input as chat messages (what it stores)
    max_tool_calls: int | None
    encrypted_reasoning: bool  # include reasoning.encrypted_content
    echo: dict[str, Any] = field(default_factory=dict)  # the response's copy of the request


def translate(req: ResponsesWire, limits: RequestLimits, store: ResponseStore) -> Translated:
    """*req* as a chat request. Raises ApiError (400; 404 for an unknown
    previous_response_id) or LimitExceeded.

    The text is counted against ``--max-prompt-chars`` as a chat request's, the
    conversation's (history included) under ``input``, the tools' under ``tools``; a
    tool's ``parameters`` are decoded only once their text has counted."""
    _refuse_unsupported(req)
    if isinstance(req.input, list):
        limits.check_messages(len(req.input))
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        history = _history(store, req.previous_response_id)
    turn = _input(decode_items(req.input) if isinstance(req.input, list) else req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + turn
    chars = _chars(messages)
    limits.check_prompt_chars(chars, "input")
    tools, chars = _tools(req, limits, chars)
    tool_choice, constraint = _tool_choice(req, tools)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        if constraint is not None:  # as a chat request's: refused rather than dropped
            raise bad_request(
                "text.format cannot constrain an answer that tool_choice makes a tool call",
                "text.format",
            )
        constraint, chars = _format(fmt, limits, chars)
    caps = [
        n
        for n in (req.max_tool_calls, 1 if req.parallel_tool_calls is False else None)
        if n is not None
    ]
    kwargs: dict[str, Any] = {}
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        kwargs["thinking"] = _THINKING.get(effort, True)
        if effort in _MAX_EFFORT:
            kwargs["reasoning_effort"] = _MAX_EFFORT[effort]
    if req.max_output_tokens is not None:
        limits.check_max_tokens(req.max_output_tokens, "max_output_tokens")
    sampling = SamplingOptions(
        max_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
    )
    parsed = ParsedRequest(
        endpoint="chat",
        model=req.model,
        messages=messages,
        stream=bool(req.stream),
        sampling=sampling,
        user=req.user,
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=tool_choice,
        text_chars=chars,
        parallel_tool_calls=min(caps, default=2) > 1,
        constraint=constraint,
        needs=feature_needs(sampling, "", constraint),
    )
    echo = {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": req.store is not False,
        "temperature": parsed.sampling.temperature,
        "text": {"format": _echo_format(fmt, constraint)},
        "tool_choice": _echo_choice(req.tool_choice),
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": f["function"]["parameters"],
                "strict": t.strict,
            }
            for t, f in zip(req.tools or (), tools or (), strict=True)
        ],
        "top_p": parsed.sampling.top_p,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }
    return Translated(
        parsed, turn, min(caps) if caps else None, ENCRYPTED_INCLUDE in (req.include or ()), echo
    )


def _tools(
    req: ResponsesRequest, limits: RequestLimits, chars: int
) -> tuple[list[dict[str, Any]] | None, int]:
    """The function tools as the template's, and the text counted so far (*chars* and
    theirs)."""
    if not req.tools:
        return None, chars
    limits.check_tools(len(req.tools))
    for t in req.tools:
        params = 0 if t.parameters is msgspec.UNSET else len(t.parameters)
        chars += len(t.name) + len(t.description or "") + params
    limits.check_prompt_chars(chars, "tools")
    free = FreeForm()
    tools = []
    for j, t in enumerate(req.tools):
        schema = None
        if t.parameters is not msgspec.UNSET:
            where = f"tools[{j}].parameters"
            schema = free.decode(t.parameters, "tools", where)
            if not isinstance(schema, dict | None):
                raise bad_request(f"'{where}' must be an object", "tools")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": schema or {"type": "object", "properties": {}},
                },
            }
        )
    return tools, chars


def _format(fmt: TextFormat, limits: RequestLimits, chars: int) -> tuple[Constraint, int]:
    """``text.format`` ``json_object`` or ``json_schema`` as a chat ``response_format``'s
    constraint, and the text counted so far (a schema's is the request's too)."""
    param = "text.format"
    if fmt.type == "json_object" or fmt.schema is msgspec.UNSET:
        if fmt.type == "json_schema":
            raise bad_request("text.format json_schema needs a 'schema'", param)
        return Constraint("json_object", param), chars
    chars += len(fmt.schema)
    limits.check_prompt_chars(chars, param)
    schema = FreeForm().decode(fmt.schema, param, "text.format.schema")
    if not isinstance(schema, dict):
        raise bad_request("'text.format.schema' must be an object", param)
    return Constraint("json_schema", param, schema), chars


def _echo_format(fmt: TextFormat | None, constraint: Constraint | None) -> dict[str, Any]:
    """``text.format`` as the response repeats it."""
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    echoed: dict[str, Any] = {"type": fmt.type}
    if constraint is not None and constraint.schema is not None:
        echoed |= {"name": fmt.name, "schema": constraint.schema, "strict": fmt.strict}
    return echoed


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: a prompt over the context length is refused",
            "truncation",
        )
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.top_logprobs:
        raise bad_request("logprobs are not supported by this server", "top_logprobs")
    for value in req.include or ():
        if value not in INCLUDES:
            raise bad_request(f"include '{value}' is not supported by this server", "include")


def _history(store: ResponseStore, previous_id: str) -> list[dict[str, Any]]:
    try:
        return store.conversation(previous_id)
    except KeyError:
        raise ApiError(
            404,
            f"Previous response with id '{previous_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        ) from None
    except ChainBroken as exc:
        raise ApiError(
            404,
            f"Previous response with id '{previous_id}' cannot be continued: "
            f"the earlier response '{exc.args[0]}' of its conversation is no "
            "longer stored (evicted or deleted).",
            param="previous_response_id",
            code="previous_response_not_found",
        ) from None


def _input(value: str | list[InputItem]) -> list[dict[str, Any]]:
    """The input as chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being put together

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            if turn is not None and (
                turn["content"] or turn.get("tool_calls") or turn.get("reasoning_content")
            ):
                turn = None  # a new answer's reasoning: a new turn
            assistant()["reasoning_content"] = _reasoning(item, where)
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, MessageItem) and item.role == "assistant":
            text = _text(item.content, f"{where}.content")
            current = assistant()
            current["content"] = (current["content"] or "") + text
        elif isinstance(item, MessageItem):
            turn = None
            out.append({"role": item.role, "content": _text(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": _text(item.output, f"{where}.output"),
                }
            )
        elif isinstance(item, ItemReference):
            raise bad_request(
                f"{where}: item_reference is not supported: send the item, or previous_response_id",
                "input",
            )
    return out


def _text(content: str | list[InputContent], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, InputText | OutputText):
            texts.append(part.text)
        elif isinstance(part, Refusal):
            texts.append(part.refusal)
        else:
            kind = "input_image" if type(part).__name__ == "InputImage" else "input_file"
            raise bad_request(
                f"{where}[{j}]: '{kind}' is not supported: this server serves "
                "a text-only model (no multimodal engine)",
                "input",
            )
    return "".join(texts)


def _reasoning(item: ReasoningItem, where: str) -> str:
    if item.content:
        return "".join(c.text for c in item.content)
    if item.encrypted_content is not None:
        return decrypt(item.encrypted_content, where)
    return "".join(s.text for s in item.summary)


def _tool_choice(
    req: ResponsesRequest, tools: list[dict[str, Any]] | None
) -> tuple[str | dict[str, Any] | None, Constraint | None]:
    """The chat ``tool_choice``, and the constraint a forced call holds the answer to
    (``required``: a call of any tool; a named function: a call of that one)."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return choice, None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    offered = list(dict.fromkeys(t["function"]["name"] for t in tools))
    if isinstance(choice, ToolChoiceFunction):
        if choice.name not in offered:
            raise bad_request(
                f"tool_choice names '{choice.name}', which is not in tools", "tool_choice"
            )
        named = {"type": "function", "function": {"name": choice.name}}
        return named, Constraint("tool_call", "tool_choice", tools=(choice.name,))
    return "required", Constraint("tool_calls", "tool_choice", tools=tuple(offered))


def _echo_choice(choice: str | ToolChoiceFunction | None) -> Any:
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def _chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        total += len(m.get("content") or "") + len(m.get("reasoning_content") or "")
        for call in m.get("tool_calls") or ():
            total += len(call["function"]["arguments"])
    return total
