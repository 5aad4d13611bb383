"""Resource hygiene: a buffer gives back everything it takes, on success and on error paths.

Each test warms a scenario up (process-wide pools and caches are made once), takes a snapshot of
what the process holds (file descriptors, threads, child processes, maps of the buffer's files,
files under the test's folders), repeats the scenario many times and checks that the snapshot
is back where it was: a leak grows with the loop count, a process-wide constant does not.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from replaybuf import ReplayBuffer

pytest_plugins = ["tests._servers"]

FIELDS = {"state": ("float", (4,)), "image": ("uint8", (3, 64, 64)), "reward": "float"}  # image: hot tier
META = {"task": "int"}
LOOPS = 200


@dataclasses.dataclass(frozen=True)
class Held:
    """What this process holds that a buffer could leak; ``watched`` are the folders whose files
    and maps count."""

    fds: frozenset[str]
    threads: tuple[str, ...]
    children: frozenset[int]
    maps: tuple[str, ...]
    files: frozenset[str]

    @classmethod
    def now(cls, *watched: Path) -> Held:
        gc.collect()
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:  # the listing's own descriptor, closed by now
                pass
        roots = tuple(str(folder) for folder in watched)
        with open("/proc/self/maps") as maps:
            mapped = sorted(path for path in map(_mapped_path, maps) if path.startswith(roots))
        files = {str(path) for folder in watched for path in folder.rglob("*") if not path.is_dir()}
        return cls(
            fds=frozenset(fds),
            threads=tuple(sorted(thread.name for thread in threading.enumerate())),
            children=frozenset(child.pid for child in psutil.Process().children(recursive=True)),
            maps=tuple(mapped),
            files=frozenset(files),
        )

    def growth(self, later: Held) -> dict[str, object]:
        """What ``later`` holds beyond this snapshot, by kind (empty when nothing grew)."""
        grown: dict[str, object] = {
            "fds": sorted(later.fds - self.fds),
            "threads": [name for name in later.threads if later.threads.count(name) > self.threads.count(name)],
            "children": sorted(later.children - self.children),
            "maps": sorted(set(later.maps) - set(self.maps)) if len(later.maps) > len(self.maps) else [],
            "files": sorted(later.files - self.files),
        }
        return {kind: what for kind, what in grown.items() if what}


def _mapped_path(line: str) -> str:
    """The file a /proc/self/maps line maps ('' for anonymous memory)."""
    parts = line.split(maxsplit=5)
    return parts[5].strip() if len(parts) == 6 else ""


def assert_no_growth(scenario: Callable[[], None], *watched: Path, loops: int = LOOPS, warm_up: int = 3) -> None:
    """Run ``scenario`` ``warm_up`` times, then ``loops`` times more: what the process holds is
    then what it held after the warm-up."""
    for _ in range(warm_up):
        scenario()
    before = Held.now(*watched)
    for _ in range(loops):
        scenario()
    assert before.growth(Held.now(*watched)) == {}


def store_episodes(buffer: ReplayBuffer, count: int, steps: int = 10) -> None:
    for task in range(count):
        buffer.store_episode(
            state=np.full((steps, 4), task, np.float32),
            image=np.full((steps, 3, 64, 64), task, np.uint8),
            reward=np.zeros(steps, np.float32),
            task=task,
        )


def new_buffer(location: str | Path, **options) -> ReplayBuffer:
    return ReplayBuffer(str(location), max_episodes=8, max_timesteps=20, fields=FIELDS, meta_fields=META, **options)


def other_process_can_write(location: str | Path) -> str:
    """Try a writable open of ``location`` in a fresh process: 'opened' or the error it raised."""
    probe = (
        "import sys\nfrom replaybuf import ReplayBuffer\n"
        "try:\n    ReplayBuffer.from_folder(sys.argv[1]).close()\n    print('opened')\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(location)], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    return done.stdout.strip() or done.stderr.strip()[-500:]


def compactor_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "replaybuf-compactor"]


def collect_until_compactors_end() -> None:
    """Collect garbage until no compactor thread runs: a thread busy with a shard holds its
    writer until the shard is done (bounded: a stuck thread fails the test, never hangs it)."""
    for _ in range(600):
        gc.collect()
        threads = compactor_threads()
        if not threads:
            return
        threads[0].join(0.1)
    assert compactor_threads() == []


@pytest.mark.parametrize("hot_bytes", [1 << 30, 1], ids=["idle-compactor", "busy-compactor"])
def test_writer_dropped_without_close_gives_the_lease_back_and_ends_its_compactor(tmp_path, hot_bytes):
    location = tmp_path / "buffer"

    def write_and_drop():
        store_episodes(new_buffer(location, hot_bytes=hot_bytes), 4)
        collect_until_compactors_end()

    assert_no_growth(write_and_drop, tmp_path, loops=30)
    assert other_process_can_write(location) == "opened"
