"""DeepSeek-V4's chat encoding: the built-in template for a config without one.

The DeepSeek-V4 tokenizer ships without a ``chat_template``, so
:class:`DeepSeekV4ChatTemplate` writes DeepSeek's encoding out in plain Python: no jinja
compile or interpretation per request, which matters on the hot path of long chats. The
pieces follow DeepSeek's reference encoder: the DSML tools block and tool calls, tool
results merged into user turns, and dropping earlier turns' reasoning in thinking mode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from frontend.preprocess.messages import TemplateError, validate_messages
from frontend.preprocess.template import ChatTemplate

__all__ = ["DeepSeekV4ChatTemplate"]

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
    benchmark sends ``{"thinking": false}`` (docs/performance.md), and for that this
    renderer produces Dynamo's string byte for byte, hence the same token counts. Set
    ``default_thinking=True`` to match Dynamo's behaviour for requests that do not say.

    ``add_generation_prompt=False`` leaves out the opener after a final user turn (the
    reference encoder always writes it; True, the default, matches it). A final assistant
    message is rendered complete, with EOS.
    """

    def __init__(self, *, default_thinking: bool = False) -> None:
        self._default_thinking = default_thinking

    @property
    def default_thinking(self) -> bool:
        return self._default_thinking

    def reads(self, name: str) -> bool:
        return name in _SWITCHES

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


#: The ``chat_template_kwargs`` the renderer reads (see :meth:`DeepSeekV4ChatTemplate._switches`).
_SWITCHES = frozenset(
    {"thinking", "enable_thinking", "thinking_mode", "reasoning_effort", "drop_thinking"}
)


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
    entry: tuple[str, str | None]  # (block, tool_call_id: "" if absent, None for a user's)
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
