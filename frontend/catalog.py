"""The models one frontend serves, each with a pipeline of its own.

A frontend serves its configured model (``--model-name``) and, beside it, other models
in one of two ways:

- **configured** (``--served-model NAME[:tokenizer=PATH,context-length=N,...]``): the
  model's preprocessor (tokenizer, chat template, parsers, context length) is built at
  start from its :class:`ModelSpec`; like the primary model, it is listed in
  ``/v1/models`` whether or not a worker serves it right now (a request then gets the
  retryable 503 "no routable worker", as the primary's does while its workers restart);
- **discovered**: a worker registers (in etcd, or in a ``--workers`` entry's
  ``model=``) a model nobody configured. It is served with the primary model's
  preprocessor settings from its first worker's registration on, listed while it has a
  worker, and gone with its last worker: its requests then get OpenAI's 404, as a model
  that was never there.

Every model shares the router (which routes by the request's ``model`` among the
workers registered for it), the metrics and the frontend's limits; what is per model is
the pipeline: its preprocessor and its dispatcher. Models with the same tokenizer share
one tokenizer pool (its threads and the tokenizer's memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import trio

from frontend.errors import UnknownModel

if TYPE_CHECKING:  # the configuration imports the spec; the pipeline is heavier
    from frontend.pipeline import Pipeline
    from frontend.router.router import Router

__all__ = ["ModelCatalog", "ModelSpec", "parse_model_spec"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A configured model beside the primary one; a setting left None is the primary
    model's (its tokenizer, context length, parsers)."""

    name: str
    tokenizer: str | None = None  # tokenizer.json or a directory
    context_length: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def parse_model_spec(text: str) -> ModelSpec:
    """``NAME`` or ``NAME:key=value,...`` (keys: tokenizer, context-length,
    tool-call-parser, reasoning-parser) as a :class:`ModelSpec`. Raises ValueError."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise ValueError(f"a served model needs a name: {text!r}")
    known = {f.name.replace("_", "-"): f.name for f in fields(ModelSpec) if f.name != "name"}
    settings: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(
                f"served model {name!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(known)}, got {item!r}"
            )
        if key == "context-length":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"served model {name!r}: context-length must be >= 1")
            settings[known[key]] = int(value)
        else:
            settings[known[key]] = value
    return ModelSpec(name.strip(), **settings)  # type: ignore[arg-type]


class ModelCatalog:
    """The served models' pipelines, by name (see the module docstring).

    *primary* and *configured* are built by the caller, at start. *discover* builds a
    discovered model's pipeline from its name, the first time a request names a model
    that a worker registered (None: only the configured models are served).
    :meth:`run` owns the pipelines' streams of choices (requests with ``n`` > 1),
    discovered pipelines' included."""

    def __init__(
        self,
        primary: Pipeline,
        router: Router,
        configured: tuple[Pipeline, ...] = (),
        discover: Callable[[str], Pipeline] | None = None,
    ) -> None:
        self.primary = primary
        self._router = router
        self._configured = {p.model_name: p for p in (primary, *configured)}
        if len(self._configured) != 1 + len(configured):
            raise ValueError("each served model needs a name of its own")
        self._discover = discover
        self._discovered: dict[str, Pipeline] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every pipeline's streams of choices until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for pipeline in self:
                pipeline.attach(nursery)
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def get(self, name: str | None) -> Pipeline:
        """The pipeline of the model *name* (None: the primary). Raises UnknownModel
        for a model that is neither configured nor registered by a worker now."""
        if name is None:
            return self.primary
        pipeline = self._configured.get(name)
        if pipeline is not None:
            return pipeline
        if self._discover is None or name not in self._registered():
            self._discovered.pop(name, None)  # its last worker left
            raise UnknownModel(name)
        pipeline = self._discovered.get(name)
        if pipeline is None:
            pipeline = self._discovered[name] = self._discover(name)
            if self._nursery is not None:
                pipeline.attach(self._nursery)
        return pipeline

    @property
    def discovers(self) -> bool:
        """Models that workers register are served too, not only the configured ones."""
        return self._discover is not None

    def names(self) -> list[str]:
        """The models served now: the configured ones, then those only workers name."""
        configured = list(self._configured)
        if self._discover is None:
            return configured
        return configured + sorted(self._registered() - set(configured))

    def label(self, name: str | None) -> str:
        """*name* as a metrics label: a served model's name, else "" (a label per
        unknown name a client sends would grow the series without bound)."""
        if name is None:
            return self.primary.model_name
        return name if name in self._configured or name in self._discovered else ""

    def __iter__(self) -> Iterator[Pipeline]:
        yield from self._configured.values()
        yield from list(self._discovered.values())

    def _registered(self) -> set[str]:
        return {client.instance.model for client in self._router.clients()}
