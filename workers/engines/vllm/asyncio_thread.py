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
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import TypeVar

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
