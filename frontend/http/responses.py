"""OpenAI response bodies: unary objects and SSE chunks, built from pipeline deltas.

Kept apart from the routes so the shapes can be read (and tested) in one place.
"""

from __future__ import annotations

from typing import Any

import orjson

from frontend.pipeline import Delta, Prepared


def usage(prep: Prepared, delta: Delta) -> dict[str, Any]:
    prompt = len(prep.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": prompt + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},
    }


def response_id(prep: Prepared) -> str:
    prefix = "chatcmpl-" if prep.parsed.endpoint == "chat" else "cmpl-"
    return prefix + prep.request_id


def unary_body(prep: Prepared, text: str, last: Delta) -> bytes:
    """The whole response of a non-streaming request."""
    chat = prep.parsed.endpoint == "chat"
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return orjson.dumps(
        {
            "id": response_id(prep),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(prep.created),
            "model": prep.parsed.model,
            "choices": [choice],
            "usage": usage(prep, last),
        }
    )


class ChunkWriter:
    """Formats SSE events for one streaming request.

    The fixed parts of every chunk are encoded once; each event is one ``bytes``.
    """

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.chat = prep.parsed.endpoint == "chat"
        self._head = {
            "id": response_id(prep),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(prep.created),
            "model": prep.parsed.model,
        }

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": choices, **extra}) + b"\n\n"

    def role(self) -> bytes:
        """Chat streams open with the assistant role, as OpenAI's do."""
        delta = {"role": "assistant", "content": ""}
        return self._event([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])

    def delta(self, d: Delta) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": d.finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"content": d.text} if d.text else {}
        else:
            choice["text"] = d.text
        return self._event([choice])

    def usage(self, last: Delta) -> bytes:
        return self._event([], usage=usage(self.prep, last))

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    DONE = b"data: [DONE]\n\n"
