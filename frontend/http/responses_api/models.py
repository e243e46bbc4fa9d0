"""The Responses API's bodies, as OpenAI documents them: what ``POST /v1/responses``
validates with, and what ``/openapi.json`` publishes.

As :mod:`frontend.http.models`: msgspec Structs decoded straight from the body, strict
about types, lenient about unknown fields (skipped unbuilt), every list, string and
mapping bounded (:mod:`frontend.http.bounds`). Input items and content parts are tagged
by ``type``; a message item may leave its ``type`` out (OpenAI's "easy" input message):
the route decodes each item on its own (:class:`ResponsesWire`), a message with no
``type`` as a message. Items, parts and tools of kinds headwater cannot serve (images,
files, hosted tools) validate and are refused by the translation with a message that
says why, or fail validation naming the field.

Names start with ``Responses`` or ``Out`` where other models have the same noun.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from frontend.http.bounds import FreeFormObject, FreeFormObjectOrNull, Name, NonEmptyStr
from frontend.limits import MAX_NAME_CHARS, MAX_PARTS

Parts = Meta(max_length=MAX_PARTS)

# -- request: content parts and input items ------------------------------------------------


class _Part(Struct, kw_only=True, tag_field="type"):
    pass


class InputText(_Part, kw_only=True, tag="input_text"):
    text: str


class InputImage(_Part, kw_only=True, tag="input_image"):
    """Refused: no multimodal engine."""

    image_url: str | None = None
    file_id: Name | None = None


class InputFile(_Part, kw_only=True, tag="input_file"):
    """Refused: no file engine."""

    file_id: Name | None = None
    file_data: str | None = None


class OutputText(_Part, kw_only=True, tag="output_text"):
    """An earlier answer's text, sent back in an assistant message."""

    text: str


class Refusal(_Part, kw_only=True, tag="refusal"):
    refusal: str


InputContent = InputText | InputImage | InputFile | OutputText | Refusal
Contents = str | Annotated[list[InputContent], Parts]


class _Item(Struct, kw_only=True, tag_field="type"):
    id: Name | None = None
    status: Name | None = None


class MessageItem(_Item, kw_only=True, tag="message"):
    """A message; its ``type`` may be left out (OpenAI's "easy" input message)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: Contents


#: Tagged Structs whose ``type`` a client may leave out (the route fills it in before
#: validation); ``/openapi.json`` does not require it of them.
TAG_OPTIONAL: tuple[type[Struct], ...] = (MessageItem,)


class FunctionCallItem(_Item, kw_only=True, tag="function_call"):
    """A call an earlier answer made."""

    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str


class FunctionCallOutputItem(_Item, kw_only=True, tag="function_call_output"):
    """A call's result, for ``call_id``."""

    call_id: NonEmptyStr
    output: Contents


# Structs that are never in a union with another Struct have a required ``type`` field
# rather than a tag: msgspec takes a lone tagged Struct without its tag.


class SummaryText(Struct, kw_only=True):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Struct, kw_only=True):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item, kw_only=True, tag="reasoning"):
    """An earlier answer's reasoning: its ``content`` (or, from headwater, its
    ``encrypted_content``) is rendered back into the prompt."""

    summary: Annotated[list[SummaryText], Parts] = []
    content: Annotated[list[ReasoningText], Parts] | None = None
    encrypted_content: str | None = None


class ItemReference(_Item, kw_only=True, tag="item_reference"):
    """Refused: send the item itself, or previous_response_id."""


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference


class ItemHead(Struct, kw_only=True):
    """What an input item's kind is read from, before it is decoded whole (the rest of
    it is skipped unbuilt)."""

    type: Name | None = None
    role: Name | None = None


# -- request: tools and options ---------------------------------------------------------------


class FunctionTool(Struct, kw_only=True):
    """A function the model may call (the only kind of tool served: hosted tools such
    as ``web_search`` fail validation)."""

    type: Literal["function"]
    name: NonEmptyStr
    parameters: FreeFormObjectOrNull | UnsetType = UNSET  # a JSON Schema
    description: str | None = None
    strict: bool | None = None


