"""Calls that must refuse a FIFO at a stored file's name, never wait on it (a plain open of a
FIFO waits forever for a writer to it)."""

from __future__ import annotations

import os
import threading

from replaybuf import BufferDamagedError

WAIT_S = 30  # bound on waiting for the calls' thread (never reached when it works)


def refused_never_waited_on(fifo: str, calls: list) -> None:
    """Each call raises OSError (or BufferDamagedError) naming ``fifo`` ("not a regular file"): run in a thread, and when
    one blocks on opening the FIFO (a plain open waits forever for a writer to it), the FIFO is
    opened for writing to let it go and the test fails."""
    errors: list[BaseException] = []

    def run() -> None:
        for call in calls:
            try:
                call()
            except (OSError, BufferDamagedError) as e:
                errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    while thread.is_alive():  # the fix is missing: let each open waiting on the FIFO go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(1)
        errors.append(AssertionError(f"a call waited on the FIFO {fifo}"))
    assert len(errors) == len(calls) and all("not a regular file" in str(e) and fifo in str(e) for e in errors), errors
