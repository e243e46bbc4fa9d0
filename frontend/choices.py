"""The fixed sets of values the frontend's options take, one enum each.

Kept in a module of their own, free of the code that acts on them, so that the
configuration (:mod:`frontend.config`) and the command line generated from it can name
them without importing the tokenizer or the router. Each is a ``StrEnum``: its members
equal their strings, so ``FrontendConfig(router="kv")`` and ``config.router == "kv"``
keep working, and a string that is no member is a ``ValueError`` naming the choices.
"""

from __future__ import annotations

import enum


class Backend(enum.StrEnum):
    """The tokenizer's encoder (docs/tokenization.md)."""

    FASTOKENS = "fastokens"  # exact, releases the GIL; falls back to hf if it cannot load
    HF = "hf"  # Hugging Face tokenizers, the oracle


class TokenizeMode(enum.StrEnum):
    """Where prompts are encoded. Only ``thread`` serves; the others reproduce the stall."""

    THREAD = "thread"  # a bounded thread pool, with a GIL-releasing call
    INLINE = "inline"  # on the event loop (virtual-time tests, the stall's reproduction)
    THREAD_GIL = "thread-gil"  # a thread, with HF's encode, which holds the GIL


class Policy(enum.StrEnum):
    """How the router picks a worker for a request (docs/routing.md)."""

    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"
    P2C = "p2c"  # the less loaded of two picked at random
    KV = "kv"  # where the prompt's prefix is cached


class Layout(enum.StrEnum):
    """The in-process workers of ``headwater serve``."""

    DISAGG = "disagg"  # a prefill worker and a decode worker
    AGG = "agg"  # one worker that does both


class KvEvents(enum.StrEnum):
    """What ``--router kv`` knows of the workers' caches."""

    ON = "on"  # the workers' own KV events
    OFF = "off"  # approximate: where this frontend sent each prefix, for a while


class ReasoningField(enum.StrEnum):
    """The message field a chat answer's reasoning goes in."""

    REASONING_CONTENT = "reasoning_content"  # DeepSeek's and vLLM's name
    REASONING = "reasoning"  # what some clients read


class HttpParser(enum.StrEnum):
    """What reads HTTP/1.1 requests (frontend/http/serving; docs/architecture.md)."""

    H11 = "h11"  # hypercorn's, pure Python
    HTTPTOOLS = "httptools"  # llhttp, compiled; the same answers (tests/test_http_parsers.py)