class ToolChoiceFunction(Struct, kw_only=True):
    type: Literal["function"]
    name: NonEmptyStr


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ReasoningOptions(Struct, kw_only=True):
    effort: (
        Annotated[
            Effort,
            Meta(
                description=(
                    "none: DeepSeek-V4's chat mode; minimal to high: its thinking mode; xhigh and "
                    "max: thinking at its maximum effort"
                )
            ),
        ]
        | None
    ) = None
    summary: (
        Annotated[
            Name,
            Meta(
                description=(
                    "accepted: the reasoning comes whole, as reasoning_text content, not summarized"
                )
            ),
        ]
        | None
    ) = None
    generate_summary: Name | None = None


class TextFormat(Struct, kw_only=True):
    type: Annotated[
        Literal["text", "json_object", "json_schema"],
        Meta(
            description=(
                "text; json_object and json_schema hold the answer to JSON (to the schema) by "
                "constrained decoding, on engines that declare it"
            )
        ),
    ]
    name: Name | None = None
    schema: FreeFormObject | UnsetType = UNSET
    strict: bool | None = None


class TextOptions(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: Name | None = None


class ResponsesRequest(Struct, kw_only=True):
    """The body of ``POST /v1/responses``. Fields not listed are ignored."""

    model: Annotated[
        str, Meta(min_length=1, max_length=MAX_NAME_CHARS, description="the served model's name")
    ]
    input: Annotated[
        str | list[InputItem],
        Meta(
            description=(
                "a user message's text, or items: messages, function calls and their outputs, "
                "reasoning"
            )
        ),
    ]
    instructions: str | None = None
    previous_response_id: NonEmptyStr | None = None
    store: (
        Annotated[
            bool,
            Meta(
                description=(
                    "keep the response for previous_response_id and GET (true, as OpenAI's)"
                )
            ),
        ]
        | None
    ) = None
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    include: Annotated[list[Name], Parts] | None = None
    truncation: (
        Annotated[
            Literal["disabled", "auto"],
            Meta(description=("disabled; auto is refused (a prompt over the context is a 400)")),
        ]
        | None
    ) = None
    background: Annotated[bool, Meta(description="not supported: only false")] | None = None
    top_logprobs: Annotated[int, Meta(description="not supported: only null or 0")] | None = None
    metadata: Annotated[dict[Name, str], Parts] | None = None
    user: Name | None = None


class ResponsesWire(ResponsesRequest, kw_only=True):
    """:class:`ResponsesRequest` as the route decodes it: the input items kept as their
    text, each then decoded on its own (an "easy" message has no ``type`` to be told
    apart by: :func:`frontend.http.responses_api.translate.decode_items`)."""

    input: str | list[Raw]  # type: ignore[assignment]


# -- responses (documentation: frontend.http.responses_api.format builds them) -------------


class OutReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]
    encrypted_content: str | None = None


class OutOutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutOutputText]


class OutFunctionCall(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutReasoningItem | OutMessage | OutFunctionCall


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: Annotated[
        int,
        Meta(description=("tokens generated up to the reasoning's end (its closing tag included)")),
    ]


class ResponsesUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseError(Struct, kw_only=True):
    code: str
    message: str


class Response(Struct, kw_only=True):
    """A response: what ``POST /v1/responses`` answers (unary), ``GET`` returns, and
    the lifecycle events of a stream carry."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponsesUsage | None
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class ResponsesStreamEvent(Struct, kw_only=True):
    """One event of a Responses stream (its SSE ``event:`` line names its ``type``):
    ``response.created``, ``response.in_progress``, ``response.output_item.added``,
    ``response.content_part.added``, ``response.output_text.delta``,
    ``response.reasoning_text.delta``, ``response.function_call_arguments.delta``, their
    ``.done`` events, ``response.output_item.done``, then ``response.completed`` (or
    ``response.incomplete``; ``error`` and ``response.failed`` for a failure)."""

    type: str
    sequence_number: int
    response: Response | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: dict[str, Any] | None = None  # an empty output_text or reasoning_text part
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[Any] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None
