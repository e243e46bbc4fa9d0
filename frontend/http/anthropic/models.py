"""The Messages API's bodies, as Anthropic documents them: what ``/v1/messages`` and
``/v1/messages/count_tokens`` validate with, and what ``/openapi.json`` publishes.

As :mod:`frontend.http.models`: msgspec Structs decoded straight from the body, strict
about types and lenient about unknown fields (clients send many: ``cache_control``,
``container``, ``service_tier``, beta fields: skipped unbuilt), every list, string and
mapping bounded (:mod:`frontend.http.bounds`); free-form JSON (a tool's
``input_schema``, a ``tool_use``'s ``input``) kept as its text until checked. Content
blocks and choices are tagged by ``type``; a block of a type headwater cannot serve
(``image``, ``document``) validates, and the translation refuses it with a message that
says why (:mod:`frontend.http.anthropic.translate`).

Names start with ``Anthropic`` where OpenAI's models have the same noun (``Tool``,
``Usage``): the document's components are named after the classes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from frontend.http.bounds import FreeFormObject, FreeFormObjectOrNull, Name, NonEmptyStr
from frontend.limits import MAX_NAME_CHARS, MAX_PARTS

Parts = Meta(max_length=MAX_PARTS)

# -- request: content blocks -------------------------------------------------------------


class _Block(Struct, kw_only=True, tag_field="type"):
    pass  # cache_control is not declared: the engine's prefix cache is automatic


class TextBlock(_Block, kw_only=True, tag="text"):
    text: str


class ImageBlock(_Block, kw_only=True, tag="image"):
    """Refused: no multimodal engine."""

    source: FreeFormObject


class DocumentBlock(_Block, kw_only=True, tag="document"):
    """Refused: no document engine."""

    source: FreeFormObject


class ToolUseBlock(_Block, kw_only=True, tag="tool_use"):
    """A tool call the assistant made (in an assistant message)."""

    id: Name
    name: Name
    input: FreeFormObject


ToolResultContent = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(_Block, kw_only=True, tag="tool_result"):
    """A tool's result (in a user message), for the call ``tool_use_id``."""

    tool_use_id: Name
    content: str | Annotated[list[ToolResultContent], Parts] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block, kw_only=True, tag="thinking"):
    """The assistant's reasoning, as an earlier answer gave it."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, kw_only=True, tag="redacted_thinking"):
    """Reasoning another server hid; there is nothing to render of it."""

    data: str


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class AnthropicMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Parts]


# -- request: tools, choices, thinking --------------------------------------------------


class AnthropicTool(Struct, kw_only=True):
    """A client tool: its name, what it does, its input's JSON Schema. (Anthropic's
    server tools have no ``input_schema`` and are refused by validation.)"""

    name: NonEmptyStr
    input_schema: FreeFormObject
    description: str | None = None
    type: Literal["custom"] | None = None


class _ToolChoice(Struct, kw_only=True, tag_field="type"):
    pass


class ToolChoiceAuto(_ToolChoice, kw_only=True, tag="auto"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_ToolChoice, kw_only=True, tag="any"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_ToolChoice, kw_only=True, tag="tool"):
    name: NonEmptyStr
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_ToolChoice, kw_only=True, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class _Thinking(Struct, kw_only=True, tag_field="type"):
    pass


Display = Annotated[
    Literal["summarized", "omitted"],
    Meta(description=("omitted: thinking blocks come without their text")),
]


class ThinkingEnabled(_Thinking, kw_only=True, tag="enabled"):
    budget_tokens: Annotated[
        int,
        Meta(
            ge=1024,
            description=(
                "at least 1024 and below max_tokens, as Anthropic requires; max_tokens bounds "
                "the reasoning and the answer together"
            ),
        ),
    ]
    display: Display | None = None


class ThinkingDisabled(_Thinking, kw_only=True, tag="disabled"):
    pass


class ThinkingAdaptive(_Thinking, kw_only=True, tag="adaptive"):
    display: Display | None = None


class ThinkingBetweenTools(_Thinking, kw_only=True, tag="between_tools"):
    """Thinking mode on: DeepSeek-V4 reasons at every turn, between tool calls too."""

    display: Display | None = None


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools

Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(Struct, kw_only=True):
    effort: (
        Annotated[
            Effort,
            Meta(
                description=(
                    "with thinking on: max and xhigh ask DeepSeek-V4 for its maximum effort"
                )
            ),
        ]
        | None
    ) = None
    # Raw in a union with None decodes only null (msgspec): the null form carries it.
    format: (
        Annotated[
            FreeFormObjectOrNull,
            Meta(
                description=(
                    "structured outputs: {'type': 'json_schema', 'schema': {...}}, on engines "
                    "that declare constrained decoding"
                )
            ),
        ]
        | UnsetType
    ) = UNSET


class Metadata(Struct, kw_only=True):
    user_id: Name | None = None


class SystemBlock(Struct, kw_only=True):
    """A text block of ``system`` (its ``type`` required: a lone tagged Struct would
    take a block without one)."""

    type: Literal["text"]
    text: str


System = str | Annotated[list[SystemBlock], Parts]


# -- requests -----------------------------------------------------------------------------


class Conversation(Struct, kw_only=True):
    """What both routes read: the conversation and what is rendered with it."""

    model: Annotated[
        str, Meta(min_length=1, max_length=MAX_NAME_CHARS, description="the served model's name")
    ]
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: System | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(Conversation, kw_only=True):
    """The body of ``POST /v1/messages``. Fields not listed are ignored."""

    max_tokens: Annotated[int, Meta(ge=1, description="required, as Anthropic requires")]
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: (
        Annotated[
            int,
            Meta(ge=0, description="sample among the k most likely tokens, on engines that do"),
        ]
        | None
    ) = None
    metadata: Metadata | None = None
    stream: bool | None = None


class CountTokensRequest(Conversation, kw_only=True):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request's prompt."""


# -- responses (documentation: frontend.http.anthropic.format builds them) ---------------


class OutTextBlock(Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class OutThinkingBlock(Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


class OutToolUseBlock(Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutTextBlock | OutThinkingBlock | OutToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(Struct, kw_only=True):
    input_tokens: Annotated[int, Meta(description="prompt tokens not read from the cache")]
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: Annotated[
        int, Meta(description=("prompt tokens the engine had cached"))
    ]


class MessageResponse(Struct, kw_only=True):
    """A whole answer (``stream`` false)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[OutBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class CountTokensResponse(Struct, kw_only=True):
    input_tokens: int


class AnthropicErrorDetail(Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorResponse(Struct, kw_only=True):
    """Every error on these routes; after a stream started, the data of an ``error``
    event."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# -- stream events -------------------------------------------------------------------------


class MessageStartEvent(Struct, kw_only=True, tag_field="type", tag="message_start"):
    message: MessageResponse


class ContentBlockStartEvent(Struct, kw_only=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: OutBlock


class TextDelta(Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDeltaEvent(Struct, kw_only=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStopEvent(Struct, kw_only=True, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDelta(Struct, kw_only=True):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaEvent(Struct, kw_only=True, tag_field="type", tag="message_delta"):
    delta: MessageDelta
    usage: AnthropicUsage


class MessageStopEvent(Struct, kw_only=True, tag_field="type", tag="message_stop"):
    pass


class PingEvent(Struct, kw_only=True, tag_field="type", tag="ping"):
    pass


#: One event of a Messages stream (its SSE ``event:`` line names its ``type``).
StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
)
