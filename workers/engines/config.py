"""The part of the engine contract a config carries, in a module of its own.

Kept apart from :mod:`workers.engines.base` (which imports trio) because the engines'
config dataclasses are imported by trio-free code: the mocker's scheduler is a pure state
machine, run and tested without an event loop.
"""

from __future__ import annotations

from typing import Any


class EngineConfig:
    """What every engine's config tells the processes around it (its own fields are its
    options: :mod:`headwater.cli.options`). The defaults say nothing; an engine whose
    model knows more (vLLM's) overrides them. A base of the engines' config dataclasses,
    so the command line asks these of any engine alike, never probing for attributes."""

    __slots__ = ()

    def preflight(self) -> None:
        """The engine's fast checks, run before anything slow starts (a model directory
        that is there, a server address that answers); ValueError for a failed one."""

    def frontend_defaults(self) -> dict[str, Any]:
        """FrontendConfig fields the model behind this engine decides (its tokenizer,
        context length, vocabulary size, KV block size; how many frontend processes
        ``--processes auto`` means), for those the command line leaves unset."""
        return {}

    @property
    def start_timeout(self) -> float:
        """Seconds an engine of this config may take to come up (a model server's start),
        beyond a process's own."""
        return 0.0
