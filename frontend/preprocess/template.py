"""Chat templates: OpenAI ``messages`` in, the prompt string out.

Two renderers sit behind one :class:`ChatTemplate` interface:

* :class:`JinjaChatTemplate` runs the ``chat_template`` of a tokenizer_config.json the way
  HF ``transformers`` does (same jinja environment options, globals and ``tojson`` filter),
  inside jinja2's *immutable sandbox*: a template is untrusted input and must not reach
  Python internals or mutate the request.
* :class:`DeepSeekV4ChatTemplate` is the built-in template used when the config has none
  (the DeepSeek-V4 tokenizer ships without one). It is plain Python: no jinja compile or
  interpretation per request, which matters on the hot path of long chats.

Everything a client can get wrong is reported as :class:`TemplateError` with a message fit
for a 400 response; the HTTP layer maps it directly. Nothing here does I/O except reading
the config in :meth:`ChatTemplate.from_tokenizer_config`.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "DeepSeekV4ChatTemplate",
    "JinjaChatTemplate",
    "TemplateError",
    "completion_prompt",
    "validate_messages",
]


class TemplateError(ValueError):
    """The request cannot be rendered: bad ``messages``/``prompt``/``tools``/kwargs, or the
    chat template itself failed. The message is written for the client (HTTP 400)."""


_ROLES = ("system", "user", "assistant", "tool", "developer")

# ---------------------------------------------------------------------------------------
# Input validation shared by both renderers
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


def _validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TemplateError("tools must be an array")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TemplateError(f"tools[{i}].function must be an object with a string 'name'")
    return tools or None


def _validate_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TemplateError("chat_template_kwargs must be an object")
    return dict(kwargs)


# ---------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------


class ChatTemplate(abc.ABC):
    """Renders chat ``messages`` to the prompt string the tokenizer then encodes.

    The rendered string already holds BOS and every special token as text, so encode it
    with ``add_special_tokens=False``. Instances are immutable and thread-safe: render from
    worker threads freely.
    """

    @classmethod
    def from_tokenizer_config(
        cls, config: str | os.PathLike[str] | Mapping[str, Any], *, default_thinking: bool = False
    ) -> ChatTemplate:
        """Pick the renderer for a model.

        ``config`` is the parsed tokenizer_config.json, its path, or the directory holding it.
        A ``chat_template`` string is compiled with :class:`JinjaChatTemplate`; a list of
        ``{name, template}`` uses the one named "default" (and "tool_use" when a request has
        tools, as HF does). From a path, a sibling ``chat_template.jinja`` (newer HF layout)
        is used when the config has none. With no template at all the built-in
        :class:`DeepSeekV4ChatTemplate` (``default_thinking`` passed on) is returned.

        Raises:
            OSError: the config cannot be read.
            TemplateError: the config is not JSON, or a template does not compile.
        """
        sidecar: str | None = None
        if isinstance(config, Mapping):
            cfg: Mapping[str, Any] = config
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "tokenizer_config.json"
            try:
                cfg = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise TemplateError(f"{path}: not valid JSON: {exc}") from exc
            jinja_file = path.with_name("chat_template.jinja")
            if jinja_file.is_file():
                sidecar = jinja_file.read_text(encoding="utf-8")
        source = cfg.get("chat_template") or sidecar
        if not source:
            return DeepSeekV4ChatTemplate(default_thinking=default_thinking)
        tokens = {
            name: _token_text(cfg.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return JinjaChatTemplate(source, special_tokens=tokens)

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render one request's conversation.

        ``add_generation_prompt`` appends the assistant turn opener after a final user
        turn. ``chat_template_kwargs`` are template switches (e.g. ``{"thinking": false}``).
        ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {...}}``).

        Raises:
            TemplateError: invalid input, or the template failed while rendering.
        """
        return self._render(
            messages,
            add_generation_prompt=add_generation_prompt,
            kwargs=_validate_kwargs(chat_template_kwargs),
            tools=_validate_tools(tools),
        )

    @abc.abstractmethod
    def _render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> str: ...


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or an AddedToken dict.
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


# ---------------------------------------------------------------------------------------
# Jinja templates from tokenizer_config.json
# ---------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter: plain json.dumps, no HTML escaping (jinja's own tojson escapes <, >, &).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body, so templates written for
    HF's assistant-mask tracking compile here too (we never need the mask)."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_RESERVED_VARS = frozenset({"messages", "add_generation_prompt", "tools"})


