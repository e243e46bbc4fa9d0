"""Request limits: how much one request may ask of this frontend, each refused with a 4xx.

:class:`RequestLimits` is the one config of the limits on a request's content and
duration; each field is a ``headwater serve`` option (``--max-messages`` ...,
``HEADWATER_MAX_MESSAGES`` ...) with the default documented beside it. Its ``check_*``
methods raise :class:`~frontend.errors.LimitExceeded`, naming the limit, the request
field (OpenAI's ``param``) and OpenAI's code for the kind of bound; the HTTP layer
answers 400 and counts the refusal in
``headwater_frontend_rejected_requests_total{reason=<limit>}`` (:data:`LIMITS`).

Two limits predate this config and keep their places: the body size
(``--max-body-bytes``, 413, reason ``max_body_bytes``) and the context length
(``--context-length``, :class:`~frontend.errors.ContextTooLong`, reason
``context_length``). docs/security.md, "Request limits", lists them all.

Why each one, and why its default (all generous: a benchmark's 40k-token prompts pass):

- ``max_tokens_cap``: a completion's length; 0 leaves the context length as the only
  bound, as vLLM does. A request without ``max_tokens`` gets what the context leaves,
  at most the cap.
- ``max_messages`` (2048, OpenAI's own limit): the template walks every message, on the
  loop for a short conversation.
- ``max_prompt_chars`` (2 MiB of characters, 16 per token of the default 131,072-token
  context where English averages about 4): a cheap count ahead of the template and the
  tokenizer, so that a 10 MB prompt costs a sum of lengths instead of seconds of
  tokenizer time before it is refused for its length. Raise it with a longer context.
- ``max_stop_strings`` (16) and ``max_stop_length`` (256 characters): the stop matcher
  (:mod:`frontend.postprocess.stop`) indexes every prefix of every stop string, on the
  loop, per request: 16 strings of 256 characters cost ~5 ms to set up, of 4096 about
  400 ms (measured on the 2-core bench machine).
- ``request_timeout`` (0: off): a deadline over preprocess, queueing and generation;
  a stream that outlives it ends with an ``error`` event. Off by default: a long
  generation is legitimate, and only an operator knows how long is too long.
- ``max_tools`` (128, OpenAI's own limit): each tool definition is rendered into the
  prompt by the template.
- ``max_stop_token_ids`` (256): the ids travel in every request frame to a worker, whose
  codec refuses a frame past its budget (about 140,000 ids once cut a worker's whole
  connection); a model has a handful of end tokens.
- ``max_json_values`` (524,288): the JSON values one body may hold, counted before it is
  parsed, so that the parse (on the event loop: a C parser holds the GIL, so a thread
  would not free the loop) and its memory are bounded whatever the body's size: ~32 MiB
  of ``[]`` once cost 1 GB and 3 s. Counted only for a body of more than twice as many
  bytes (a value takes two at least: ``0,``), as its commas, ``[`` and ``{``, those inside
  strings included; the token-in API's 131,072 ids of the default context take a quarter.

Every other list, string and mapping of a request has a fixed bound (the ``MAX_*``
constants below), published with the configured ones in ``GET /openapi.json``: names and
ids, parts of a message, the depth and size of free-form JSON (tool parameters, object
tool-call arguments, ``chat_template_kwargs``, whose text also counts against
``max_prompt_chars``).

Pure checks, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from frontend.errors import LimitExceeded

#: Every limit's name, as ``rejected_requests_total`` labels its refusals (the HTTP
#: layer creates each series at 0). The admission and auth reasons are elsewhere.
LIMITS = (
    "max_body_bytes",
    "context_length",
    "max_tokens_cap",
    "max_messages",
    "max_prompt_chars",
    "max_stop_strings",
    "max_stop_length",
    "request_timeout",
    "max_tools",
    "max_stop_token_ids",
    "max_json_values",
)

# Fixed bounds: what no client of an LLM API sends more of (each checked where the
# request is parsed, and published in the OpenAPI document).
#: Characters of a name or an id: the model's, a tool's, a tool call's, ``user``, ...
MAX_NAME_CHARS = 256
#: Content parts of one message, and tool calls of one assistant message.
MAX_PARTS = 1024
#: Nesting of free-form JSON (tool parameters, object arguments, template kwargs): a
#: tool's JSON Schema nests ~10 deep; 1,000 deep once ended in a 500.
MAX_JSON_DEPTH = 64
#: Objects and arrays in a request's free-form JSON, all together: building each costs
#: the loop ~0.1-0.4 us (a tool's schema has a few dozen; 128 tools a few thousand).
MAX_JSON_CONTAINERS = 16_384

# OpenAI's codes for a value past its bound, and headwater's for a body too complex.
ARRAY_TOO_LONG = "array_above_max_length"
STRING_TOO_LONG = "string_above_max_length"
INTEGER_TOO_LARGE = "integer_above_max_value"
JSON_TOO_COMPLEX = "json_too_complex"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The limits on one request (see the module docstring for each default's reason).
    0 turns a limit off. Raises ValueError for a negative or non-finite value."""

    max_tokens_cap: int = field(
        default=0,
        metadata={
            "help": "largest max_tokens a request may ask for (and the default when it asks "
            "none); 0: only the context length bounds it"
        },
    )
    max_messages: int = field(
        default=2048, metadata={"help": "most messages in one chat request (0: no limit)"}
    )
    max_prompt_chars: int = field(
        default=2 * 1024 * 1024,
        metadata={
            "help": "most characters of message content (or of a completions prompt) in one "
            "request, counted before the template and the tokenizer (0: no limit)"
        },
    )
    max_stop_strings: int = field(
        default=16, metadata={"help": "most stop strings in one request (0: no limit)"}
    )
    max_stop_length: int = field(
        default=256, metadata={"help": "most characters in one stop string (0: no limit)"}
    )
    request_timeout: float = field(
        default=0.0,
        metadata={
            "help": "seconds a generation request may take, from its arrival to its last "
            "byte: preprocess, queueing and generation; then 504, or an error event "
            "in a stream, and the work is cancelled on the worker (0: no deadline)"
        },
    )
    max_tools: int = field(
        default=128, metadata={"help": "most tool definitions in one chat request (0: no limit)"}
    )
    max_stop_token_ids: int = field(
        default=256, metadata={"help": "most stop_token_ids in one request (0: no limit)"}
    )
    max_json_values: int = field(
        default=512 * 1024,
        metadata={
            "help": "most JSON values in one request body, counted before it is parsed (its "
            "commas, [ and {, strings included) when it is larger than twice this "
            "many bytes (0: no limit)"
        },
    )

    def __post_init__(self) -> None:
        for name in (
            "max_tokens_cap",
            "max_messages",
            "max_prompt_chars",
            "max_stop_strings",
            "max_stop_length",
            "request_timeout",
            "max_tools",
            "max_stop_token_ids",
            "max_json_values",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # NaN too
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}")

    # -- checks ------------------------------------------------------------------------

    def check_max_tokens(self, value: int | None, param: str) -> None:
        """*value*, the request's ``max_tokens`` (named *param*), is within the cap."""
        cap = self.max_tokens_cap
        if cap and value is not None and value > cap:
            raise LimitExceeded(
                f"'{param}' is too large: {value}. This server allows at most {cap} "
                "completion tokens per request.",
                limit="max_tokens_cap",
                param=param,
                code=INTEGER_TOO_LARGE,
            )

    def default_max_tokens(self, room: int) -> int:
        """The ``max_tokens`` of a request that asked none, given *room* (the tokens the
        context length leaves after its prompt)."""
        return min(room, self.max_tokens_cap) if self.max_tokens_cap else room

    def check_messages(self, count: int) -> None:
        limit = self.max_messages
        if limit and count > limit:
            raise LimitExceeded(
                f"'messages' holds {count} messages; this server takes at most {limit}.",
                limit="max_messages",
                param="messages",
                code=ARRAY_TOO_LONG,
            )

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """*chars*, the characters of the prompt's text (in *param*), are within the
        limit: checked before any template or tokenizer work."""
        limit = self.max_prompt_chars
        if limit and chars > limit:
            raise LimitExceeded(
                f"'{param}' holds {chars} characters of text; this server takes at most "
                f"{limit} per request.",
                limit="max_prompt_chars",
                param=param,
                code=STRING_TOO_LONG,
            )

    def check_tools(self, count: int) -> None:
        limit = self.max_tools
        if limit and count > limit:
            raise LimitExceeded(
                f"'tools' holds {count} tools; this server takes at most {limit}.",
                limit="max_tools",
                param="tools",
                code=ARRAY_TOO_LONG,
            )

    def check_stop_token_ids(self, count: int, param: str) -> None:
        limit = self.max_stop_token_ids
        if limit and count > limit:
            raise LimitExceeded(
                f"'{param}' holds {count} token ids; this server takes at most {limit}.",
                limit="max_stop_token_ids",
                param=param,
                code=ARRAY_TOO_LONG,
            )

    def check_json_values(self, values: int) -> None:
        """*values*, the JSON values counted in a body so far, are within the limit."""
        limit = self.max_json_values
        if limit and values > limit:
            raise LimitExceeded(
                f"The request body holds more than {limit} JSON values (counted as its "
                "commas, '[' and '{'); this server parses at most that many.",
                limit="max_json_values",
                param=None,
                code=JSON_TOO_COMPLEX,
            )

    def check_stop(self, stops: Sequence[str], param: str = "stop") -> None:
        """The stop strings are few enough, and each short enough."""
        if self.max_stop_strings and len(stops) > self.max_stop_strings:
            raise LimitExceeded(
                f"'{param}' holds {len(stops)} stop strings; this server takes at most "
                f"{self.max_stop_strings}.",
                limit="max_stop_strings",
                param=param,
                code=ARRAY_TOO_LONG,
            )
        longest = max(map(len, stops), default=0)
        if self.max_stop_length and longest > self.max_stop_length:
            raise LimitExceeded(
                f"'{param}' holds a stop string of {longest} characters; this server takes "
                f"at most {self.max_stop_length}.",
                limit="max_stop_length",
                param=param,
                code=STRING_TOO_LONG,
            )
