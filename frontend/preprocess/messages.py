"""Checking what a client sent before anything is rendered.

OpenAI chat ``messages`` (roles, text content parts, assistant tool calls and reasoning),
``tools`` and ``chat_template_kwargs`` are validated here for both renderers, and
``content`` is flattened to a string (each renderer picks how text parts are joined). The
``prompt`` of /v1/completions is normalised by :func:`completion_prompt`.

Everything a client can get wrong is reported as :class:`TemplateError` with a message fit
for a 400 response; the HTTP layer maps it directly. It is defined here because this
module is the bottom of the chat-template modules and imports none of them: the validators
raise it, and the :class:`~frontend.preprocess.template.ChatTemplate` interface and both
renderers import the validators, so defined in any of those it would have this module
importing its own importers. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "TemplateError",
    "completion_prompt",
    "validate_kwargs",
    "validate_messages",
    "validate_tools",
]


class TemplateError(ValueError):
    """The request cannot be rendered: bad ``messages``/``prompt``/``tools``/kwargs, or the
    chat template itself failed. The message is written for the client (HTTP 400)."""


_ROLES = ("system", "user", "assistant", "tool", "developer")

# ---------------------------------------------------------------------------------------
# /v1/chat/completions: messages, tools, template kwargs
# ---------------------------------------------------------------------------------------


def _flatten_content(content: Any, where: str, *, joiner: str, nullable: bool) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if nullable:
            return None
        raise TemplateError(f"{where} must be a string or a list of text parts")
    if not isinstance(content, list):
        raise TemplateError(
            f"{where} must be a string or a list of text parts, not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise TemplateError(f"{where}[{j}] must be an object like {{'type': 'text', ...}}")
        kind = part.get("type")
        if kind != "text":
            raise TemplateError(
                f"{where}[{j}]: content part type {kind!r} is not supported (only 'text')"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise TemplateError(f"{where}[{j}].text must be a string")
        texts.append(text)
    return joiner.join(texts)


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise TemplateError(f"{where} must be a list")
    for k, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TemplateError(f"{where}[{k}].function must be an object with a string 'name'")
        if not isinstance(fn.get("arguments"), str | Mapping):
            raise TemplateError(f"{where}[{k}].function.arguments must be a JSON string")


def validate_messages(messages: Any, *, joiner: str = "") -> list[dict[str, Any]]:
    """Check OpenAI chat ``messages`` and return shallow copies with ``content`` flattened
    to ``str`` (text parts joined by ``joiner``) or ``None`` (assistant only).

    Raises:
        TemplateError: on any shape the renderers cannot handle.
    """
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty array")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise TemplateError(f"{where} must be an object")
        role = msg.get("role")
        if role not in _ROLES:
            raise TemplateError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}")
        m = dict(msg)
        is_assistant = role == "assistant"
        if "content" not in m and not is_assistant:
            raise TemplateError(f"{where}.content is required for role {role!r}")
        m["content"] = _flatten_content(
            m.get("content"), f"{where}.content", joiner=joiner, nullable=is_assistant
        )
        if is_assistant:
            _check_tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise TemplateError(f"{where}.reasoning_content must be a string")
        out.append(m)
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check OpenAI tool definitions; ``None`` for no tools (absent or an empty list).

    Raises:
        TemplateError: not a list, or an entry without a ``function`` holding a string
            ``name``.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TemplateError("tools must be an array")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TemplateError(f"tools[{i}].function must be an object with a string 'name'")
    return tools or None


def validate_kwargs(kwargs: Any) -> dict[str, Any]:
    """Check ``chat_template_kwargs`` and return a copy (``{}`` when absent).

    Raises:
        TemplateError: not an object with string keys.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TemplateError("chat_template_kwargs must be an object")
    return dict(kwargs)


# ---------------------------------------------------------------------------------------
# /v1/completions prompts
# ---------------------------------------------------------------------------------------


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def completion_prompt(prompt: Any) -> str | list[int]:
    """Normalise the ``prompt`` of a /v1/completions request.

    Accepts a string, a list holding one string, a list of token ids, or a list holding
    one list of token ids. Returns the string or the ids (to be sent without re-encoding).

    Raises:
        TemplateError: empty prompt, negative ids, several prompts (batching is not
            supported), or any other shape.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise TemplateError("prompt must not be empty")
        return prompt
    if _is_token_ids(prompt):
        if not prompt:
            raise TemplateError("prompt must not be empty")
        if any(t < 0 for t in prompt):
            raise TemplateError("prompt token ids must be non-negative integers")
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        raise TemplateError(
            "batch prompts are not supported: send one prompt (a string or a list of token "
            "ids) per request"
        )
    raise TemplateError("prompt must be a string or a list of token ids")
