"""A Messages request, as the chat pipeline's request: the conversation in the chat
template's terms, the tools, the thinking switch, the sampling options.

The mapping (docs/api.md, "Anthropic Messages", has the whole table):

- ``system`` (a string, or text blocks joined by a blank line) is the system message.
  A block Claude Code starts with ``x-anthropic-billing-header`` is left out: it holds
  a per-request hash, which would change the prompt's first tokens every request and
  so defeat the engine's prefix cache, and it says nothing to the model.
- A user message's ``text`` blocks are a user message; each ``tool_result`` block is a
  ``tool`` message for its ``tool_use_id`` (``is_error``: its content reads
  ``Error: ...``, so that the model knows the call failed), in the order they came.
- An assistant message's ``text`` blocks are its content, ``thinking`` blocks its
  ``reasoning_content``, ``tool_use`` blocks its ``tool_calls`` (the input as the
  arguments). ``redacted_thinking`` has nothing to render and is left out.
- ``tools`` are function tools with ``input_schema`` as their parameters;
  ``tool_choice`` ``auto`` and ``none`` are OpenAI's (``none`` parses no call);
  ``any`` and ``tool`` force a call (OpenAI's ``required`` and named function: held
  to a call by constrained decoding, on engines that declare it);
  ``disable_parallel_tool_use`` keeps one call.
- ``thinking`` ``enabled``, ``adaptive`` or ``between_tools`` turns the template's
  thinking mode on (``chat_template_kwargs.thinking``), ``disabled`` off (``display:
  omitted`` leaves the thinking blocks' text out of the answer); ``output_config.effort`` is
  the template's ``reasoning_effort`` (DeepSeek-V4: ``max``/``xhigh`` ask for its
  maximum effort).
- ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
  ``metadata.user_id`` map to their chat equivalents; ``output_config.format``
  (``json_schema``) is a chat ``response_format``'s constraint. Those that need an
  engine's feature (``top_k``, constrained decoding) are checked against the workers'
  declarations before dispatch, as a chat request's are.

``image`` and ``document`` blocks are refused with a 400 that says so: no multimodal
engine is served. Every refusal is an :class:`~frontend.http.errors.ApiError` (400,
``param`` the field), which the route answers in Anthropic's shape. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec

from frontend.http.anthropic.models import (
    AnthropicMessage,
    Conversation,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    SystemBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoice,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from frontend.http.errors import ApiError, bad_request
from frontend.http.schema import FreeForm, feature_needs
from frontend.limits import RequestLimits
from frontend.request import Constraint, ParsedRequest, SamplingOptions

#: Claude Code's first system block, per request: left out of the prompt (see above).
BILLING_HEADER = "x-anthropic-billing-header"


@dataclass(frozen=True, slots=True)
class Translated:
    """A Messages request in the pipeline's terms, and what its answer's format needs."""

    parsed: ParsedRequest
    max_tool_calls: int | None  # 1 with disable_parallel_tool_use
    show_thinking: bool  # False with thinking.display "omitted"


#: A tool call's ``input`` waiting to be decoded: where it goes, its text, its place.
_Pending = tuple[dict[str, Any], msgspec.Raw, str]


def translate(req: Conversation, limits: RequestLimits) -> Translated:
    """*req* (a Messages or count_tokens request) as a chat request. Raises ApiError
    (400) or LimitExceeded.

    As a chat request's (:func:`frontend.http.schema.chat_text`), the text is counted
    against ``--max-prompt-chars`` as it adds up, the conversation's under ``messages``,
    the tools' under ``tools``, and free-form JSON (a ``tool_use``'s ``input``, a tool's
    ``input_schema``) is decoded only once its text has counted."""
    limits.check_messages(len(req.messages))
    messages = _system(req.system)
    pending: list[_Pending] = []
    for i, message in enumerate(req.messages):
        messages += _message(message, i, pending)
    chars = _chars(messages) + sum(len(raw) for _, raw, _ in pending)
    limits.check_prompt_chars(chars, "messages")
    free = FreeForm()
    for function, raw, where in pending:
        function["arguments"] = value = free.decode(raw, "messages", where)
        if not isinstance(value, dict):
            raise bad_request(f"'{where}' must be an object", "messages")
    tools, chars = _tools(req, limits, free, chars)
    tool_choice, constraint, one = _tool_choice(req.tool_choice, tools)
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["thinking"] = not isinstance(req.thinking, ThinkingDisabled)
    output = req.output_config
    if output is not None and _given(output.format):
        if constraint is not None:  # as a chat request's: refused rather than dropped
            raise bad_request(
                "output_config.format cannot constrain an answer that tool_choice makes a "
                "tool call",
                "output_config.format",
            )
        chars += len(output.format)  # the schema's text is the request's too
        limits.check_prompt_chars(chars, "output_config.format")
        constraint = _format(output.format, free)
    if output is not None and output.effort is not None:
        kwargs["reasoning_effort"] = output.effort

    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = _generation(req, limits)
    sampling = fields.get("sampling", SamplingOptions())
    parsed = ParsedRequest(
        endpoint="chat",
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        chat_template_kwargs=kwargs,
        text_chars=chars,
        parallel_tool_calls=not one,
        constraint=constraint,
        needs=feature_needs(sampling, "", constraint),
        **fields,
    )
    display = getattr(req.thinking, "display", None)
    return Translated(parsed, 1 if one else None, show_thinking=display != "omitted")


def _generation(req: MessagesRequest, limits: RequestLimits) -> dict[str, Any]:
    """The ParsedRequest fields only a request that generates has."""
    limits.check_max_tokens(req.max_tokens, "max_tokens")
    thinking = req.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= req.max_tokens:
        raise bad_request(
            "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens"
        )
    stop = tuple(req.stop_sequences or ())
    if stop:
        limits.check_stop(stop, "stop_sequences")
    return {
        "stream": bool(req.stream),
        "sampling": SamplingOptions(
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
        ),
        "stop": stop,
        "user": req.metadata.user_id if req.metadata else None,
    }


def _system(system: str | list[SystemBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        text = "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []


def _message(message: AnthropicMessage, i: int, pending: list[_Pending]) -> list[dict[str, Any]]:
    """The chat messages one Messages message becomes; its tool calls' inputs join
    *pending*."""
    where = f"messages[{i}].content"
    content = message.content
    if isinstance(content, str):
        return [{"role": message.role, "content": content}]
    if message.role == "assistant":
        return [_assistant(content, where, pending)]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, f"{where}[{j}]"),
                }
            )
        else:
            raise _unsupported(block, f"{where}[{j}]", "a user message")
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str, pending: list[_Pending]) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name}
            calls.append({"id": block.id, "type": "function", "function": function})
            pending.append((function, block.input, f"{where}[{j}].input"))
        elif not isinstance(block, RedactedThinkingBlock):
            raise _unsupported(block, f"{where}[{j}]", "an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, TextBlock):
                raise _unsupported(part, f"{where}.content[{k}]", "a tool result")
            parts.append(part.text)
        text = "\n\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _unsupported(block: msgspec.Struct, where: str, container: str) -> ApiError:
    kind = block.__struct_config__.tag  # the block's "type"
    if isinstance(block, ImageBlock | DocumentBlock):
        why = "this server serves a text-only model (no multimodal engine)"
    else:
        why = f"it does not belong in {container}"
    return bad_request(f"{where}: a '{kind}' block is not supported here: {why}", "messages")


def _tools(
    req: Conversation, limits: RequestLimits, free: FreeForm, chars: int
) -> tuple[list[dict[str, Any]] | None, int]:
    """The tools as the template's function tools, and the text counted so far (*chars*
    and theirs)."""
    if not req.tools:
        return None, chars
    limits.check_tools(len(req.tools))
    names = [t.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    chars += sum(len(t.name) + len(t.description or "") + len(t.input_schema) for t in req.tools)
    limits.check_prompt_chars(chars, "tools")
    tools = []
    for j, t in enumerate(req.tools):
        where = f"tools[{j}].input_schema"
        schema = free.decode(t.input_schema, "tools", where)
        if not isinstance(schema, dict):
            raise bad_request(f"'{where}' must be an object", "tools")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": schema,
                },
            }
        )
    return tools, chars


def _tool_choice(
    choice: ToolChoice | None, tools: list[dict[str, Any]] | None
) -> tuple[str | dict[str, Any] | None, Constraint | None, bool]:
    """OpenAI's ``tool_choice`` for Anthropic's; the constraint a forced call holds the
    answer to (``any``: a call of any tool, OpenAI's ``required``; ``tool``: a call of
    that one, OpenAI's named function); and whether the answer keeps one call only."""
    if choice is None:
        return None, None, False
    one = bool(getattr(choice, "disable_parallel_tool_use", None))
    if isinstance(choice, ToolChoiceNone | ToolChoiceAuto):
        return ("none" if isinstance(choice, ToolChoiceNone) else "auto"), None, one
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    offered = [t["function"]["name"] for t in tools]
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in offered:
            raise bad_request(
                f"tool_choice names '{choice.name}', which is not in tools", "tool_choice.name"
            )
        named = {"type": "function", "function": {"name": choice.name}}
        return named, Constraint("tool_call", "tool_choice", tools=(choice.name,)), one
    offered = list(dict.fromkeys(offered))
    return "required", Constraint("tool_calls", "tool_choice", tools=tuple(offered)), one


def _given(raw: msgspec.Raw | msgspec.UnsetType) -> TypeGuard[msgspec.Raw]:
    """A free-form field that is there and not null."""
    return isinstance(raw, msgspec.Raw) and bytes(raw).strip() != b"null"


def _format(raw: msgspec.Raw, free: FreeForm) -> Constraint:
    """``output_config.format``: Anthropic's structured outputs, ``{"type":
    "json_schema", "schema": {...}}``, as a chat ``response_format``'s constraint."""
    param = "output_config.format"
    value = free.decode(raw, param, param)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "json_schema":
        raise bad_request(
            f"{param} must be {{'type': 'json_schema', 'schema': {{...}}}}, got type {kind!r}",
            param,
        )
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}.schema' must be an object", param)
    return Constraint("json_schema", param, schema)


def _chars(messages: list[dict[str, Any]]) -> int:
    """The characters of text in the translated conversation, its tool calls' inputs
    aside (the prompt-size limit's measure, as for a chat request)."""
    return sum(
        len(m.get("content") or "")
        + len(m.get("reasoning_content") or "")
        + sum(len(c["function"]["name"]) for c in m.get("tool_calls") or ())
        for m in messages
    )
