"""The public API's bodies as declarative models: what the server validates with, and what
``GET /openapi.json`` publishes (:mod:`frontend.http.openapi`), so the two cannot drift.

Why msgspec (``msgspec.Struct``), not pydantic: its conversion is strict by default in
exactly the way this API has always been (``true`` is not an integer, ``"5"`` is not a
number, an integer is a number), it ignores unknown fields unless told otherwise, and
its JSON Schema output (``msgspec.json.schema_components``) is JSON Schema 2020-12, the
dialect of OpenAPI 3.1. It is also the cheaper of the two on the event loop and in
memory: validating a short chat body takes it ~0.4 µs against pydantic's ~2.1 µs
(``model_validate_json``), and importing it adds ~4 MB of RSS where pydantic adds ~18
(idle RSS is held under 300 MB). Parsing as a whole costs what the hand-written checks
it replaces did (``scripts/measure/parse.py``, docs/performance.md: a ~40k-token chat
body 72.1-72.6 µs before, 72.8-73.3 after, most of it the JSON decode; a short one
5.3 → 5.2 µs). Its errors come as one string with a JSON path, which
:mod:`frontend.http.schema` turns into OpenAI's ``param``.

How they are used: the body's bytes are decoded straight into the route's model by
msgspec, in one pass in C (:mod:`frontend.http.schema`), which refuses lone surrogates and
invalid UTF-8 and skips a field the model does not declare without building anything of
it. Every list, string and mapping is bounded: by a fixed bound here
(:data:`~frontend.limits.MAX_NAME_CHARS`, :data:`~frontend.limits.MAX_PARTS`), or by a
configured limit the parser checks and the OpenAPI document publishes (messages, tools,
stop strings and ids, prompt text). Free-form JSON (a tool's ``parameters``, an object's
tool-call ``arguments``, ``chat_template_kwargs``) is kept as its raw text
(``msgspec.Raw``) until its size and shape are checked, then decoded. The chat template
gets the messages and tools as these models declare them, as vLLM's server passes them:
role, content, name, tool calls and their id, reasoning.

:data:`REQUEST_MODELS` names the model of each POST route; both the parser and the
OpenAPI document read it, so a field added here is checked and published at once. The
response models describe the success bodies (built by :mod:`frontend.http.responses`
for speed); the schemathesis test checks live responses against them.

What the models cannot say is checked after them, in :mod:`frontend.http.schema`:
fields that depend on each other (``top_logprobs`` needs ``logprobs``, ``best_of``
and ``n``), requests for what headwater cannot do (stop strings on the token-in API)
and the configured limits (:mod:`frontend.limits`), which the OpenAPI document
states as ``maxItems``, ``maximum`` and so on from the same config. Every field of the
chat, completions and token-in bodies is honoured or refused, on each engine: the table
of :mod:`frontend.http.fields` says which, and docs/api.md ("Fields") publishes it.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from frontend.http.anthropic import models as anthropic
from frontend.http.bounds import FREE_FORM as _FREE_FORM
from frontend.http.bounds import (
    FreeFormObject,
    FreeFormObjectOrNull,
    Name,
    NonEmptyStr,
    NonEmptyText,
)
from frontend.http.responses_api import models as responses_api
from frontend.limits import MAX_NAME_CHARS, MAX_PARTS

# -- shared pieces ------------------------------------------------------------------------

# Names, ids and free-form JSON: frontend.http.bounds.
TokenId = Annotated[int, Meta(ge=0, description="a token id of the served model's vocabulary")]
Temperature = Annotated[float, Meta(ge=0, le=2, description="sampling temperature (1)")]
TopP = Annotated[float, Meta(ge=0, le=1, description="nucleus sampling mass (1)")]
Penalty = Annotated[
    float, Meta(ge=-2, le=2, description=("OpenAI's penalty on tokens already generated (0: none)"))
]
TopK = Annotated[
    int, Meta(ge=-1, description=("sample among the k most likely tokens (vLLM's; 0 or -1: all)"))
]
MinP = Annotated[
    float,
    Meta(
        ge=0,
        le=1,
        description=(
            "drop tokens less likely than min_p times the most likely one (vLLM's; 0: none)"
        ),
    ),
]
RepetitionPenalty = Annotated[
    float,
    Meta(
        gt=0,
        le=2,
        description=(
            "vLLM's multiplicative penalty on tokens of the prompt and the output (1: none)"
        ),
    ),
]
LogitBias = Annotated[
    dict[str, Annotated[float, Meta(ge=-100, le=100)]],
    Meta(
        max_length=MAX_PARTS,
        description=("token id (as a string) to a bias from -100 to 100 added to its logit"),
    ),
]
MaxTokens = Annotated[
    int,
    Meta(
        ge=1,
        description=(
            "tokens to generate at most; absent: what the context length leaves, up to the "
            "server's cap"
        ),
    ),
]
#: Most choices one request may ask for (``n``): OpenAI's own bound.
MAX_N = 128
#: Most top logprobs per position: OpenAI's bound for chat's ``top_logprobs``, and
#: vLLM's default ``--max-logprobs`` for the other APIs.
MAX_LOGPROBS = 20
N = Annotated[
    int,
    Meta(
        ge=1,
        le=MAX_N,
        description=(
            "choices to generate, each sampled on its own (with a seed, seed + index) (1)"
        ),
    ),
]
BestOf = Annotated[
    int,
    Meta(
        ge=1,
        le=MAX_N,
        description=("only null or n: candidates are not generated beyond the n returned"),
    ),
]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Meta(min_length=1)]


class StreamOptions(Struct, kw_only=True):
    """Options of a streamed response."""

    include_usage: bool | None = None


class _Sampling(Struct, kw_only=True):
    """The generation options both APIs share (the OpenAI body itself; the token-in
    API's ``sampling_params``)."""

    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: N | None = None
    best_of: BestOf | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None


class TextFormat(Struct, kw_only=True, tag_field="type", tag="text", forbid_unknown_fields=True):
    """Plain text: no constraint (the default)."""


class JsonObjectFormat(
    Struct, kw_only=True, tag_field="type", tag="json_object", forbid_unknown_fields=True
):
    """Any JSON object, by constrained decoding."""


class JsonSchemaSpec(Struct, kw_only=True):
    name: NonEmptyStr
    description: str | None = None
    schema: FreeFormObject | UnsetType = UNSET  # a JSON Schema; absent: any JSON object
    strict: bool | None = None


class JsonSchemaFormat(
    Struct, kw_only=True, tag_field="type", tag="json_schema", forbid_unknown_fields=True
):
    """JSON valid against ``json_schema.schema``, by constrained decoding."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class _OpenAIRequest(_Sampling, kw_only=True):
    """The fields chat and completions share."""

    model: Annotated[
        str, Meta(min_length=1, max_length=MAX_NAME_CHARS, description="the served model's name")
    ]
    max_tokens: MaxTokens | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    user: Name | None = None
    top_logprobs: (
        Annotated[
            TopLogprobs,
            Meta(
                description=(
                    "chat: the most likely tokens to list at each position (needs logprobs); "
                    "completions: only null (use logprobs)"
                )
            ),
        ]
        | None
    ) = None
    response_format: ResponseFormat | None = None


# -- chat -----------------------------------------------------------------------------------


class TextPart(Struct, kw_only=True):
    """A text part of a message's content (the only kind served)."""

    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Meta(max_length=MAX_PARTS)]


