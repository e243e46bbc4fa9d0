"""A retry policy, tested against headwater's real refusals on trio's virtual clock.

The policy is the application's own (the SDK's retries are off): it waits what a 429's
``Retry-After`` says, backs off exponentially on a 503, and never retries a 400.
headwater answers those as it does in production (admission control's 429, the 503 of
a cluster whose workers refuse, a 400 for a prompt the script has no answer for), and
under ``autojump_clock`` each wait is exact and costs no real time.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
import pytest
import trio
import trio.testing

from headwater.testing import HeadwaterServer

pytestmark = pytest.mark.trio  # not needed with trio_mode = true

MODEL = "deepseek-v4"
SCRIPT = [{"prompt_contains": "hello", "text": "Hello to you too."}]
T = TypeVar("T")


async def with_retries(
    call: Callable[[], Awaitable[T]], attempts: int = 4, backoff: float = 2.0
) -> T:
    """The policy under test."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except openai.RateLimitError as exc:
            if attempt == attempts:
                raise
            await trio.sleep(float(exc.response.headers.get("retry-after", backoff)))
        except openai.InternalServerError:
            if attempt == attempts:
                raise
            await trio.sleep(backoff * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def hello(client: openai.AsyncOpenAI) -> Callable[[], Awaitable[Any]]:
    return lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}]
    )


@pytest.mark.headwater(script=SCRIPT)
async def test_a_429_is_retried_after_retry_after(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    headwater_server.faults.reject(times=2)  # admission control says 429 twice
    client = headwater_server.openai_client(max_retries=0)
    answer = await with_retries(hello(client))
    assert answer.choices[0].message.content == "Hello to you too."
    starts = [r.started for r in headwater_server.requests]
    assert [r.status for r in headwater_server.requests] == [429, 429, 200]
    assert [b - a for a, b in itertools.pairwise(starts)] == [1.0, 1.0]


@pytest.mark.headwater(script=SCRIPT, queue_timeout=0.5)
async def test_a_503_backs_off_exponentially(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    headwater_server.faults.refuse(times=2)  # the workers refuse twice: 503
    client = headwater_server.openai_client(max_retries=0)
    answer = await with_retries(hello(client))
    assert answer.choices[0].message.content == "Hello to you too."
    records = headwater_server.requests
    assert [r.status for r in records] == [503, 503, 200]
    # Each 503 came after the frontend waited queue_timeout for a worker; then we slept.
    await headwater_server.settled()
    assert records[1].started - records[0].ended == 2.0
    assert records[2].started - records[1].ended == 4.0


@pytest.mark.headwater(script=SCRIPT)
async def test_the_policy_gives_up_and_never_retries_a_bad_request(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    client = headwater_server.openai_client(max_retries=0)
    headwater_server.faults.reject(times=4)
    with pytest.raises(openai.RateLimitError):
        await with_retries(hello(client))
    assert len(headwater_server.requests) == 4
    # A prompt the script has no answer for is a 400: not retried.
    with pytest.raises(openai.BadRequestError):
        await with_retries(
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "good night"}]
            )
        )
    assert len(headwater_server.requests) == 5
