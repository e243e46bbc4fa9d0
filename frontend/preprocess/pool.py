"""The tokenizer pool: where prompts are encoded, and the reason headwater exists.

Encoding a 40k-token prompt costs ~1 ms with fastokens and ~100 ms with HF. Done
on the event loop (as Dynamo's frontend did), concurrent long prompts stall the loop
for seconds: ACKs time out, healthy workers are marked down, throughput collapses.

``thread`` mode (the default) runs the encoder through ``trio.to_thread.run_sync``
bounded by a :class:`trio.CapacityLimiter`, with an encoder call that releases the
GIL, so the loop keeps running while Rust code works on the other cores. Prompts
shorter than ``inline_max_chars`` are encoded inline: for them the thread hop
(~60–150 µs) costs more than the encoding itself (measured in docs/tokenization.md).

The two other modes exist to reproduce the failure in tests and benchmarks:
``inline`` encodes on the loop; ``thread-gil`` uses HF ``Tokenizer.encode`` in a
thread, which holds the GIL and so stalls the loop anyway. ``inline`` is also what a
virtual-time test runs (:mod:`headwater.testing`): trio's MockClock cannot see a
thread's work, so nothing of a request may run in one. The request's other CPU work goes
through :meth:`TokenizerPool.offload` for that reason: a thread, or the loop in ``inline``.

Cancellation: a request cancelled while its text is being encoded returns at once
(``abandon_on_cancel=True``), but the thread keeps its limiter token until the
encoder really finishes, so the pool never runs more encodes than it has threads.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio

from frontend.choices import TokenizeMode as TokenizeMode  # re-exported
from frontend.preprocess.tokenizer import Backend, SegmentCacheStats, Tokenizer

T = TypeVar("T")

#: Longest prompt (in characters) encoded inline by default, per backend: below these
#: the encode costs less than the ~60–300 µs thread hop and at most ~0.1–0.2 ms of
#: loop time (scripts/measure/tokenizer.py; figures in docs/tokenization.md).
INLINE_MAX_CHARS = {Backend.FASTOKENS: 8192, Backend.HF: 256}
#: Longest id list decoded inline (``/detokenize``): about what the inline encode of
#: :data:`INLINE_MAX_CHARS` characters produces.
INLINE_DECODE_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class PoolStats:
    threads: int
    busy: int  # threads encoding right now
    waiting: int  # requests queued for a thread
    encoded_total: int
    inline_total: int
    segment_cache: SegmentCacheStats | None = None  # fastokens' segment cache, if on


class TokenizerPool:
    """Encodes prompts without stalling the event loop (in the default mode)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        mode: TokenizeMode | str = TokenizeMode.THREAD,
        threads: int = 2,
        inline_max_chars: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.mode = TokenizeMode(mode)
        self.limiter = trio.CapacityLimiter(max(1, threads))
        if inline_max_chars is None:
            inline_max_chars = INLINE_MAX_CHARS[tokenizer.backend]
        self.inline_max_chars = inline_max_chars
        self._encoded = 0
        self._inline = 0

    async def encode(self, text: str) -> array[int]:
        """Token ids of *text* as a token array (no BOS added: the template writes it)."""
        return (await self.encode_timed(text))[0]

    async def encode_timed(self, text: str) -> tuple[array[int], float]:
        """:meth:`encode`, and the seconds the text waited for a pool thread (0 inline):
        the queue wait a request's trace shows on its tokenize span."""
        ids, waited, _ = await self._encode(text, None)
        return ids, waited

    async def encode_with(
        self, text: str, also: Callable[[array[int]], T]
    ) -> tuple[array[int], float, T]:
        """:meth:`encode_timed`, then *also* of the ids in the same thread (inline when
        the encode is): work on a prompt's ids (``--router kv``'s block hashes) that then
        costs the loop nothing and no second thread hop."""
        ids, waited, extra = await self._encode(text, also)
        return ids, waited, extra  # Any from _encode: T, as *also* is given

    async def _encode(
        self, text: str, also: Callable[[array[int]], Any] | None
    ) -> tuple[array[int], float, Any]:
        self._encoded += 1
        if self.mode is TokenizeMode.INLINE or (
            self.mode is TokenizeMode.THREAD and len(text) <= self.inline_max_chars
        ):
            self._inline += 1
            ids = self.tokenizer.encode_ids(text)
            return ids, 0.0, None if also is None else also(ids)
        encode = (
            self.tokenizer.encode_holding_gil
            if self.mode is TokenizeMode.THREAD_GIL
            else self.tokenizer.encode_ids
        )
        queued = time.perf_counter()
        started = queued

        def encode_in_thread() -> tuple[array[int], Any]:
            nonlocal started
            started = time.perf_counter()
            ids = encode(text)
            return ids, None if also is None else also(ids)

        ids, extra = await trio.to_thread.run_sync(
            encode_in_thread, limiter=self.limiter, abandon_on_cancel=True
        )
        return ids, started - queued, extra

    async def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of *ids* (``/detokenize``): inline up to :data:`INLINE_DECODE_TOKENS`
        ids, in a pool thread beyond, as encoding is (a 40k-token decode is
        milliseconds of work)."""
        if self.mode is TokenizeMode.INLINE or len(ids) <= INLINE_DECODE_TOKENS:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return await trio.to_thread.run_sync(
            partial(self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens),
            limiter=self.limiter,
            abandon_on_cancel=True,
        )

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run *fn* (other CPU work of a request: a long chat template, an echo, token
        strings) in a pool thread under the pool's limiter; on the loop in ``inline``
        mode, where nothing of a request leaves it (virtual-time tests: trio's MockClock
        cannot see a thread's work)."""
        if self.mode is TokenizeMode.INLINE:
            await trio.lowlevel.checkpoint()
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def warm_up(self) -> float:
        """Encode a sample once in a pool thread, and a short one on this (the loop's)
        thread, before traffic arrives; returns the seconds spent.

        The first encode after start pays for the encoder's lazy initialisation
        (~120 ms: fastokens starts its helper thread and builds its caches), which
        stalled the loop ~100 ms when left to real traffic. That is once per process,
        so one encode does it. Not one per pool thread: a thread's own first encode
        costs ~20 ms in that thread, off the loop, and 16 MB of fastokens' per-thread
        buffers that stay until the thread ends; trio ends a thread idle for 10 s, so
        warming every thread bought memory, not speed (docs/performance.md, "The
        warm-up's threads"). The loop thread is the exception: it lives as long as the
        process and encodes every short prompt inline, and its first encode costs the
        same 13-40 ms, a stall of the first short request when left to it.
        """
        start = time.perf_counter()
        sample = "warm up the tokenizer pool " * 512
        if self.mode is TokenizeMode.INLINE:
            self.tokenizer.encode_ids(sample)
        else:
            await trio.to_thread.run_sync(self.tokenizer.encode_ids, sample, limiter=self.limiter)
        if self.mode is TokenizeMode.THREAD and self.inline_max_chars > 0:
            self.tokenizer.encode_ids(sample[: min(64, self.inline_max_chars)])
        return time.perf_counter() - start

    def statistics(self) -> PoolStats:
        s = self.limiter.statistics()
        return PoolStats(
            threads=int(s.total_tokens),
            busy=s.borrowed_tokens,
            waiting=s.tasks_waiting,
            encoded_total=self._encoded,
            inline_total=self._inline,
            segment_cache=self.tokenizer.segment_cache_statistics(),
        )