class FunctionCall(Struct, kw_only=True):
    name: Name
    #: A JSON string (OpenAI's form) or an object; kept as its text until checked.
    arguments: Annotated[
        Raw,
        Meta(
            extra_json_schema={
                "anyOf": [
                    {"type": "string"},
                    {"type": "object", "maxProperties": MAX_PARTS, "description": _FREE_FORM},
                ]
            }
        ),
    ]


class ToolCall(Struct, kw_only=True):
    """A tool call an assistant turn made."""

    function: FunctionCall
    id: Name | None = None
    type: Name | None = None


class _Message(Struct, kw_only=True, tag_field="role"):
    name: Name | None = None


class SystemMessage(_Message, kw_only=True, tag="system"):
    content: Content


class DeveloperMessage(_Message, kw_only=True, tag="developer"):
    content: Content


class UserMessage(_Message, kw_only=True, tag="user"):
    content: Content


class AssistantMessage(_Message, kw_only=True, tag="assistant"):
    content: Content | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_PARTS)] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for the same


class ToolMessage(_Message, kw_only=True, tag="tool"):
    content: Content
    tool_call_id: Name | None = None


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDefinition(Struct, kw_only=True):
    name: Name
    description: str | None = None
    parameters: FreeFormObjectOrNull | UnsetType = UNSET  # a JSON Schema (null: none)


class Tool(Struct, kw_only=True):
    """A tool the model may call; rendered into the prompt by the chat template."""

    function: FunctionDefinition
    type: Name | None = None


class ToolChoiceFunction(Struct, kw_only=True):
    name: Name


#: Another mode (Anthropic's "any", a typo) is refused, not taken for "auto".
ToolChoiceMode = Literal["none", "auto", "required"]


class NamedToolChoice(Struct, kw_only=True):
    """A ``tool_choice`` that names the function to call."""

    function: ToolChoiceFunction
    type: Literal["function"] | None = None


