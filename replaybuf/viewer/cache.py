"""The viewer's cache of rendered videos: one folder per server in the temp dir, bounded in bytes.

A server renders an episode's video on first request and keeps it for the next ones. The
videos are kept within ``max_bytes``: once over, the least recently served ones are deleted,
never one being served (``acquire`` pins it until ``release``). Each folder holds an open
``flock`` on its ``.lock`` file for its server's life, which the kernel drops however the
server ends: a later server deletes the folders whose lock it can take (their server was
killed, e.g. by SIGKILL, before ``close``), removing only the files a viewer writes there
(videos, their ``.partial`` temp files and the lock), never anything else.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import threading
from collections import Counter, OrderedDict
from pathlib import Path

__all__ = ["CACHE_PREFIX", "DEFAULT_CACHE_BYTES", "VideoCache", "remove_stale_folders"]

CACHE_PREFIX = "replaybuf-view-"
# rendered videos a server keeps (near-lossless mp4: ~1 MB per 300 frames of 128x128)
DEFAULT_CACHE_BYTES = 1 << 30
LOCK_NAME = ".lock"

# a server's folder: the prefix, its pid (for people reading the temp dir) and mkdtemp's suffix
_FOLDER = re.compile(re.escape(CACHE_PREFIX) + r"[0-9]+-[A-Za-z0-9_]+")
# what a server writes in its folder: videos (``BufferApp._video_path``, an earlier release's
# without ``-rev-N``; ``replay[.field].mp4``
# of ``inspect --serve``), the temp files ``write_atomically`` writes them to, and the lock
_VIDEO = r"(episode-[0-9]+-gen-[0-9]+(-rev-[0-9]+)?-open-[0-9]+\.[^/]+|replay(\.[^/]+)?)"
_OWN_FILE = re.compile(_VIDEO + r"\.mp4|\." + _VIDEO + r"\.[0-9a-f]{8}\.partial\.mp4|" + re.escape(LOCK_NAME))


class VideoCache:
    """A folder of rendered videos kept within ``max_bytes``, least recently served deleted first."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, parent: str | None = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"cache_bytes: expected a positive integer, got {max_bytes!r}")
        parent = parent or tempfile.gettempdir()
        remove_stale_folders(parent)
        self.max_bytes = max_bytes
        # set up under a name no sweep matches, then renamed: a sweep never sees it unlocked
        setup = Path(tempfile.mkdtemp(prefix=f".{CACHE_PREFIX}setup-", dir=parent))
        self._lock_fd: int | None = os.open(setup / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.folder = Path(parent) / f"{CACHE_PREFIX}{os.getpid()}-{setup.name.rsplit('-', 1)[-1]}"
        os.rename(setup, self.folder)
        self._guard = threading.Lock()
        self._sizes: OrderedDict[Path, int] = OrderedDict()  # least recently served first
        self._serving: Counter[Path] = Counter()

    def acquire(self, path: Path) -> bool:
        """Pin the cached video ``path`` while it is served and mark it most recently used;
        False when it is not cached (never rendered, deleted to stay within the budget, or by
        something else, e.g. a temp dir cleaner: then it is rendered again)."""
        with self._guard:
            if path in self._sizes and not self._serving[path] and not path.is_file():
                del self._sizes[path]
            if path not in self._sizes:
                return False
            self._sizes.move_to_end(path)
            self._serving[path] += 1
            return True

    def add(self, path: Path) -> None:
        """Keep the video just rendered at ``path``, pinned (``acquire``) for its first answer."""
        with self._guard:
            self._sizes[path] = path.stat().st_size
            self._sizes.move_to_end(path)
            self._serving[path] += 1
            self._evict()

    def release(self, path: Path) -> None:
        """Unpin ``path`` (its answer is sent), then delete what keeps the cache over budget."""
        with self._guard:
            self._serving[path] -= 1
            if self._serving[path] <= 0:
                del self._serving[path]
            self._evict()

    @property
    def size(self) -> int:
        """Bytes of the videos kept."""
        with self._guard:
            return sum(self._sizes.values())

    def _evict(self) -> None:
        total = sum(self._sizes.values())
        for path in list(self._sizes):
            if total <= self.max_bytes:
                return
            if not self._serving[path]:
                total -= self._sizes.pop(path)
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Delete the files a viewer writes in the folder, then the folder unless something
        else was put there (kept, as the sweep of a killed server's folder keeps it), then let
        the lock go (again: nothing)."""
        try:
            _remove_own_files(self.folder)
        except OSError:  # already gone, or not ours to clean: the next sweep retries
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_stale_folders(parent: str) -> list[Path]:
    """Delete the cache folders in ``parent`` of viewers no longer running (their lock is free):
    only the files a viewer writes, then the folder if nothing else is left. Returns them."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if _FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) and _remove_if_stale(Path(entry.path)):
            removed.append(Path(entry.path))
    return removed


def _remove_if_stale(folder: Path) -> bool:
    """Delete ``folder``'s viewer files when its lock is free (its server is gone)."""
    try:
        if folder.lstat().st_uid != os.getuid():
            return False
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:  # no lock: not a folder this viewer made (or one being set up)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its server runs
            return False
        return _remove_own_files(folder)
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_own_files(folder: Path) -> bool:
    """Delete the files a viewer writes in ``folder`` (never a link's target), then the folder
    if nothing else is left; whether it was."""
    for entry in os.scandir(folder):
        if _OWN_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    with_others = any(True for _ in os.scandir(folder))
    if not with_others:
        folder.rmdir()
    return not with_others
