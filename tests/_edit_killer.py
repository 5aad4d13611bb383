"""A writer SIGKILLed inside one in-place edit, run as a subprocess (``python -m
tests._edit_killer SPEC``): SPEC is JSON with the buffer's ``location``, ``storage_options``,
the edit's ``kind`` (``update``: every field and meta field; ``update_priorities``: a priority
field) and ``at``, the distinct field whose first storage write kills it (1: the first). A
subprocess, not a fork: the object store clients of the parent (threads, event loops) do not
survive a fork. Exits 3 when the edit ended without reaching that field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from replaybuf import ReplayBuffer

ROOT = Path(__file__).resolve().parent.parent


def run_killed(spec: dict) -> None:
    """Run this module on ``spec`` in a new interpreter; it must die of its SIGKILL."""
    child = subprocess.run(
        [sys.executable, "-m", "tests._edit_killer", json.dumps(spec)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, (
        f"the writer must die inside the edit: {child.returncode} {child.stderr}"
    )


def main(spec: dict) -> None:
    buffer = ReplayBuffer.from_folder(spec["location"], storage_options=spec.get("storage_options"))
    storage, seen, names = buffer.storage, [], set(spec["names"])

    def dying(method):
        def write(name, *args, **kwargs):
            if name in names and name not in seen:
                seen.append(name)
                if len(seen) == spec["at"]:
                    os.kill(os.getpid(), signal.SIGKILL)
            return method(name, *args, **kwargs)

        return write

    for method in ("update_rows", "update_steps", "write_meta"):
        setattr(storage, method, dying(getattr(storage, method)))
    episodes = np.asarray(spec["episodes"])
    if spec["kind"] == "update":
        buffer.update(episodes, **{name: np.asarray(v) for name, v in spec["values"].items()})
    else:
        steps = np.asarray(spec["steps"])
        indices = np.stack([episodes, steps], axis=1)
        buffer.update_priorities(indices, np.asarray(spec["priorities"], np.float32), spec["priority_field"])
    os._exit(3)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
