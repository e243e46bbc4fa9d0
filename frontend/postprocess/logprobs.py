"""Logprobs as a response shows them: each token's text and bytes, logprobs clamped.

The workers send logprobs by token id (:class:`~headwater.wire.TokenLogprobs`); OpenAI's
shapes name each token by its text, with its UTF-8 ``bytes``. :class:`TokenTexts` gives
both for an id from the tokenizer's vocabulary: a token's own bytes (a byte-level BPE
piece through GPT-2's byte alphabet, a SentencePiece piece with ``▁`` as a space and
``<0xNN>`` as a byte), so a token holding part of a character has the bytes it really
holds. Its ``token`` text is those bytes as UTF-8, and where they are not whole
characters, escaped (``\\xe4\\xbd``), as OpenAI and DeepSeek show them (vLLM shows
U+FFFD there, which loses the bytes). A logprob of ``-inf`` (or NaN) shows as
``-9999.0``, OpenAI's value for a token the model rules out.

Pure computation; a :class:`TokenTexts` is shared by every request of a frontend. Its
memo is a dict, whose single operations the GIL keeps whole, so the echo of a long prompt
may read it from a thread while the loop does too (at worst a text is computed twice).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from headwater.wire import TokenLogprobs

#: OpenAI's logprob for a token the model rules out (JSON has no -inf).
FLOOR = -9999.0
#: Token ids whose text is remembered; beyond, the memory starts over.
_CACHE_SIZE = 1 << 16
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def clamp(logprob: float) -> float:
    """*logprob* as OpenAI's shapes may carry it: -inf and NaN become :data:`FLOOR`."""
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else logprob


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character → byte (the inverse of its
    ``bytes_to_unicode``): printable bytes stand for themselves, the others for
    characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True, slots=True)
class TopEntry:
    """One of the most likely tokens at a position."""

    token: str
    bytes: bytes
    logprob: float  # clamped


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """A token of a choice's text, with its logprobs, as the responses show it.

    ``logprob`` and ``top`` are None for a prompt's first token (nothing precedes it);
    ``sampled`` is the token itself as a :class:`TopEntry` (completions list it with
    the top ones); ``offset`` is where its text begins in the choice's text."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float | None
    top: tuple[TopEntry, ...] | None
    offset: int

    @property
    def sampled(self) -> TopEntry:
        return TopEntry(self.token, self.bytes, FLOOR if self.logprob is None else self.logprob)


class TokenTexts:
    """Each token id's text and bytes (see the module docstring), from *hf*, a
    ``tokenizers.Tokenizer``."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self._added: dict[int, str] = {
            i: t.content for i, t in hf.get_added_tokens_decoder().items()
        }
        kind = type(hf.decoder).__name__ if hf.decoder is not None else ""
        self._byte_level = kind == "ByteLevel"
        self._alphabet = _byte_alphabet()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """The token's text and bytes."""
        known = self._cache.get(token_id)
        if known is not None:
            return known
        raw = self._bytes(token_id)
        known = (raw.decode("utf-8", errors="backslashreplace"), raw)
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[token_id] = known
        return known

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece: str | None = self._hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            try:
                return bytes(self._alphabet[c] for c in piece)
            except KeyError:  # not a byte-level piece after all
                return piece.encode()
        if byte := _BYTE_PIECE.fullmatch(piece):  # SentencePiece's byte fallback
            return bytes([int(byte[1], 16)])
        return piece.replace("\u2581", " ").encode()

    def entry(self, token_id: int, logprobs: TokenLogprobs | None, offset: int) -> LogprobEntry:
        """A token's entry; *logprobs* None for a prompt's first token."""
        token, raw = self(token_id)
        if logprobs is None:
            return LogprobEntry(token_id, token, raw, None, None, offset)
        top = tuple(
            TopEntry(*self(t), clamp(lp))
            for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
        )
        return LogprobEntry(token_id, token, raw, clamp(logprobs.logprob), top, offset)
