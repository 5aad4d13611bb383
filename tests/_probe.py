"""The other process of tests/test_hygiene.py's ``other_process_can_write``: forked from
multiprocessing's fork server, which imported replaybuf once and opened nothing, instead of a
new interpreter importing it for each probe (a second each, several on a loaded machine)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from replaybuf import ReplayBuffer


def try_write(location: str, environ: dict[str, str], answer: Connection) -> None:
    """Open ``location`` for writing and send 'opened <episodes it holds>', or the error raised.
    ``environ``: the test's, as the fork server's was taken when it started."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        with ReplayBuffer.from_folder(location) as buffer:
            answer.send(f"opened {len(buffer)}")
    except Exception as error:
        answer.send(f"{type(error).__name__} {error}")
