"""Every field of every request body, and what each engine does with it: the table.

A field is honoured or refused with a 400 naming it, never quietly ignored. Most are
honoured alike everywhere (the frontend does their work, or every engine's baseline
covers them); a field that needs a *feature* (``top_k``, constrained decoding, ...) is
honoured only by the engines that declare it (:mod:`headwater.wire.capabilities`), and
refused before dispatch by the others. :data:`FIELDS` is the table: the schema's
checks read which feature each field needs, ``tests/test_fields.py`` sends every row to
each engine, and :func:`markdown` renders it as docs/api.md's "Fields" section (the
test checks the two agree). A field added to :mod:`frontend.http.models` without a row
fails that test.

The engines' columns come from their own declarations, so the table cannot claim what
an engine does not declare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    Capabilities,
)

CHAT, COMPLETIONS, GENERATE = "chat", "completions", "generate"
OPENAI = (CHAT, COMPLETIONS)
EVERY = (CHAT, COMPLETIONS, GENERATE)
#: Anthropic's Messages API and OpenAI's Responses API: each a table of its own.
MESSAGES, RESPONSES = "messages", "responses"
#: The tables docs/api.md publishes, each of the routes it covers.
TABLES = (EVERY, (MESSAGES,), (RESPONSES,))

_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": _WEATHER}}
#: The same tool in Anthropic's shape and in the Responses API's.
_ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": _WEATHER}
_RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": _WEATHER}


@dataclass(frozen=True, slots=True)
class Field:
    """One request field.

    ``name`` as the client writes it; on the token-in API a *sampling* field lives in
    ``sampling_params`` (:meth:`param`). ``does`` says what headwater does with it.
    ``feature``: what an engine must declare to honour a value asking for it (None:
    every engine does). ``asks``: body fields asking for it, sent by the tests (the
    token-in API's go in ``sampling_params`` for a sampling field). ``refused``: such a
    value is refused on every engine (``does`` says why). ``when``: the values that need
    the feature, where others do not (``tool_choice``'s ``required``). ``mocker``: how
    the simulated engine honours it, where that needs saying; ``vllm``: what vLLM
    receives, and ``vllm_key`` the key of its ``sampling_params`` that carries it.
    ``refused_as``: the field a refusal names, when another field of :attr:`asks` is
    the one that needs the feature (``top_logprobs`` asks through ``logprobs``).
    """

    name: str
    routes: tuple[str, ...]
    does: str
    feature: str | None = None
    asks: dict[str, Any] = field(default_factory=dict)
    sampling: bool = False
    refused: bool = False
    when: str = ""
    mocker: str = ""
    vllm: str = ""
    vllm_key: str = ""
    refused_as: str = ""

    def where(self, route: str, name: str = "") -> str:
        """The field's place in *route*'s body (or *name*'s, beside it)."""
        name = name or self.name
        return f"sampling_params.{name}" if self.sampling and route == GENERATE else name

    def param(self, route: str) -> str:
        """The field as a refusal on *route* names it."""
        return self.where(route, self.refused_as)

    def honoured(self, caps: Capabilities) -> bool:
        """An engine of *caps* honours the value :attr:`asks` sends."""
        return not self.refused and (self.feature is None or caps.honours(self.feature))

    def verdict(self, caps: Capabilities) -> str:
        """What an engine of *caps* does with this field, for the docs."""
        if self.honoured(caps):
            return "honoured"
        return f"honoured; 400 for {self.when}" if self.when else "400"


def _s(name: str, does: str, feature: str | None = None, value: Any = None, **kw: Any) -> Field:
    """A sampling field: top level on the OpenAI routes, in ``sampling_params`` on the
    token-in API (vLLM's key of the same name); *value* asks for it."""
    kw.setdefault("vllm_key", name)
    return Field(name, EVERY, does, feature, {name: value}, sampling=True, **kw)


FIELDS: tuple[Field, ...] = (
    # -- what to answer --
    Field(
        "model",
        EVERY,
        "must name the served model (404 otherwise); optional on the token-in API",
        asks={"model": "deepseek-v4"},
    ),
    Field(
        "messages",
        (CHAT,),
        "rendered by the chat template, then tokenized",
        asks={"messages": [{"role": "user", "content": "Hello"}]},
    ),
    Field(
        "prompt",
        (COMPLETIONS,),
        "a string, or token ids, sent as they are (one prompt per request)",
        asks={"prompt": [5, 6, 7]},
    ),
    Field(
        "suffix",
        (COMPLETIONS,),
        "fill in the middle: the prompt becomes "
        "`<｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>`; refused with a tokenizer "
        "without those tokens, or a prompt of token ids",
        asks={"suffix": " return x"},
    ),
    Field(
        "token_ids",
        (GENERATE,),
        "the prompt, checked against the vocabulary",
        asks={"token_ids": [5, 6, 7]},
    ),
    Field(
        "request_id",
        (GENERATE,),
        "named in the answer (`generate-tokens-<id>`); the plane uses its own",
        asks={"request_id": "r-7"},
    ),
    Field(
        "sampling_params",
        (GENERATE,),
        "vLLM's `SamplingParams`: its fields are the rows in `sampling_params`",
        asks={"sampling_params": {"max_tokens": 2}},
    ),
    Field(
        "tools",
        (CHAT,),
        "rendered into the prompt by the chat template (not with "
        '`tool_choice: "none"`) and read back as `tool_calls` by the tool-call parser',
        asks={"tools": [_TOOL]},
    ),
    Field(
        "tool_choice",
        (CHAT,),
        "`auto`: as above; `none`: the tools are left out of the "
        "prompt (as Dynamo does) and nothing is parsed; `required` or a named function: "
        "the answer is held to a call (constrained decoding, in the model's own call "
        "format)",
        STRUCTURED_OUTPUTS,
        {"tools": [_TOOL], "tool_choice": "required"},
        when="`required`, a named function",
        vllm="`structured_outputs.structural_tag`",
        vllm_key="structured_outputs",
    ),
    Field(
        "parallel_tool_calls",
        (CHAT,),
        "`false`: at most one call (constrained to one "
        "where the engine constrains, else later calls dropped)",
        asks={"tools": [_TOOL], "parallel_tool_calls": False},
    ),
    Field(
        "response_format",
        OPENAI,
        "`json_object` and `json_schema`: the answer is held "
        "to JSON (to the schema) by constrained decoding, after free reasoning in thinking "
        "mode; `text`: no constraint",
        STRUCTURED_OUTPUTS,
        {"response_format": {"type": "json_object"}},
        when="`json_object`, `json_schema`",
        vllm="`structured_outputs.json` / `.json_object` (a `structural_tag` after reasoning)",
        vllm_key="structured_outputs",
    ),
    Field(
        "structured_outputs",
        (GENERATE,),
        "vLLM's constrained decoding: exactly one of "
        "`json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag` (its other "
        "options are refused)",
        STRUCTURED_OUTPUTS,
        {"structured_outputs": {"choice": ["yes", "no"]}},
        sampling=True,
        vllm="`structured_outputs`",
        vllm_key="structured_outputs",
    ),
    Field(
        "reasoning_effort",
        (CHAT,),
        "to the chat template as vLLM passes it "
        "(`reasoning_effort`, and `enable_thinking` unless `none`); DeepSeek-V4's: `none` "
        "is chat mode, others think; refused by a template that reads neither",
        asks={"reasoning_effort": "high"},
    ),
    Field(
        "chat_template_kwargs",
        (CHAT,),
        "the chat template's switches (DeepSeek-V4's: "
        "`thinking`, `thinking_mode`, `reasoning_effort`, `drop_thinking`)",
        asks={"chat_template_kwargs": {"thinking": True}},
    ),
    # -- how long --
    Field(
        "max_tokens",
        OPENAI,
        "at most this many tokens (capped by the server's limit); absent: what the context leaves",
        asks={"max_tokens": 3},
        vllm="`max_tokens`",
        vllm_key="max_tokens",
    ),
    Field(
        "max_completion_tokens",
        OPENAI,
        "as `max_tokens`; with both, the smaller",
        asks={"max_completion_tokens": 3},
        vllm="`max_tokens`",
        vllm_key="max_tokens",
    ),
    Field(
        "max_tokens",
        (GENERATE,),
        "at most this many tokens (capped by the server's limit); absent: what the context leaves",
        asks={"max_tokens": 3},
        sampling=True,
        vllm="`max_tokens`",
        vllm_key="max_tokens",
    ),
    _s("min_tokens", "no stop before this many tokens", value=2, vllm="`min_tokens`"),
    _s("ignore_eos", "generate past the end-of-sequence token", value=True, vllm="`ignore_eos`"),
    _s(
        "stop_token_ids",
        "end at any of these ids (included in the answer)",
        value=[5],
        vllm="`stop_token_ids` (with the EOS ids)",
    ),
    Field(
        "stop",
        OPENAI,
        "stop strings, matched on the text by the frontend (excluded from the answer)",
        asks={"stop": ["\n\n"]},
    ),
    Field(
        "stop",
        (GENERATE,),
        "refused: there is no text to match on (`null` and `[]` "
        "pass); use `sampling_params.stop_token_ids`",
        asks={"stop": ["x"]},
        sampling=True,
        refused=True,
    ),
    Field(
        "stop",
        (GENERATE,),
        "refused, as `sampling_params.stop`",
        asks={"stop": ["x"]},
        refused=True,
    ),
    # -- how to sample --
    _s(
        "temperature",
        "sampling temperature; 0 is greedy",
        value=0.0,
        mocker="0 is greedy: the same ids whatever the seed; its draws are uniform, which "
        "other temperatures leave so",
        vllm="`temperature`",
    ),
    _s(
        "top_p",
        "nucleus sampling",
        value=0.5,
        mocker="its draws are uniform: a nucleus of them draws every id alike",
        vllm="`top_p`",
    ),
    _s(
        "seed",
        "the same seed, the same answer",
        SEED,
        7,
        mocker="its draws are a function of the seed",
        vllm="`seed`",
    ),
    _s("top_k", "sample among the k most likely tokens (0 or -1: all)", TOP_K, 5, vllm="`top_k`"),
    _s(
        "min_p",
        "drop tokens less likely than `min_p` times the most likely",
        MIN_P,
        0.1,
        vllm="`min_p`",
    ),
    _s(
        "presence_penalty",
        "penalize tokens already in the answer",
        PRESENCE_PENALTY,
        0.5,
        vllm="`presence_penalty`",
    ),
    _s(
        "frequency_penalty",
        "penalize tokens by their count in the answer",
        FREQUENCY_PENALTY,
        0.5,
        vllm="`frequency_penalty`",
    ),
    _s(
        "repetition_penalty",
        "vLLM's: penalize tokens of the prompt and the answer (1: none)",
        REPETITION_PENALTY,
        1.2,
        vllm="`repetition_penalty`",
    ),
    _s(
        "logit_bias",
        "add a bias (-100 to 100) to these token ids' logits",
        LOGIT_BIAS,
        {"5": 1.0},
        vllm="`logit_bias`",
    ),
    # -- how to answer --
    Field("stream", EVERY, "server-sent events, a delta each", asks={"stream": True}),
    Field(
        "stream_options",
        EVERY,
        "`include_usage`: a last event with the usage",
        asks={"stream": True, "stream_options": {"include_usage": True}},
    ),
    Field(
        "user",
        OPENAI,
        "informational (OpenAI's abuse monitoring): no effect on the "
        "answer, in OpenAI's API either",
        asks={"user": "u-1"},
    ),
    # -- logprobs, n and echo (docs/api.md, "Logprobs, n and echo") --
    _s(
        "n",
        "choices per request (up to 128), each sampled on its own, seed + index; the "
        "frontend fans them out, every engine serving each",
        value=2,
        vllm_key="",
    ),
    Field(
        "best_of",
        EVERY,
        "only null or `n`: no candidates beyond the `n` returned",
        asks={"n": 2, "best_of": 2},
        sampling=True,
    ),
    Field(
        "logprobs",
        (CHAT,),
        "`true`: each token's logprob (`choices[].logprobs.content`)",
        LOGPROBS,
        {"logprobs": True},
        vllm="`logprobs`",
        vllm_key="logprobs",
    ),
    Field(
        "top_logprobs",
        (CHAT,),
        "the 0-20 most likely tokens at each position (needs `logprobs`)",
        LOGPROBS,
        {"logprobs": True, "top_logprobs": 2},
        refused_as="logprobs",
        vllm="`logprobs`",
        vllm_key="logprobs",
    ),
    Field(
        "logprobs",
        (COMPLETIONS,),
        "0-20: each token's logprob and that many most likely tokens (an integer; `false`: none)",
        LOGPROBS,
        {"logprobs": 2},
        vllm="`logprobs`",
        vllm_key="logprobs",
    ),
    Field(
        "top_logprobs",
        (COMPLETIONS,),
        "refused: a chat field (`logprobs` is the count here); `null` passes",
        asks={"top_logprobs": 2},
        refused=True,
    ),
    Field(
        "echo",
        (COMPLETIONS,),
        "the prompt's text before the answer's; with `logprobs`, "
        "the prompt's tokens' logprobs first (the engine's prompt logprobs)",
        asks={"echo": True},
    ),
    Field(
        "logprobs",
        (GENERATE,),
        "0-20: each token's logprob, rank and that many most likely tokens, as vLLM answers",
        LOGPROBS,
        {"logprobs": 1},
        sampling=True,
        vllm="`logprobs`",
        vllm_key="logprobs",
    ),
    Field(
        "prompt_logprobs",
        (GENERATE,),
        "0-20, unary only: the prompt's tokens' logprobs, as vLLM answers",
        PROMPT_LOGPROBS,
        {"prompt_logprobs": 1},
        sampling=True,
        vllm="`prompt_logprobs`",
        vllm_key="prompt_logprobs",
    ),
    # -- Anthropic's Messages API (docs/api.md, "Anthropic Messages") --
    Field(
        "model",
        (MESSAGES,),
        "must name a served model (404 `not_found_error` otherwise)",
        asks={"model": "deepseek-v4"},
    ),
    Field(
        "messages",
        (MESSAGES,),
        "`user` and `assistant` turns of text, `tool_use`, `tool_result` and `thinking` "
        "blocks, rendered by the chat template; `image` and `document` blocks refused",
        asks={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
    ),
    Field(
        "system",
        (MESSAGES,),
        "the system message (a string, or text blocks joined by a blank line)",
        asks={"system": "Be brief."},
    ),
    Field(
        "tools",
        (MESSAGES,),
        "client tools (`input_schema` as the parameters), rendered by the chat template and "
        "read back as `tool_use` blocks; server tools refused",
        asks={"tools": [_ANTHROPIC_TOOL]},
    ),
    Field(
        "tool_choice",
        (MESSAGES,),
        "`auto`; `none`: no call parsed; `any` or `tool`: the answer is held to a call "
        "(constrained decoding, as chat's `required` and named function); "
        "`disable_parallel_tool_use`: one call",
        STRUCTURED_OUTPUTS,
        {"tools": [_ANTHROPIC_TOOL], "tool_choice": {"type": "any"}},
        when="`any`, `tool`",
        vllm="`structured_outputs.structural_tag`",
        vllm_key="structured_outputs",
    ),
    Field(
        "thinking",
        (MESSAGES,),
        "DeepSeek-V4's thinking mode on (`enabled`, `adaptive`, `between_tools`) or off "
        "(`disabled`); `max_tokens` bounds reasoning and answer together",
        asks={"thinking": {"type": "adaptive"}},
    ),
    Field(
        "output_config",
        (MESSAGES,),
        "`effort`: the template's reasoning effort; `format` (`json_schema`): the answer "
        "is held to the schema by constrained decoding",
        STRUCTURED_OUTPUTS,
        {"output_config": {"format": {"type": "json_schema", "schema": _WEATHER}}},
        when="`format`",
        vllm="`structured_outputs.json`",
        vllm_key="structured_outputs",
        refused_as="output_config.format",
    ),
    Field(
        "max_tokens",
        (MESSAGES,),
        "required; at most this many tokens (capped by the server's limit)",
        asks={"max_tokens": 3},
        vllm="`max_tokens`",
        vllm_key="max_tokens",
    ),
    Field(
        "stop_sequences",
        (MESSAGES,),
        "stop strings, matched on the text by the frontend (`stop_reason: stop_sequence`)",
        asks={"stop_sequences": ["\n\n"]},
    ),
    Field(
        "temperature",
        (MESSAGES,),
        "sampling temperature (0-1, Anthropic's range)",
        asks={"temperature": 0.5},
        vllm="`temperature`",
        vllm_key="temperature",
    ),
    Field(
        "top_p",
        (MESSAGES,),
        "nucleus sampling",
        asks={"top_p": 0.9},
        vllm="`top_p`",
        vllm_key="top_p",
    ),
    Field(
        "top_k",
        (MESSAGES,),
        "sample among the k most likely tokens",
        TOP_K,
        {"top_k": 5},
        vllm="`top_k`",
        vllm_key="top_k",
    ),
    Field(
        "metadata",
        (MESSAGES,),
        "`user_id`: the chat request's `user` (informational)",
        asks={"metadata": {"user_id": "u-1"}},
    ),
    Field(
        "stream",
        (MESSAGES,),
        "Anthropic's event stream",
        asks={"stream": True},
    ),
    # -- OpenAI's Responses API (docs/api.md, "OpenAI Responses") --
    Field(
        "model",
        (RESPONSES,),
        "must name a served model (404 otherwise)",
        asks={"model": "deepseek-v4"},
    ),
    Field(
        "input",
        (RESPONSES,),
        "a string, or message, `function_call`, `function_call_output` and `reasoning` "
        "items, rendered by the chat template; images, files and item references refused",
        asks={"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
    ),
    Field(
        "instructions",
        (RESPONSES,),
        "the system message, first",
        asks={"instructions": "Be brief."},
    ),
    Field(
        "previous_response_id",
        (RESPONSES,),
        "continue a stored response of this process (its conversation first)",
        asks={"previous_response_id": "<a stored response>"},
    ),
    Field(
        "store",
        (RESPONSES,),
        "keep the response in this process's bounded store (default true)",
        asks={"store": False},
    ),
    Field(
        "stream",
        (RESPONSES,),
        "the Responses event stream",
        asks={"stream": True},
    ),
    Field(
        "tools",
        (RESPONSES,),
        "function tools, rendered by the chat template and read back as `function_call` "
        "items; hosted tools refused",
        asks={"tools": [_RESPONSES_TOOL]},
    ),
    Field(
        "tool_choice",
        (RESPONSES,),
        "`auto`; `none`: no call parsed; `required` or a named function: the answer is held "
        "to a call (constrained decoding, as chat's)",
        STRUCTURED_OUTPUTS,
        {"tools": [_RESPONSES_TOOL], "tool_choice": "required"},
        when="`required`, a named function",
        vllm="`structured_outputs.structural_tag`",
        vllm_key="structured_outputs",
    ),
    Field(
        "parallel_tool_calls",
        (RESPONSES,),
        "`false`: one call at most (constrained to one where the engine constrains)",
        asks={"tools": [_RESPONSES_TOOL], "parallel_tool_calls": False},
    ),
    Field(
        "max_tool_calls",
        (RESPONSES,),
        "the answer keeps that many calls, the first ones",
        asks={"tools": [_RESPONSES_TOOL], "max_tool_calls": 1},
    ),
    Field(
        "max_output_tokens",
        (RESPONSES,),
        "at most this many tokens (capped by the server's limit); cut: `incomplete`",
        asks={"max_output_tokens": 3},
        vllm="`max_tokens`",
        vllm_key="max_tokens",
    ),
    Field(
        "temperature",
        (RESPONSES,),
        "sampling temperature",
        asks={"temperature": 0.5},
        vllm="`temperature`",
        vllm_key="temperature",
    ),
    Field(
        "top_p",
        (RESPONSES,),
        "nucleus sampling",
        asks={"top_p": 0.9},
        vllm="`top_p`",
        vllm_key="top_p",
    ),
    Field(
        "reasoning",
        (RESPONSES,),
        "`effort`: DeepSeek-V4's chat mode (`none`) or thinking mode; `summary` accepted, the "
        "reasoning comes whole",
        asks={"reasoning": {"effort": "high"}},
    ),
    Field(
        "text",
        (RESPONSES,),
        "`format`: `text`; `json_object`, `json_schema`: the answer is held to JSON (to the "
        "schema) by constrained decoding",
        STRUCTURED_OUTPUTS,
        {"text": {"format": {"type": "json_schema", "name": "weather", "schema": _WEATHER}}},
        when="`json_object`, `json_schema`",
        vllm="`structured_outputs.json` / `.json_object`",
        vllm_key="structured_outputs",
        refused_as="text.format",
    ),
    Field(
        "include",
        (RESPONSES,),
        "`reasoning.encrypted_content`: reasoning items carry it; logprobs refused",
        asks={"include": ["reasoning.encrypted_content"]},
    ),
    Field(
        "truncation",
        (RESPONSES,),
        "`disabled`; `auto` refused (a prompt over the context is a 400)",
        asks={"truncation": "disabled"},
    ),
    Field(
        "background",
        (RESPONSES,),
        "refused: responses are served while the client waits",
        asks={"background": True},
        refused=True,
    ),
    Field(
        "top_logprobs",
        (RESPONSES,),
        "refused above 0: output items carry no logprobs",
        asks={"top_logprobs": 2},
        refused=True,
    ),
    Field(
        "metadata",
        (RESPONSES,),
        "echoed in the response",
        asks={"metadata": {"k": "v"}},
    ),
    Field(
        "user",
        (RESPONSES,),
        "the chat request's `user` (informational)",
        asks={"user": "u-1"},
    ),
)


def rows(route: str) -> list[Field]:
    """The fields of *route*'s body (and, on the token-in API, of its sampling_params)."""
    return [f for f in FIELDS if route in f.routes]


def markdown(engines: dict[str, Capabilities], routes: tuple[str, ...] = EVERY) -> str:
    """The table of *routes* (one of :data:`TABLES`) as docs/api.md publishes it: a row
    per field, a column per engine (its verdict by its declaration in *engines*), what
    headwater does with it."""
    names = list(engines)
    lines = [
        "| field | routes | " + " | ".join(names) + " | what headwater does |",
        "|---|---|" + "---|" * len(names) + "---|",
    ]
    for f in FIELDS:
        if not set(f.routes) <= set(routes):
            continue
        shown = ", ".join(f.routes)
        if f.sampling and GENERATE in f.routes:
            shown += (
                " (in `sampling_params`)"
                if len(f.routes) == 1
                else " (generate: in `sampling_params`)"
            )
        verdicts = []
        for name, caps in engines.items():
            verdict = f.verdict(caps)
            note = f.mocker if name == "mocker" and verdict == "honoured" else ""
            note = f.vllm if name == "vllm" and verdict == "honoured" else note
            verdicts.append(f"{verdict}: {note}" if note else verdict)
        lines.append(f"| `{f.name}` | {shown} | " + " | ".join(verdicts) + f" | {f.does} |")
    return "\n".join(lines) + "\n"