class JinjaChatTemplate(ChatTemplate):
    """A jinja chat template compiled once, rendered per request in a sandbox.

    Template variables: ``messages`` (validated; list ``content`` flattened to a string
    with text parts joined by newlines, as vLLM does for string-content templates),
    ``add_generation_prompt``, ``tools``, the special tokens given (``bos_token``,
    ``eos_token``, ...), then ``chat_template_kwargs`` spread in (they may override special
    tokens, not the three request variables).
    """

    def __init__(self, source: Any, *, special_tokens: Mapping[str, str | None] | None = None):
        """``source`` is a template string or HF's list of ``{name, template}``.

        Raises:
            TemplateError: the template does not compile, or the list has no "default".
        """
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        named = _named_templates(source)
        if "default" not in named:
            raise TemplateError("chat_template list has no template named 'default'")
        try:
            self._templates = {name: env.from_string(text) for name, text in named.items()}
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def _render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> str:
        checked = validate_messages(messages, joiner="\n")
        clash = _RESERVED_VARS.intersection(kwargs)
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(clash)[0]!r}")
        template = self._templates["default"]
        if tools is not None and "tool_use" in self._templates:
            template = self._templates["tool_use"]
        variables = {
            **self._special,
            **kwargs,
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return template.render(variables)
        except jinja2.exceptions.TemplateError as exc:  # includes SecurityError, raise_exception
            raise TemplateError(f"chat template error: {exc}") from exc
        except Exception as exc:  # a template bug (e.g. None + str) is still this request's 400
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _named_templates(source: Any) -> dict[str, str]:
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):
        named = {}
        for item in source:
            if not (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TemplateError("chat_template list items must be {name, template} strings")
            named[item["name"]] = item["template"]
        return named
    raise TemplateError("chat_template must be a string or a list of {name, template}")


# ---------------------------------------------------------------------------------------
# Built-in DeepSeek-V4 template
# ---------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
_DSML = "｜DSML｜"

# Wording fixed by DeepSeek's reference encoder (encoding_dsv4.py); the model was trained on
# it, so it must match byte for byte.
_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501

_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class DeepSeekV4ChatTemplate(ChatTemplate):
    """DeepSeek-V4's chat encoding, written out in Python.

    Follows DeepSeek's reference ``encoding_dsv4.py`` as ported by NVIDIA Dynamo
    (``lib/llm/src/preprocessor/prompt/deepseek_v4.rs``) and wrapped by vLLM::

        <BOS>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<EOS><｜User｜>{user}<｜Assistant｜></think>

    In thinking mode the final opener is ``<｜Assistant｜><think>``; earlier turns keep
    ``</think>`` and lose their ``reasoning_content`` ("drop thinking"), unless tools are
    present or ``drop_thinking`` is false, in which case earlier turns render
    ``{reasoning}</think>{answer}`` and every opener is ``<think>``. Tool results become
    ``<tool_result>...</tool_result>`` blocks of a user turn (consecutive user/tool messages
    merge, joined by blank lines); tools and assistant tool calls use DeepSeek's DSML.

    ``chat_template_kwargs`` understood: ``thinking`` / ``enable_thinking`` (bool, first
    present wins), ``thinking_mode`` ("chat" | "thinking"), ``reasoning_effort`` ("none"
    forces chat mode; "max"/"xhigh" add DeepSeek's max-effort preamble in thinking mode),
    ``drop_thinking`` (bool, default true). Other keys are ignored, as a jinja template
    would ignore unknown variables.

    **Default for** ``thinking``: ``default_thinking``, False unless configured. That is the
    default of DeepSeek's own and vLLM's ``apply_chat_template`` wrappers (``thinking =
    kwargs.get("thinking", False)``). Dynamo's native V4 formatter defaults to thinking
    mode instead, so a comparison with Dynamo must pass the switch explicitly: our
    benchmark sends ``{"thinking": false}``, and for that this renderer produces Dynamo's
    string byte for byte, hence the same token counts. Set ``default_thinking=True`` to
    match Dynamo's behaviour for requests that do not say.

    ``add_generation_prompt=False`` leaves out the opener after a final user turn (the
    reference encoder always writes it; True, the default, matches it). A final assistant
    message is rendered complete, with EOS.
    """

    def __init__(self, *, default_thinking: bool = False) -> None:
        self._default_thinking = default_thinking

    @property
    def default_thinking(self) -> bool:
        return self._default_thinking

    def _render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> str:
        msgs = validate_messages(messages, joiner="")
        thinking, effort_max, drop_thinking = self._switches(kwargs)
        for i, m in enumerate(msgs):
            if m["role"] == "developer" and not m["content"]:
                raise TemplateError(f"messages[{i}].content must not be empty for 'developer'")
        if tools:
            at = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
            if at is None:
                msgs.insert(0, {"role": "system", "content": "", "tools": tools})
            else:
                msgs[at] = {**msgs[at], "tools": tools}
        merged = _sort_tool_results(_merge_tool_messages(msgs))
        drop = drop_thinking and not tools
        if thinking and drop:
            merged = _drop_earlier_turns(merged)
        last_user = _last_user_index(merged)

        out = [BOS]
        if thinking and effort_max:
            out.append(_EFFORT_MAX)
        n = len(merged)
        for i, m in enumerate(merged):
            role = m["role"]
            if role == "system":
                out.append(m["content"])
                out.append(_tools_block(m))
            elif role == "developer":
                out += (USER, m["content"], _tools_block(m))
            elif role == "user":
                out += (USER, "\n\n".join(m["blocks"]))
            else:  # assistant
                if thinking and (not drop or i > last_user):
                    out += (m.get("reasoning_content") or "", THINK_END)
                out.append(m["content"] or "")
                if m.get("tool_calls"):
                    out.append(_render_tool_calls(m["tool_calls"]))
                out.append(EOS)
            if role in ("user", "developer"):
                if i + 1 < n:
                    opener = merged[i + 1]["role"] == "assistant"
                else:
                    opener = add_generation_prompt
                if opener:
                    seed = thinking and (not drop or i >= last_user)
                    out += (ASSISTANT, THINK_START if seed else THINK_END)
        return "".join(out)

    def _switches(self, kwargs: dict[str, Any]) -> tuple[bool, bool, bool]:
        """(thinking, max effort, drop_thinking) from the request's template kwargs."""
        for key in ("thinking", "enable_thinking", "drop_thinking"):
            if kwargs.get(key) is not None and not isinstance(kwargs[key], bool):
                raise TemplateError(f"chat_template_kwargs.{key} must be a boolean")
        mode = kwargs.get("thinking_mode")
        if mode is not None and mode not in ("chat", "thinking"):
            raise TemplateError("chat_template_kwargs.thinking_mode must be 'chat' or 'thinking'")
        effort = kwargs.get("reasoning_effort")
        if effort is not None and not isinstance(effort, str):
            raise TemplateError("chat_template_kwargs.reasoning_effort must be a string")

        thinking = self._default_thinking
        if kwargs.get("thinking") is not None:
            thinking = kwargs["thinking"]
        elif kwargs.get("enable_thinking") is not None:
            thinking = kwargs["enable_thinking"]
        elif mode is not None:
            thinking = mode == "thinking"
        if effort == "none":
            thinking = False
        drop = kwargs.get("drop_thinking")
        return thinking, effort in ("max", "xhigh"), drop is not False


def _tools_block(msg: Mapping[str, Any]) -> str:
    tools = msg.get("tools")
    if not tools:
        return ""
    schemas = "\n".join(_dumps(t["function"]) for t in tools)
    return "\n\n" + _TOOLS_TEMPLATE.format(
        dsml=_DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas
    )


def _render_tool_calls(tool_calls: list[Mapping[str, Any]]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        args = fn["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"arguments": args}  # the reference encoder's fallback
        if not isinstance(args, Mapping):
            raise TemplateError(f"tool call {fn['name']!r}: arguments must be a JSON object")
        params = "\n".join(
            f'<{_DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _dumps(v)}</{_DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{_DSML}invoke name="{fn["name"]}">\n{params}\n</{_DSML}invoke>')
    return f"\n\n<{_DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{_DSML}tool_calls>"


def _merge_tool_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User and tool messages become user turns with ``blocks`` (rendered text pieces);
    a run of them merges into one turn, as the reference encoder does."""
    merged: list[dict[str, Any]] = []
    for m in msgs:
        role = m["role"]
        if role == "tool":
            block = f"<tool_result>{m['content']}</tool_result>"
            ref = m.get("tool_call_id")
            entry = (block, ref if isinstance(ref, str) else "")
        elif role == "user":
            entry = (m["content"], None)
        else:
            merged.append(m)
            continue
        if merged and merged[-1]["role"] == "user":
            merged[-1]["blocks"].append(entry[0])
            merged[-1]["refs"].append(entry[1])
        else:
            merged.append({"role": "user", "blocks": [entry[0]], "refs": [entry[1]]})
    return merged


def _sort_tool_results(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Order a turn's tool results as the preceding assistant ordered its calls."""
    order: dict[str, int] = {}
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {}
            for k, call in enumerate(m["tool_calls"]):
                ref = call.get("id")
                if isinstance(ref, str) and ref:
                    order[ref] = k
        elif m["role"] == "user" and order:
            slots = [k for k, ref in enumerate(m["refs"]) if ref is not None]
            if len(slots) > 1:
                ranked = sorted(slots, key=lambda k: order.get(m["refs"][k], 0))
                blocks = [m["blocks"][k] for k in ranked]
                for slot, block in zip(slots, blocks, strict=True):
                    m["blocks"][slot] = block
    return msgs


def _last_user_index(msgs: list[dict[str, Any]]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_earlier_turns(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Before the last user turn the reference encoder keeps system and user turns, keeps
    # assistant answers without their reasoning, and drops developer turns.
    last_user = _last_user_index(msgs)
    return [m for i, m in enumerate(msgs) if i >= last_user or m["role"] != "developer"]


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
