"""The official SDKs' clients on the in-process server: OpenAI's and Anthropic's.

Both SDKs send through ``httpx2`` (the httpx they ship with), so their client is an
``httpx2.AsyncClient`` on :class:`HTTPX2Transport`, the twin of
:class:`~headwater.testing.asgi.ASGITransport` (the same :class:`~headwater.testing.asgi.Exchange`
underneath). Imported only when a test asks for one of these clients: the SDKs are
optional.

Both SDKs look up the platform they run on in a worker thread on their first request;
under a MockClock the clock would jump while that thread runs, so it is looked up here,
once, on the loop (a few microseconds on Linux).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import httpx2

from headwater.testing.asgi import ExchangeBody, ExchangeTransport

if TYPE_CHECKING:
    import anthropic
    import openai


class _Body(ExchangeBody, httpx2.AsyncByteStream):
    http: ClassVar[Any] = httpx2


class HTTPX2Transport(ExchangeTransport, httpx2.AsyncBaseTransport):
    """:class:`~headwater.testing.asgi.ASGITransport` for ``httpx2``; same arguments."""

    http: ClassVar[Any] = httpx2
    body: ClassVar[type[ExchangeBody]] = _Body


def openai_client(
    http: httpx2.AsyncClient, base_url: str, api_key: str, **kwargs: Any
) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` sending through *http*; *kwargs* are its own."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, **kwargs)
    _look_up_platform(client, "openai._base_client")
    return client


def anthropic_client(
    http: httpx2.AsyncClient, base_url: str, api_key: str, **kwargs: Any
) -> anthropic.AsyncAnthropic:
    """An ``anthropic.AsyncAnthropic`` sending through *http*; *kwargs* are its own."""
    import anthropic

    client = anthropic.AsyncAnthropic(
        base_url=base_url, api_key=api_key, http_client=http, **kwargs
    )
    _look_up_platform(client, "anthropic._base_client")
    return client


def _look_up_platform(client: Any, module: str) -> None:
    """Do now, on the loop, what the SDK's first request would do in a thread. An SDK
    that no longer has this internal keeps its own way (a thread: see the module
    docstring for what that risks under a MockClock)."""
    try:
        get_platform = importlib.import_module(module).get_platform
    except (ImportError, AttributeError):
        return
    if getattr(client, "_platform", False) is None:
        client._platform = get_platform()
