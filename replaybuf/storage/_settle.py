"""No native request thread may be inside Python when the interpreter finalizes.

obstore completes an ``*_async`` request on a thread of its Rust (tokio) runtime, which takes
the GIL and hands the result to the event loop with ``call_soon_threadsafe``
(pyo3-async-runtimes' ``set_result``). Writing the loop's wake-up byte releases the GIL: the loop
may run the completion meanwhile, the caller waiting in ``sync`` return and the interpreter
begin to finalize. When the Rust thread then takes the GIL back, CPython (before 3.14) ends it
with ``pthread_exit``, whose forced unwind through Rust frames aborts the process (SIGABRT at
exit, after the process did everything right). A request still in flight at exit does the same
when it completes.

Every request of replaybuf's stores runs on zarr's IO loop. ``run`` guards that loop: its
``call_soon_threadsafe`` counts the calls under way, and an exit hook, run before zarr's (which
stops the loop), waits until the loop's tasks are done and no such call is under way.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# how long the exit hook waits for requests in flight before cancelling them (a lease renewal
# retrying against a store that is down), then for the cancelled ones and the deliveries under way
SETTLE_SECONDS = 10.0
GRACE_SECONDS = 2.0

# one entry per call of a guarded loop's ``call_soon_threadsafe`` under way, from any thread
_delivering: dict[object, None] = {}
_guarded: weakref.ref[asyncio.AbstractEventLoop] | None = None


def _counted(deliver: Callable[..., Any]) -> Callable[..., Any]:
    """``deliver`` (a loop's ``call_soon_threadsafe``), registered in ``_delivering`` while it runs."""

    def call_soon_threadsafe(callback: Callable[..., Any], *args: Any, context: Any = None) -> Any:
        token = object()
        _delivering[token] = None
        try:
            return deliver(callback, *args, context=context)
        finally:
            # no call follows this deletion, so the thread cannot give up the GIL (and need it
            # back) after the exit hook saw it leave
            del _delivering[token]

    return call_soon_threadsafe


def guarded_loop() -> asyncio.AbstractEventLoop:
    """zarr's IO loop (started if need be), its ``call_soon_threadsafe`` counted; the exit hook
    is registered with the first loop, after zarr's own, so it runs before zarr stops the loop."""
    global _guarded
    from zarr.core.sync import _get_loop

    loop = _get_loop()
    if _guarded is None or _guarded() is not loop:
        # an attribute of this loop object, which shadows the method for every caller
        vars(loop)["call_soon_threadsafe"] = _counted(loop.call_soon_threadsafe)
        if _guarded is None:
            atexit.register(settle)
        _guarded = weakref.ref(loop)
    return loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on zarr's IO loop (``zarr.core.sync.sync``), guarded for exit."""
    from zarr.core.sync import sync

    return sync(coro, loop=guarded_loop())


async def _settle_tasks(timeout: float) -> None:
    """On the loop: wait for its other tasks (at most ``timeout``), then cancel those left."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if not others:
        return
    _, pending = await asyncio.wait(others, timeout=timeout)
    if pending:
        logger.warning("cancelling %d store requests still in flight at exit", len(pending))
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=GRACE_SECONDS)


def settle(timeout: float = SETTLE_SECONDS) -> None:
    """Wait until the requests on zarr's IO loop are done (cancelling those still in flight
    after ``timeout``) and no thread is handing a result to the loop. The exit hook."""
    loop = None if _guarded is None else _guarded()
    if loop is not None and loop.is_running():
        done = asyncio.run_coroutine_threadsafe(_settle_tasks(timeout), loop)
        with contextlib.suppress(Exception):  # the loop stopped or stuck: nothing more to wait for
            done.result(timeout + GRACE_SECONDS + 1)
    deadline = time.monotonic() + GRACE_SECONDS
    while _delivering and time.monotonic() < deadline:
        time.sleep(0.001)  # gives the GIL to the delivering thread


# a forked child has none of its parent's threads (zarr makes it a new loop)
os.register_at_fork(after_in_child=_delivering.clear)
