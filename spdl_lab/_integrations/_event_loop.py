"""An asyncio event loop in its own thread, for the async stages of a converted SPDL pipeline.

No runner knows the loop exists, so each thread that submits holds a *lease* in thread-local
storage, dropped as the thread ends (before its ``join()`` returns): the last lease gone stops the
loop, so closing a Loader stops it too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["LoopThread"]


class LoopThread:
    """One event loop in a daemon thread, started on first use; a pickled copy starts its own."""

    def __init__(self, name: str = "spdl_lab:async-stages") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._local = threading.local()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._leases = 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoopThread, (self.name,))

    def run(self, make: Callable[[Any], Awaitable[Any]], arg: Any) -> Any:
        """``await make(arg)`` on the loop; block this thread until it is done."""
        future = asyncio.run_coroutine_threadsafe(_await(make, arg), self._loop_here())
        try:
            return future.result()
        finally:
            # A traceback holds this frame: no future in it, so no cycle waits for the collector.
            del future

    def _loop_here(self) -> asyncio.AbstractEventLoop:
        """The loop, leased to the calling thread (the lease must never sit in a
        frame that a traceback can hold, or it outlives its thread)."""
        lease = getattr(self._local, "lease", None)
        if lease is None:
            lease = self._local.lease = self._acquire()
        return lease.loop

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _acquire(self) -> _Lease:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                thread = threading.Thread(target=_serve, args=(loop, ready), name=self.name, daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            self._leases += 1
            return _Lease(self, self._loop)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        # Runs while a worker thread is being torn down: no joins, no current_thread().
        with self._lock:
            self._leases -= 1
            if self._leases > 0:
                return
            self._loop = self._thread = None
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed (interpreter shutdown)
            pass


class _Lease:
    __slots__ = ("owner", "loop")

    def __init__(self, owner: LoopThread, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.loop = loop

    def __del__(self) -> None:
        try:
            self.owner._release(self.loop)
        except Exception:  # interpreter shutdown: the daemon loop thread dies with it
            pass


async def _await(make: Callable[[Any], Awaitable[Any]], arg: Any) -> Any:
    # run_coroutine_threadsafe takes coroutines only; ``make`` may return any awaitable.
    return await make(arg)


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
    finally:
        try:
            tasks = asyncio.all_tasks(loop)  # a call interrupted in its thread leaves its task
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
