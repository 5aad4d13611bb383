"""Child processes for tests/test_writer_lease.py: ``python -m tests._lease_child MODE JSON``.

JSON holds ``location``, ``kwargs`` (ReplayBuffer keyword arguments) and per-mode settings.
Every mode reports on stdout, one line each, flushed:

- ``hold``: open for writing, store one episode, print ``ready <pid> <child pid>``, wait for
  stdin to close (or a kill); with ``fork`` it first forks a child that sleeps 60 s holding the
  inherited objects (else the child pid is ``None``).
- ``store``: open for writing (creating if needed), print ``ready``, store episodes (meta
  ``uid`` = 0, 1, 2, ..., data ``x`` filled with the uid) until stdin closes or it is full (then
  wait for stdin to close: the lease is held until told), close, then print the stored uids as JSON.
- ``churn``: open for writing (creating if needed; pass ``circular`` in kwargs), print ``ready``,
  store episodes (uid ``i``: ``1 + i % max_timesteps`` steps of ``x`` filled with ``i``) until
  stdin closes, close, then print the count stored.
- ``try``: attempt a writable open (with ``overwrite`` if given) every 50 ms for ``seconds``; print JSON
  ``{"opened": n, "refused": n, "message": last error, "holder": its holder}``.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

import numpy as np

from replaybuf import BufferLockedError, ReplayBuffer

FIELDS = {"x": ("float", 4)}
META = {"uid": "int"}


def _open(args: dict) -> ReplayBuffer:
    overwrite = args.get("overwrite", False)
    return ReplayBuffer(args["location"], fields=FIELDS, meta_fields=META, overwrite=overwrite, **args["kwargs"])


def _episode(uid: int) -> dict:
    return {"x": np.full((3, 4), uid, np.float32)}


def _stdin_closed() -> bool:
    return bool(select.select([sys.stdin], [], [], 0)[0]) and not sys.stdin.readline()


def main(mode: str, args: dict) -> None:
    if mode == "hold":
        buffer = _open(args)
        buffer.store_episode(**_episode(0), uid=0)
        child = None
        if args.get("fork"):
            started, report = os.pipe()
            child = os.fork()
            if child == 0:  # fork handlers have run: the child has closed its copy of the lock
                os.write(report, b"1")
                time.sleep(60)
                os._exit(0)
            os.read(started, 1)
        print(f"ready {os.getpid()} {child}", flush=True)
        sys.stdin.read()
        buffer.close()
    elif mode == "store":
        buffer = _open(args)
        print("ready", flush=True)
        uids: list[int] = []
        while len(uids) < buffer.max_episodes and not _stdin_closed():
            buffer.store_episode(**_episode(len(uids)), uid=len(uids))
            uids.append(len(uids))
        if len(uids) == buffer.max_episodes:  # full before told to stop: keep the lease until then
            sys.stdin.read()
        buffer.close()
        print(json.dumps(uids), flush=True)
    elif mode == "churn":
        buffer = _open(args)
        print("ready", flush=True)
        count = 0
        while not _stdin_closed():
            length = 1 + count % buffer.max_timesteps
            buffer.store_episode(x=np.full((length, 4), count, np.float32), uid=count)
            count += 1
        buffer.close()
        print(count, flush=True)
    elif mode == "try":
        result = {"opened": 0, "refused": 0, "message": None, "holder": None}
        deadline = time.monotonic() + args["seconds"]
        while time.monotonic() < deadline:
            try:
                _open(args).close()
                result["opened"] += 1
            except BufferLockedError as error:
                result.update(refused=result["refused"] + 1, message=str(error), holder=error.holder)
            time.sleep(0.05)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
