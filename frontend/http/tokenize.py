"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered by the chat
template first, with ``tools`` and ``chat_template_kwargs`` as a chat request's) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
``tokens`` and answers ``{"prompt"}``, special tokens kept, so that the two round-trip.
The ids are exactly those a chat or completions request with the same body would send
to the workers: the same template and the same encode, in the tokenizer pool
(:meth:`~frontend.pipeline.Pipeline.encode_prompt`), never on the loop for a long text.

Same limits as the other routes (the body size and its JSON values, ``--max-messages``,
``--max-prompt-chars``, ``--max-tools``, the deadline), the same API keys and admission control. A
prompt longer than the context is counted, not refused: telling its length is the
point. What vLLM's routes take and headwater cannot do (``chat_template`` from the
request, ``continue_final_message``) is refused with a 400 naming the field.
"""

from __future__ import annotations

import logging
from typing import cast

import tokenizers
from msgspec import UNSET, UnsetType
from quart import Response
from quart_trio import QuartTrio

from frontend.http.context import ApiContext
from frontend.http.errors import bad_request
from frontend.http.models import DetokenizeRequest, TokenizeRequest
from frontend.http.responses import json_response
from frontend.http.schema import chat_text, decode
from frontend.pipeline import Pipeline
from frontend.request import ParsedRequest

log = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKENIZE_PATHS = frozenset({TOKENIZE_PATH, DETOKENIZE_PATH})
#: ``return_token_strs`` for more ids than this looks them up in a thread (a Python
#: call per id; ~1 µs each).
INLINE_TOKEN_STRS = 4096


def special_affixes(hf: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text when special
    tokens are added (``add_special_tokens``: a BOS, for many models; none for
    DeepSeek-V4's), found by encoding a probe both ways."""
    probe = "probe"
    plain = hf.encode(probe, add_special_tokens=False).ids
    full = hf.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    log.warning(
        "the tokenizer's special tokens could not be located around a text; /tokenize adds none"
    )
    return [], []


def parse_tokenize(body: bytes, api: ApiContext) -> tuple[ParsedRequest | None, TokenizeRequest]:
    """The chat or completions request whose prompt ``/tokenize`` encodes (None for an
    empty prompt: no ids), and the validated body. The messages, tools and template
    kwargs are read, counted and bounded as a chat request's
    (:func:`~frontend.http.schema.chat_text`). Raises ApiError (400) or LimitExceeded."""
    req = cast(TokenizeRequest, decode(body, api.models["tokenize"]))
    if (req.prompt is UNSET) == (req.messages is UNSET):
        raise bad_request(
            "send either 'prompt' or 'messages'",
            "messages" if req.messages is not UNSET else "prompt",
        )
    if req.continue_final_message:
        raise bad_request(
            "continue_final_message is not supported by this server", "continue_final_message"
        )
    if req.chat_template is not None:
        raise bad_request(
            "a chat template from the request is not supported: the model's own applies",
            "chat_template",
        )
    model = req.model or api.catalog.primary.model_name
    if not isinstance(req.messages, UnsetType):
        api.limits.check_messages(len(req.messages))
        messages, tools, kwargs, chars = chat_text(req, api.limits)
        return ParsedRequest(
            endpoint="chat",
            model=model,
            messages=messages,
            tools=tools,
            chat_template_kwargs=kwargs,
            text_chars=chars,
            add_generation_prompt=req.add_generation_prompt is not False,
        ), req
    assert not isinstance(req.prompt, UnsetType)
    api.limits.check_prompt_chars(len(req.prompt), "prompt")
    if not req.prompt:  # the completions path refuses an empty prompt; its ids are none
        return None, req
    return ParsedRequest(
        endpoint="completions", model=model, prompt=req.prompt, text_chars=len(req.prompt)
    ), req


def add_tokenize_routes(app: QuartTrio, api: ApiContext) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` on *app*."""
    affixes: dict[int, tuple[list[int], list[int]]] = {}  # by tokenizer: models may share one

    def special(pipeline: Pipeline) -> tuple[list[int], list[int]]:
        tokenizer = pipeline.tokenizer
        found = affixes.get(id(tokenizer))
        if found is None:
            found = affixes[id(tokenizer)] = special_affixes(tokenizer.hf)
        return found

    special(api.catalog.primary)  # at start: a probe encode, not on a request's time

    @app.post(TOKENIZE_PATH)
    async def tokenize() -> Response:
        async def work() -> Response:
            parsed, req = parse_tokenize(await api.read_body(), api)
            pipeline = api.check_model(req.model)
            ids = list(await pipeline.encode_prompt(parsed)) if parsed is not None else []
            # vLLM's defaults: special tokens for a prompt, none for a conversation
            # (its template writes them).
            add_special = req.add_special_tokens
            if add_special is None:
                add_special = req.prompt is not UNSET
            if add_special:
                prefix, suffix = special(pipeline)
                ids = prefix + ids + suffix
            strs = await _token_strs(pipeline, ids) if req.return_token_strs else None
            return json_response(
                {
                    "count": len(ids),
                    "max_model_len": pipeline.context_length,
                    "tokens": ids,
                    "token_strs": strs,
                }
            )

        return await api.answer("tokenize", work)

    @app.post(DETOKENIZE_PATH)
    async def detokenize() -> Response:
        async def work() -> Response:
            req = cast(DetokenizeRequest, decode(await api.read_body(), api.models["detokenize"]))
            pipeline = api.check_model(req.model)
            if len(req.tokens) > pipeline.context_length:
                raise bad_request(
                    f"'tokens' holds {len(req.tokens)} ids; at most the context "
                    f"length, {pipeline.context_length}",
                    "tokens",
                )
            vocab = pipeline.tokenizer.vocab_size
            if req.tokens and max(req.tokens) >= vocab:
                bad = next(t for t in req.tokens if t >= vocab)
                raise bad_request(
                    f"token ids must be below the vocabulary size ({vocab}), got {bad}", "tokens"
                )
            text = await pipeline.pool.decode(req.tokens, skip_special_tokens=False)
            return json_response({"prompt": text})

        return await api.answer("detokenize", work)

    async def _token_strs(pipeline: Pipeline, ids: list[int]) -> list[str]:
        hf = pipeline.tokenizer.hf

        def look_up() -> list[str]:
            return [hf.id_to_token(i) or "" for i in ids]

        if len(ids) <= INLINE_TOKEN_STRS:
            return look_up()
        return await pipeline.pool.offload(look_up)
