"""The engine registry: one table from an engine's name to its config and its factory.

``headwater serve``, ``headwater worker`` and ``headwater launch`` take their
``--engine`` choices from :data:`ENGINES`, and their engine options from the chosen
engine's config dataclass (each field with a ``help`` in its metadata is an option;
see ``headwater.cli.options``). The frontend builds its in-process workers' engines
through :func:`build` only, so adding an engine is one folder under
``workers/engines/`` plus one entry here (docs/architecture.md, "Adding an engine").

Specs name their modules as strings: listing the engines imports none of them, and
an engine whose dependencies are heavy (a real model server's client) costs nothing
until it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.engines.base import Engine, EngineContext


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine: its name, a line for ``--help``, and where its parts are.

    ``config`` and ``factory`` are ``"module:attribute"``: a frozen dataclass whose
    defaults are the engine's defaults, and ``factory(config, context) -> Engine``.
    """

    name: str
    summary: str
    config: str
    factory: str


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "mocker",
            "simulated: Dynamo's timing model, continuous batching, a block KV cache",
            "workers.engines.mocker.config:MockerConfig",
            "workers.engines.mocker.engine:build_engine",
        ),
        EngineSpec(
            "vllm",
            "a vLLM server per worker (started on --model PATH, or --vllm-url), "
            "token ids in and out; KV over NIXL when disaggregated",
            "workers.engines.vllm.config:VllmConfig",
            "workers.engines.vllm.engine:build_engine",
        ),
        EngineSpec(
            "scripted",
            "answers from a script (--script FILE, JSON Lines: the first line whose "
            "prompt_contains occurs in the prompt, else the default line), streamed in "
            "the model's tokens",
            "workers.engines.scripted.config:ScriptedConfig",
            "workers.engines.scripted.engine:build_engine",
        ),
    )
}

DEFAULT_ENGINE = "mocker"


def names() -> list[str]:
    """Every registered engine's name, for ``--engine`` choices."""
    return list(ENGINES)


def spec(name: str) -> EngineSpec:
    """Raises ValueError naming the choices for an unknown engine."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (available: {', '.join(ENGINES)})") from None


def config_type(name: str) -> type[Any]:
    """The engine's config dataclass."""
    cls: type[Any] = _load(spec(name).config)
    return cls


def default_config(name: str) -> Any:
    """The engine's config with every default."""
    return config_type(name)()


def build(name: str, config: Any | None, context: EngineContext) -> Engine:
    """A new engine *name* from *config* (None: its defaults) in *context*.

    Raises ValueError for an unknown engine or a config of another engine's type.
    """
    cls = config_type(name)
    config = cls() if config is None else config
    if not isinstance(config, cls):
        raise ValueError(f"engine {name!r} takes a {cls.__name__}, got {type(config).__name__}")
    factory: Callable[[Any, EngineContext], Engine] = _load(spec(name).factory)
    return factory(config, context)


def _load(ref: str) -> Any:
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)