ToolChoice = ToolChoiceMode | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_OpenAIRequest, kw_only=True):
    """The body of ``POST /v1/chat/completions``. Fields not listed are ignored."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: (
        Annotated[
            bool, Meta(description=("each generated token's logprob (choices[].logprobs.content)"))
        ]
        | None
    ) = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: FreeFormObjectOrNull | UnsetType = UNSET


# -- completions ----------------------------------------------------------------------------


class CompletionRequest(_OpenAIRequest, kw_only=True):
    """The body of ``POST /v1/completions``. Fields not listed are ignored."""

    prompt: Annotated[
        NonEmptyText | list[str | int | list[int]],
        Meta(
            description=(
                "a string, or token ids; a list holding one of either is that one (one prompt "
                "per request)"
            )
        ),
    ]
    max_completion_tokens: MaxTokens | None = None
    logprobs: (
        Annotated[
            TopLogprobs | bool,
            Meta(
                description=(
                    "each token's logprob and the logprobs most likely tokens at its position "
                    "(false: none)"
                )
            ),
        ]
        | None
    ) = None
    echo: (
        Annotated[
            bool,
            Meta(
                description=(
                    "the prompt's text before the answer's (and with logprobs, its tokens' first)"
                )
            ),
        ]
        | None
    ) = None
    suffix: (
        Annotated[
            str,
            Meta(
                description=(
                    "text after the completion: the prompt is framed for fill-in-the-middle"
                )
            ),
        ]
        | None
    ) = None


# -- the token-in API -----------------------------------------------------------------------


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``StructuredOutputsParams``: exactly one constraint (its other options are
    refused, not ignored)."""

    #: A JSON schema, or its text; kept as its text until checked.
    json: (
        Annotated[
            Raw,
            Meta(
                extra_json_schema={
                    "anyOf": [
                        {"type": "string"},
                        {"type": "object", "maxProperties": MAX_PARTS, "description": _FREE_FORM},
                    ]
                }
            ),
        ]
        | UnsetType
    ) = UNSET
    regex: str | None = None
    choice: Annotated[list[Name], Meta(max_length=MAX_PARTS)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class SamplingParams(_Sampling, kw_only=True):
    """How to generate, in vLLM's ``SamplingParams`` shape; fields not listed
    (``skip_special_tokens``, ...) are ignored."""

    max_tokens: MaxTokens | None = None
    logprobs: (
        Annotated[
            TopLogprobs,
            Meta(
                description=(
                    "each generated token's logprob and this many most likely tokens"
                    " (choices[].logprobs)"
                )
            ),
        ]
        | None
    ) = None
    prompt_logprobs: (
        Annotated[
            TopLogprobs,
            Meta(
                description=("the same for the prompt's tokens (prompt_logprobs; not with stream)")
            ),
        ]
        | None
    ) = None
    stop: (
        Annotated[
            str | list[str],
            Meta(
                description=(
                    "not supported (no text to match on): only null or []; use stop_token_ids"
                )
            ),
        ]
        | None
    ) = None
    structured_outputs: StructuredOutputs | None = None


class GenerateRequest(Struct, kw_only=True):
    """The body of ``POST /inference/v1/generate``: token ids in, vLLM's shape."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1)]
    sampling_params: SamplingParams | None = None
    request_id: NonEmptyStr | None = None
    model: NonEmptyStr | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str], Meta(description="not supported: only null or []")] | None = (
        None
    )


# -- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------


class TokenizeRequest(Struct, kw_only=True):
    """The body of ``POST /tokenize``: a ``prompt`` (vLLM's ``TokenizeCompletionRequest``)
    or chat ``messages`` (its ``TokenizeChatRequest``, the chat template applied), one of
    the two. Fields not listed are ignored."""

    #: Exactly one of these fields is given: /openapi.json says so.
    one_of: ClassVar[tuple[str, ...]] = ("prompt", "messages")

    model: NonEmptyStr | None = None
    prompt: Annotated[str, Meta(description="text to tokenize (or send messages)")] | UnsetType = (
        UNSET
    )
    messages: (
        Annotated[
            list[ChatMessage],
            Meta(
                min_length=1,
                description=(
                    "a conversation, rendered by the chat template, then tokenized (or send prompt)"
                ),
            ),
        ]
        | UnsetType
    ) = UNSET
    add_special_tokens: (
        Annotated[
            bool,
            Meta(
                description=(
                    "add the tokenizer's special tokens around the text (true for a prompt, false "
                    "for messages, whose template writes them)"
                )
            ),
        ]
        | None
    ) = None
    return_token_strs: (
        Annotated[bool, Meta(description="also return each token's string")] | None
    ) = None
    add_generation_prompt: (
        Annotated[
            bool,
            Meta(description=("messages: open the assistant's turn after the last message (true)")),
        ]
        | None
    ) = None
    continue_final_message: (
        Annotated[bool, Meta(description="not supported: only false")] | None
    ) = None
    chat_template: Annotated[str, Meta(description="not supported: only null")] | None = None
    chat_template_kwargs: FreeFormObjectOrNull | UnsetType = UNSET
    tools: list[Tool] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    """The body of ``POST /detokenize``: token ids back to text (special tokens kept)."""

    tokens: Annotated[list[TokenId], Meta(description="at most the context length")]
    model: NonEmptyStr | None = None


#: The model each POST route validates its body with, by endpoint; read by the parser
#: and by the OpenAPI document alike.
REQUEST_MODELS: dict[str, type[Struct]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "generate": GenerateRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
    "messages": anthropic.MessagesRequest,
    "count_tokens": anthropic.CountTokensRequest,
    "responses": responses_api.ResponsesRequest,
}


# -- responses (documentation: frontend.http.responses builds them) -------------------------

FinishReason = Literal["stop", "length", "cancelled"]


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseMessage(Struct, kw_only=True):
    role: Literal["assistant"]
    content: str


class TopLogprob(Struct, kw_only=True):
    """A token and its logprob (natural log; -9999.0 for one the model rules out);
    ``bytes``: its UTF-8 bytes (a token may hold part of a character, whose ``token``
    then shows the bytes escaped, ``\\xe4``)."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob, kw_only=True):
    """A generated token's logprob, and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, kw_only=True):
    """A chat choice's logprobs: one entry per token of its content (of a chunk's
    content, streamed)."""

    content: list[TokenLogprob] | None


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None


class ChatCompletion(Struct, kw_only=True):
    """A whole chat completion (``stream`` false)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None


class ChatCompletionChunk(Struct, kw_only=True):
    """One event of a chat stream; the last before ``[DONE]`` has empty ``choices`` and
    the usage when ``stream_options.include_usage`` was asked."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(Struct, kw_only=True):
    """A completion choice's logprobs, one entry per token of its text (the prompt's
    first with ``echo``, whose first token has null ones): the tokens, their logprobs,
    the most likely tokens at each position with the token itself (``logprobs`` + 1 at
    most), and where each token's text begins in ``text``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None


