"""headwater's pytest plugin: the ``headwater`` fixtures and marker.

Registered by the ``pytest11`` entry point, so a project that installs headwater has
it. Nothing heavy is imported until a test uses a fixture: pytest's start-up in every
other project stays as it was, and the SDKs stay optional.

Fixtures (async: the test runs under pytest-trio, with ``trio_mode = true`` or the
``trio`` mark):

* ``headwater``: a :class:`Headwater`, whose ``await headwater.start(**options)`` runs an
  in-process server (:func:`headwater.testing.open_server`'s options) until the test
  ends, as many as the test starts;
* ``headwater_server``: one server, started with the marker's options;
* ``headwater_options``: those options, a plain fixture a conftest.py may override.

The marker ``@pytest.mark.headwater(script=[...], **options)`` gives the options every
server of the test starts with (``start``'s own override them); a list of rules as its
one positional argument is the script.

PYTEST_DONT_REWRITE: pytest leaves this module as it is (it has no assert to rewrite, and
a project's conftest may import it before pytest could).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio

if TYPE_CHECKING:
    from headwater.testing.server import HeadwaterServer

MARKER = "headwater"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(script=None, **options): the in-process headwater server's options "
        "(headwater.testing.open_server's: script, token_delay, workers, FrontendConfig "
        "fields) for the headwater fixtures",
    )


class Headwater:
    """The ``headwater`` fixture: starts in-process servers that run until the test ends.

    *defaults* are the marker's options.
    """

    def __init__(self, nursery: trio.Nursery, defaults: dict[str, Any]) -> None:
        self._nursery = nursery
        self.defaults = defaults
        #: The servers started, in order.
        self.servers: list[HeadwaterServer] = []

    async def start(self, **options: Any) -> HeadwaterServer:
        """Start a server with the marker's options updated by *options*; returns once
        it serves. Raises ValueError for a bad option."""
        server: HeadwaterServer = await self._nursery.start(
            partial(self._run, {**self.defaults, **options})
        )
        self.servers.append(server)
        return server

    @staticmethod
    async def _run(
        options: dict[str, Any], *, task_status: trio.TaskStatus[HeadwaterServer]
    ) -> None:
        from headwater.testing.server import open_server

        async with open_server(**options) as server:
            task_status.started(server)
            await trio.sleep_forever()


def marker_options(node: pytest.Item | pytest.Collector) -> dict[str, Any]:
    """The options of the closest ``headwater`` marker of *node* (empty without one)."""
    marker = node.get_closest_marker(MARKER)
    if marker is None:
        return {}
    options = dict(marker.kwargs)
    if marker.args:
        if len(marker.args) > 1 or "script" in options:
            raise pytest.UsageError(
                f"@pytest.mark.{MARKER} takes the script as its only positional argument"
            )
        options["script"] = marker.args[0]
    return options


@pytest.fixture
def headwater_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The options this test's servers start with: the ``headwater`` marker's. Override
    the fixture (in a conftest.py) to give a whole project's tests their defaults."""
    return marker_options(request.node)


@pytest.fixture
async def headwater(headwater_options: dict[str, Any]) -> AsyncIterator[Headwater]:
    """Starts in-process headwater servers (``await headwater.start(**options)``) that
    run until the test ends; ``headwater_options`` are their defaults."""
    async with trio.open_nursery() as nursery:
        yield Headwater(nursery, headwater_options)
        nursery.cancel_scope.cancel()


@pytest.fixture
async def headwater_server(headwater: Headwater) -> HeadwaterServer:
    """An in-process headwater server, started with the ``headwater`` marker's options."""
    return await headwater.start()
