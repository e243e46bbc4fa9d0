"""An asyncio event loop in a thread of its own, driven from trio.

vLLM's engine client (``AsyncLLM``) is asyncio's: its output handler is a task of the
loop it was made on, and every call into it must run there. A worker that hosts vLLM
in-process (:mod:`.in_process`) keeps trio's loop for itself: :func:`open_asyncio_thread`
runs an asyncio loop in a dedicated thread for as long as its block, and
:meth:`AsyncioThread.run` runs one coroutine there and waits for it from trio.

Neither loop ever blocks on the other. A coroutine is handed over with
``loop.call_soon_threadsafe`` and its end comes back with ``TrioToken.run_sync_soon``.
Cancellation crosses over too: a trio caller cancelled while its coroutine runs
cancels the asyncio task and waits for it to finish (shielded, at most
:data:`CLEANUP_S`), so that what the coroutine does when cancelled (vLLM aborting a
request) has happened when :meth:`~AsyncioThread.run` returns.

A stream of results (vLLM's outputs of one request) crosses with
:meth:`AsyncioThread.stream`: one asyncio task iterates it, and the items that are
ready together reach trio in one wake-up. Each crossing is a wake-up write on the
other loop's socket; one ``run`` per item took two, and they were the larger part of
what vLLM's client cost the worker (docs/performance-vllm.md).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from typing import Generic, TypeVar

import trio

T = TypeVar("T")

#: Seconds a cancelled coroutine may take to finish, and the thread to stop.
CLEANUP_S = 10.0


class AsyncioThread:
    """A running asyncio loop in another thread; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` on the asyncio loop; its result, or its exception, here.

        *fn* is called in the loop's thread (so what it creates belongs to that loop).
        Cancelled from trio, the task is cancelled there and waited for; then
        ``trio.Cancelled`` propagates as usual.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        tasks: list[asyncio.Task[T]] = []

        def settle(_: object) -> None:
            with suppress(trio.RunFinishedError):  # trio's loop is gone: nobody waits
                token.run_sync_soon(done.set)

        async def call() -> T:
            return await fn()

        def start() -> None:
            task = self.loop.create_task(call())
            tasks.append(task)
            task.add_done_callback(settle)

        def cancel() -> None:
            for task in tasks:  # start() ran first: call_soon_threadsafe keeps the order
                task.cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            await done.wait()
        except trio.Cancelled:
            self.loop.call_soon_threadsafe(cancel)
            with trio.move_on_after(CLEANUP_S, shield=True):
                await done.wait()
            raise
        return tasks[0].result()

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, a plain function, called in the loop's thread (vLLM's objects that
        are not thread-safe are used there only)."""

        async def wrapped() -> T:
            return fn()

        return await self.run(wrapped)

    async def stream(self, fn: Callable[[], AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
        """The items of ``fn()``, an async generator iterated on the asyncio loop by one
        task, as they come; its exception, if it raises one, here after its items.

        Items that are ready together arrive together (one wake-up of trio's loop); none
        waits for another. The task does not wait for trio between items: the items a
        slow consumer has not taken yet are held here (at most one request's outputs).
        Closed early (the consumer left, or was cancelled), the task is cancelled and its
        generator closed there (vLLM aborts the request), and that is waited for
        (shielded, at most :data:`CLEANUP_S`) before the close returns.
        """
        relay: _Relay[T] = _Relay(trio.lowlevel.current_trio_token())
        tasks: list[asyncio.Task[None]] = []

        async def pump() -> None:
            try:
                async with aclosing(fn()) as items:
                    async for item in items:
                        relay.put(item)
            except BaseException as exc:
                relay.end(exc)
                if not isinstance(exc, Exception):
                    raise  # asyncio's own cancellation goes on as usual
            else:
                relay.end(None)

        def start() -> None:
            tasks.append(self.loop.create_task(pump()))

        def cancel() -> None:
            for task in tasks:  # start() ran first: call_soon_threadsafe keeps the order
                task.cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            while True:
                items, ended, error = await relay.take()
                for item in items:
                    yield item
                if error is not None:
                    raise error
                if ended:
                    return
        finally:
            if not relay.ended:
                self.loop.call_soon_threadsafe(cancel)
                with trio.move_on_after(CLEANUP_S, shield=True):
                    while not relay.ended:
                        await relay.take()


class _Relay(Generic[T]):
    """Items handed from the asyncio thread to trio, with one wake-up in flight at most.

    The asyncio side appends under the lock and, unless a wake-up is already on its way,
    sends one (``run_sync_soon``); trio takes everything there is under the same lock,
    and the next item sends the next wake-up. The event is only touched in trio's thread
    (the wake-up runs there), and replaced after each take, before any other wake-up can
    run.
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._waking = False  # a wake-up is on its way to trio
        self._event = trio.Event()
        self._ended = False  # set by the asyncio side, under the lock
        self._error: BaseException | None = None
        self.ended = False  # what trio has taken: the end, with the last items

    # -- the asyncio side

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if self._waking:
                return
            self._waking = True
        self._wake()

    def end(self, error: BaseException | None) -> None:
        with self._lock:
            self._ended, self._error = True, error
            if self._waking:
                return
            self._waking = True
        self._wake()

    def _wake(self) -> None:
        with suppress(trio.RunFinishedError):  # trio's loop is gone: nobody waits
            self._token.run_sync_soon(self._set)

    # -- trio's side

    def _set(self) -> None:
        self._event.set()

    async def take(self) -> tuple[list[T], bool, BaseException | None]:
        """What has come since the last take: the items, whether the stream ended, and
        its error (an asyncio cancellation included)."""
        await self._event.wait()
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
            ended, error = self._ended, self._error
        self._event = trio.Event()
        self.ended = ended
        return items, ended, error


@asynccontextmanager
async def open_asyncio_thread(name: str) -> AsyncIterator[AsyncioThread]:
    """An asyncio loop running in a daemon thread named *name* until the block ends;
    then its tasks are cancelled, the loop closed and the thread joined (at most
    :data:`CLEANUP_S`: a daemon thread left behind cannot keep the process alive)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=_serve, args=(loop,), name=name, daemon=True)
    thread.start()
    try:
        yield AsyncioThread(loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(thread.join, CLEANUP_S)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The thread's body: the loop, until stopped; then what is left of its tasks is
    cancelled and run to its end, and the loop closed."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()
