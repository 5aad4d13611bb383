"""The exit hook of ``storage._settle``: no request on zarr's IO loop is left in flight, and no
thread is left handing a result to the loop, when the interpreter finalizes (the subprocess
test is ``test_remote_hostile``'s ``slow-delivery``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from replaybuf.storage import _settle


def in_thread(coro) -> tuple[threading.Thread, list]:
    """Run ``coro`` through ``_settle.run`` in a daemon thread; its result (or error) lands in the list."""
    got: list = []

    def target():
        try:
            got.append(_settle.run(coro))
        except BaseException as error:
            got.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, got


async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


def wait_for_tasks(count: int) -> None:
    loop = _settle.guarded_loop()
    deadline = time.monotonic() + 5
    while len(asyncio.all_tasks(loop)) < count and time.monotonic() < deadline:
        time.sleep(0.005)


def test_settle_waits_for_a_request_in_flight():
    thread, got = in_thread(slow(0.3))
    wait_for_tasks(1)
    _settle.settle()
    assert not asyncio.all_tasks(_settle.guarded_loop())
    thread.join(5)
    assert got == ["done"]


def test_settle_cancels_a_request_still_in_flight_after_its_timeout(caplog):
    thread, got = in_thread(slow(60))
    wait_for_tasks(1)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="replaybuf.storage._settle"):
        _settle.settle(timeout=0.1)
    thread.join(5)
    assert time.monotonic() - started < _settle.GRACE_SECONDS + 1
    assert len(got) == 1 and isinstance(got[0], concurrent.futures.CancelledError)
    assert "cancelling 1 store requests still in flight at exit" in caplog.text


def test_settle_waits_for_a_thread_handing_a_result_to_the_loop(monkeypatch):
    loop = _settle.guarded_loop()
    write_to_self, started, finished = loop._write_to_self, threading.Event(), []

    def slow_write_to_self():  # the GIL given up while writing the wake-up byte, for a while
        write_to_self()
        if threading.current_thread().name == "deliverer":
            started.set()
            time.sleep(0.3)
            finished.append(True)

    monkeypatch.setattr(loop, "_write_to_self", slow_write_to_self)
    deliverer = threading.Thread(target=loop.call_soon_threadsafe, args=(lambda: None,), name="deliverer", daemon=True)
    deliverer.start()
    assert started.wait(5)
    _settle.settle()
    assert finished == [True]


def test_the_loop_is_guarded_once():
    loop = _settle.guarded_loop()
    counted = loop.call_soon_threadsafe
    assert _settle.guarded_loop() is loop and loop.call_soon_threadsafe is counted
    assert _settle.run(slow(0)) == "done"
    assert not _settle._delivering
