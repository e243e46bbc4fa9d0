"""The stored responses: what ``previous_response_id`` continues and ``GET`` returns.

A response created with ``store`` (true unless the request says false, as OpenAI's)
is kept in this process's memory, in a :class:`ResponseStore` bounded by a number of
responses and a number of bytes (:class:`StoreConfig`: ``--responses-store-entries``,
``--responses-store-mb``); past either bound the oldest responses are evicted first. A
response evicted, deleted, never stored or stored by another process is unknown: its id
is a 404, for ``GET`` and ``DELETE`` as for ``previous_response_id``.

Per process, not shared: with ``headwater serve --processes N`` each process keeps the
responses it created, and a request that continues one must reach the same process,
which the shared port does not ensure. Chain responses with ``--processes 1``, or send
the whole conversation as ``input`` with ``store: false`` (what Codex CLI does); both
work in every layout (docs/api.md, "OpenAI Responses").

Each entry keeps its response's body (for ``GET``) and its own turn of the
conversation: the input it added and its output, as chat messages, with the id of the
response it continued. A conversation is put back together by following those ids, so
a chain of N responses costs N turns of memory, not N conversations. A chain whose
earlier response was evicted cannot be continued (a 404 that says so).

On the event loop only; no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

#: The longest chain put back together (a cycle cannot form: ids are fresh, but a bound
#: keeps the walk's cost known).
MAX_CHAIN = 10_000


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The bounds of the stored responses (0 turns a bound off; both 0 keeps nothing
    from being evicted, which only a test should want)."""

    responses_store_entries: int = field(
        default=1024,
        metadata={
            "help": "stored responses kept for previous_response_id and GET /v1/responses/{id} "
            "(per process); the oldest are evicted first (0: no bound)"
        },
    )
    responses_store_mb: int = field(
        default=256,
        metadata={
            "help": "MiB of stored responses kept (their bodies and conversations); the "
            "oldest are evicted first (0: no bound)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("responses_store_entries", "responses_store_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no bound), got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored response."""

    body: bytes  # the response object, as GET returns it
    previous_id: str | None  # the response it continued
    turn: list[dict[str, Any]]  # its input and output, as chat messages
    size: int  # bytes it counts for


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    bytes: int
    stored_total: int
    evicted_total: int


class ChainBroken(LookupError):
    """A conversation's earlier response is no longer stored (evicted or deleted)."""


class ResponseStore:
    """Stored responses by id, oldest first (see the module docstring)."""

    def __init__(self, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig()
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._stored = 0
        self._evicted = 0

    def put(
        self,
        response_id: str,
        body: bytes,
        previous_id: str | None,
        turn: list[dict[str, Any]],
        turn_bytes: int,
    ) -> None:
        """Keep a response; *turn_bytes* is its turn's size (its serialized length).
        One larger than the whole bound is not kept."""
        size = len(body) + turn_bytes
        limit = self.config.responses_store_mb << 20
        if limit and size > limit:
            return
        self.delete(response_id)
        self._entries[response_id] = Stored(body, previous_id, turn, size)
        self._bytes += size
        self._stored += 1
        entries = self.config.responses_store_entries
        while (entries and len(self._entries) > entries) or (limit and self._bytes > limit):
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
            self._evicted += 1

    def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including *response_id*'s
        answer, oldest first. Raises KeyError if *response_id* is not stored,
        ChainBroken if an earlier response of its chain is not."""
        turns: list[list[dict[str, Any]]] = []
        at: str | None = response_id
        while at is not None and len(turns) < MAX_CHAIN:
            entry = self._entries.get(at)
            if entry is None:
                if at == response_id:
                    raise KeyError(response_id)
                raise ChainBroken(at)
            turns.append(entry.turn)
            at = entry.previous_id
        return [m for turn in reversed(turns) for m in turn]

    def statistics(self) -> StoreStats:
        return StoreStats(len(self._entries), self._bytes, self._stored, self._evicted)
