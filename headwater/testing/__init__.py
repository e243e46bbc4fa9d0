"""headwater in its users' tests: the whole frontend inside a trio test, no socket.

::

    from headwater.testing import open_server

    async def test_my_agent(autojump_clock):
        async with open_server(script=[{"prompt_contains": "weather", "text": CALL}]) as server:
            server.faults.break_stream(after_tokens=5)
            answer = await my_agent(server.openai_client(), "What is the weather in Paris?")
            assert server.requests[-1].attempt == 2

:func:`open_server` runs the frontend and in-process workers (the mocker, or the
scripted engine on a script) in the caller's trio run; :class:`HeadwaterServer` gives
clients (httpx, the OpenAI and Anthropic SDKs) whose transport calls the ASGI app
directly, faults on demand (:class:`Faults`) and records of every request
(:class:`RequestRecord`, :class:`Leg`). The pytest plugin
(:mod:`headwater.testing.plugin`, registered by entry point) adds the ``headwater``
fixtures (:class:`Headwater`) and marker. docs/testing.md has the guide.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headwater.testing.asgi import ASGITransport, Exchange
    from headwater.testing.faults import Faults
    from headwater.testing.plugin import Headwater
    from headwater.testing.records import Leg, RequestRecord
    from headwater.testing.server import BASE_URL, HeadwaterServer, open_server

#: Where each name lives: imported on first use, so that the pytest plugin (a module of
#: this package, loaded by every pytest run where headwater is installed) costs nothing
#: until a test uses it.
_EXPORTS = {
    "ASGITransport": "asgi",
    "Exchange": "asgi",
    "Faults": "faults",
    "Headwater": "plugin",
    "Leg": "records",
    "RequestRecord": "records",
    "BASE_URL": "server",
    "HeadwaterServer": "server",
    "open_server": "server",
}

__all__ = [
    "BASE_URL",
    "ASGITransport",
    "Exchange",
    "Faults",
    "Headwater",
    "HeadwaterServer",
    "Leg",
    "RequestRecord",
    "open_server",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
