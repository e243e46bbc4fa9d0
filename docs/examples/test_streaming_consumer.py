"""A streaming consumer, tested on trio's virtual clock.

The consumer shows an answer as it streams and gives up when the first token is late.
Under ``autojump_clock`` the scripted engine's pace (``token_delay``), headwater's
timeouts and the consumer's own deadline all run on trio's clock: the test asserts
exact times, and a minute of streaming takes a fraction of a second.
"""

from __future__ import annotations

import openai
import pytest
import trio
import trio.testing

from headwater.testing import HeadwaterServer

pytestmark = pytest.mark.trio  # not needed with trio_mode = true

MODEL = "deepseek-v4"
STORY = "Once upon a time a small river ran all the way to the sea."
SCRIPT = [{"default": True, "text": STORY}]


async def show(
    client: openai.AsyncOpenAI, prompt: str, first_token_within: float
) -> tuple[str, list[float]]:
    """The consumer under test: the answer's text and when each piece arrived; an empty
    answer when the first piece takes longer than *first_token_within* seconds."""
    start = trio.current_time()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True
    )
    pieces: list[str] = []
    times: list[float] = []
    async with stream:
        with trio.move_on_after(first_token_within) as deadline:
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        deadline.deadline = float("inf")  # it came: no more deadline
                        pieces.append(choice.delta.content)
                        times.append(trio.current_time() - start)
    return "".join(pieces), times


@pytest.mark.headwater(script=SCRIPT, token_delay=0.5)
async def test_pieces_come_at_the_models_pace(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    text, times = await show(headwater_server.openai_client(), "A story, please.", 5)
    assert text == STORY
    # One token every 0.5 s, on the virtual clock: exact.
    assert times[:3] == [0.5, 1.0, 1.5]


@pytest.mark.headwater(script=SCRIPT, token_delay=0.5)
async def test_the_consumer_gives_up_on_a_late_first_token(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    headwater_server.faults.slow_first_token(30)
    text, times = await show(headwater_server.openai_client(), "A story, please.", 5)
    assert (text, times) == ("", [])
    assert trio.current_time() == pytest.approx(5)
    # Leaving the stream cancelled the answer on the worker.
    (record,) = headwater_server.requests
    await record.settled()
    assert record.generated[0].outcome == "cancelled"


@pytest.mark.headwater(script=SCRIPT, token_delay=5.0)
async def test_a_long_answer_takes_no_real_time(
    headwater_server: HeadwaterServer, autojump_clock: trio.testing.MockClock
) -> None:
    text, times = await show(headwater_server.openai_client(), "A story, please.", 10)
    assert text == STORY
    assert times[-1] > 60  # over a minute of virtual streaming