class Completion(Struct, kw_only=True):
    """A text completion; a stream sends one per event (with the new text), the same
    shape."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateTopLogprob(Struct, kw_only=True):
    """A token id, its logprob and rank (null: unknown), vLLM's shape."""

    token_id: int
    logprob: float
    rank: int | None


class GenerateTokenLogprob(GenerateTopLogprob, kw_only=True):
    """A generated token's logprob; ``top_logprobs`` in vLLM's order: the token first,
    then the most likely ones, ``logprobs`` entries (1 for 0)."""

    top_logprobs: list[GenerateTopLogprob]


class GenerateLogprobs(Struct, kw_only=True):
    content: list[GenerateTokenLogprob] | None


class TokenChoice(Struct, kw_only=True):
    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: GenerateLogprobs | None


class PromptLogprob(Struct, kw_only=True):
    logprob: float
    rank: int | None
    decoded_token: str | None


class GenerateResponse(Struct, kw_only=True):
    """The token-in API's answer; a stream sends one per event (the new ids), the usage
    in a last one with empty ``choices``. ``request_id`` is ``generate-tokens-<id>``.
    ``prompt_logprobs`` (unary, when asked): null for the first prompt token, then per
    token its own and the most likely tokens' logprobs keyed by token id (vLLM's shape)."""

    request_id: str
    choices: list[TokenChoice]
    usage: TokenUsage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class TokenizeResponse(Struct, kw_only=True):
    """``/tokenize``'s answer: the ids, their count, and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Struct, kw_only=True):
    object: Literal["list"]
    data: list[ModelCard]


class WorkerStatus(Struct, kw_only=True):
    worker_id: str
    role: str
    state: str


class Health(Struct, kw_only=True):
    """Readiness: 200 ``healthy``; 503 ``unhealthy`` (no routable worker pair) or
    ``draining`` (shutting down)."""

    status: Literal["healthy", "unhealthy", "draining"]
    workers: list[WorkerStatus]


class Live(Struct, kw_only=True):
    status: Literal["live"]


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, kw_only=True):
    """Every error, OpenAI's shape; after a stream started, the data of an ``error``
    event, followed by ``[DONE]``."""

    error: ErrorDetail
