"""The bounded field types the request models are built of, every API's alike.

Every list, string and mapping of a request model is bounded (:mod:`frontend.http.models`
says why): a name or an id by :data:`~frontend.limits.MAX_NAME_CHARS`, free-form JSON (a
tool's parameters, a call's arguments) kept as its raw text until its size and shape are
checked (:class:`frontend.http.schema.FreeForm`). OpenAI's models
(:mod:`frontend.http.models`), Anthropic's (:mod:`frontend.http.anthropic.models`) and
the Responses API's (:mod:`frontend.http.responses_api.models`) take them from here.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Raw

from frontend.limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_NAME_CHARS, MAX_PARTS

#: A name or an id. (Text, which counts against --max-prompt-chars, is a plain ``str``:
#: the OpenAPI document gives each one that bound, from the configured limit.)
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
NonEmptyStr = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
NonEmptyText = Annotated[str, Meta(min_length=1)]
FREE_FORM = (
    f"Free-form JSON: its text counts against --max-prompt-chars; at most "
    f"{MAX_JSON_DEPTH} deep, and {MAX_JSON_CONTAINERS} objects and arrays in all "
    f"of a request's free-form JSON."
)
#: A free-form JSON object, kept as its text until checked (frontend.http.schema).
FreeFormObject = Annotated[
    Raw,
    Meta(
        extra_json_schema={"type": "object", "maxProperties": MAX_PARTS, "description": FREE_FORM}
    ),
]
#: The same, or null, which the parser takes as absent (a function's ``parameters``, which
#: OpenAI's SDK sends as null for a function without any; ``chat_template_kwargs``).
FreeFormObjectOrNull = Annotated[
    Raw,
    Meta(
        extra_json_schema={
            "anyOf": [{"type": "object", "maxProperties": MAX_PARTS}, {"type": "null"}],
            "description": FREE_FORM,
        }
    ),
]
