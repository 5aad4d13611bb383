"""Writer leases: one writer per buffer, across processes and machines.

A writable open takes the buffer's lease before it erases or writes anything, and gives it back
at close (or when the buffer is garbage collected, or the interpreter exits). Readers never take
it. Writable opens of one buffer within one process share the lease (``take``). Both kinds keep
the lease under the key ``replaybuf/writer.lock`` of the buffer, holding JSON ``{host, pid,
since, ...}`` that names the holder for the error a second writer gets.

- ``FileLease`` (local folders, every backend): ``fcntl.flock`` on that file and on the
  buffer's folder (so deleting the file lets no second writer in). The kernel drops the locks
  when the holding process dies, however it dies, so a local lock is never stale.
- ``ProcessLease`` (``memory://``, which lives in one process): held by this process alone.
- ``ObjectLease`` (zarr on ``s3://``, ``gs://``): an object created with a
  conditional write (``If-None-Match: *``) that a daemon thread renews every quarter of its
  expiry. A crashed writer's lease can be taken over once it has expired, or at once with
  ``break_lock=True`` / ``replaybuf unlock``. A writer whose lease was taken over notices at its
  next renewal and refuses every further write.

  Where the store replaces an object conditionally (``StoreKV.replaces_conditionally``: S3
  through obstore, a PUT with ``If-Match`` on the ETag read), renewals and take-overs write
  only over the record they read: a renewal never overwrites a take-over, and of two writers
  taking over one expired lease at once exactly one wins (a take-over reads its record back,
  in case an S3-compatible server ignores If-Match). gcsfs (``gs://``) and s3fs (``s3://``
  with options obstore lacks, or in a forked child) offer no such write: there a take-over
  writes unconditionally and reads back, and a renewal reads the token then writes, so two
  writers may overlap until the loser's next renewal (at most a quarter of the expiry).
  Release reads the record and deletes it unconditionally everywhere (obstore's DELETE takes no
  ``If-Match``).

Expiry comes from ``REPLAYBUF_LEASE_SECONDS`` (default 60 s) in the writer's environment, read
when the lease is taken; an object-store writer must renew within that time or lose the lease.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import fcntl
import gc
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard

if TYPE_CHECKING:
    from ._kv import ObjectVersion, StoreKV

LEASE_KEY = "replaybuf/writer.lock"
# the errors of a folder this process may not write (permissions, a read-only file system)
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# the most bytes of a lease record read (one is ~100): a larger file or object is damage
RECORD_BYTES = 1 << 16
DEFAULT_LEASE_SECONDS = 60.0
# tries of a take-over: the record it read changed before its conditional write landed, or
# (stores without one) the holder it breaks renewed over its write in the same moment
TAKE_OVER_TRIES = 3
# the pause between those tries on stores without a conditional write
TAKE_OVER_PAUSE_S = 0.05
LEASE_SECONDS_ENV = "REPLAYBUF_LEASE_SECONDS"
# how long a writer's open waits for a contended flock before calling the buffer locked: a
# process asking who writes (``holder()``: info, verify, a reader mid-edit) holds a shared one
# for a moment, which is no writer
PROBE_WAIT_S = 0.05

logger = logging.getLogger(__name__)


def _flock_exclusive(fd: int) -> None:
    """An exclusive flock on ``fd``; BlockingIOError when another holds one for longer than a
    probe does (``PROBE_WAIT_S``)."""
    deadline = time.monotonic() + PROBE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


_SHARDS_HINT = (
    "A buffer takes one writer at a time. To write in parallel, give each writer its own shard "
    "(ReplayBuffer.shard(root, i)) and read them together with ConcatReplayBuffer(root); "
    "to read alongside the writer, open it with read_only=True."
)


class BufferLockedError(RuntimeError):
    """Another writer holds the buffer's writer lease (or took it over from this one).

    ``holder`` is the holder's record (``host``, ``pid``, ``since``, ...) or None when unreadable.
    """

    def __init__(self, message: str, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder


def lease_seconds() -> float:
    """The expiry of object-store leases taken now (``REPLAYBUF_LEASE_SECONDS``, default 60)."""
    raw = os.environ.get(LEASE_SECONDS_ENV)
    if raw is None:
        return DEFAULT_LEASE_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{LEASE_SECONDS_ENV} must be a positive number of seconds, got {raw!r}")
    return seconds


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _record(**extra: Any) -> dict:
    """Who is taking the lease: host, pid, start time and program."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": _now(),
        "program": " ".join(sys.argv)[:200],
        **extra,
    }


def describe_holder(holder: dict | None) -> str:
    """``pid 123 on host 'a' since 2026-...`` (or what is known of it)."""
    if not holder:
        return "an unknown writer (its lock record is empty or unreadable)"
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} since {holder.get('since')}"


class WriterLease(ABC):
    """The right to write one buffer, held by at most one open at a time.

    ``lost`` is None while the lease is held, else a message saying why writing must stop.
    """

    def __init__(self, location: str):
        self.location = location
        self.lost: str | None = None
        self._pid = os.getpid()
        self._users = 0  # the opens of this process sharing the lease (``take``)
        # bumped by an erasing open in this process: the opens that shared the lease before it
        # write to a buffer that no longer exists, so they may not write at all (``take``)
        self.epoch = 0
        # the buffer object of this process that wrote last through the lease: another one
        # reloads what it committed before writing (``ReplayBuffer._take_turn``)
        self.turn: weakref.ref | None = None
        # the counters of that object when a garbage collection freed it before it could write
        # them to a remote store (``ReplayBuffer.__del__``): the next one to write writes them
        self.orphaned_state: dict[str, Any] | None = None
        # held by every write of the buffer objects of this process sharing the lease (their
        # ``ReplayBuffer._lock``): taking turns reloads what the other committed, which two
        # objects writing at once from two threads cannot (both took the same slots)
        self.lock = threading.RLock()
        # taking it found a stopped writer's record (``stopped``): what that writer was doing
        # may be half done, until this writer's open recovers it (``Committer.recover``)
        self.inherited = False

    @property
    def key(self) -> str:
        """What identifies the buffer's lease within this process."""
        return f"{type(self).__name__}:{self.location}"

    @abstractmethod
    def acquire(self, break_lock: bool = False) -> None:
        """Take the lease, or raise BufferLockedError naming the holder."""

    @abstractmethod
    def release(self) -> None:
        """Give the lease back (a no-op when not held, or in a forked child of the holder)."""

    def _after_fork(self) -> None:
        """In a forked child of the holder: the child holds no lease and must not write."""
        self.lost = "this process is a fork of the writer; it holds no writer lease"

    def check_held(self) -> None:
        """Set ``lost`` where the lease no longer guards the buffer at its location; a no-op for
        leases that notice it otherwise (an object store's renewal)."""

    def release_soon(self) -> None:
        """``release`` for a garbage-collection finalizer, which may run in any thread at any
        allocation (inside a thread pool's or an event loop's lock): it must not wait for I/O."""
        self.release()

    @abstractmethod
    def holder(self) -> dict | None:
        """The current holder's record, or None when nobody holds the lease."""

    def live_holder(self) -> dict | None:
        """``holder`` when it is a running writer's: None when nobody holds the lease or an
        object-store lease is past its expiry (a stopped writer's)."""
        holder = self.holder()
        if holder is not None and "expires" in holder and not float(holder["expires"]) > time.time():
            return None
        return holder

    def stopped(self) -> bool:
        """Whether a writer stopped without giving the lease back (killed): its record is
        left and nobody holds it. None of this process's opens holds it either."""
        return self.holder() is not None and self.live_holder() is None

    @abstractmethod
    def unlock(self) -> dict | None:
        """Remove the lease whoever holds it (``replaybuf unlock``: the writer it was taken from
        refuses every further write from its next renewal) and return the removed record; a
        local lock, whose holder is always alive, is refused."""

    def _locked_error(self, holder: dict | None, how_to_break: str) -> BufferLockedError:
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            how_to_break = f"It is this process: close() the other writable ReplayBuffer on it first. {how_to_break}"
        return BufferLockedError(
            f"cannot open {self.location!r} for writing: it is being written by {describe_holder(holder)}. "
            f"{_SHARDS_HINT} {how_to_break}",
            holder,
        )


class FileLease(WriterLease):
    """``flock`` on ``<root>/replaybuf/writer.lock``, dropped by the kernel with its process.

    flock belongs to an open file description: a second open of the file is refused even in
    the same process (``take`` shares one lease among a process's opens instead), and a forked
    child shares its parent's lock (so a child closes its copy at fork). Release deletes the
    lock file (where its path still names it), and the folders that taking it created, so a
    refused or failed open leaves a folder as it was; taking the lock checks that the file it
    locked is still the one at the path, so deleting it races with no other writer.
    """

    def __init__(self, root: str):
        super().__init__(root)
        self.path = os.path.join(root, *LEASE_KEY.split("/"))
        self._fd: int | None = None
        self._folder_fd: int | None = None  # the folder, locked too (``_lock_folder``)
        self._locked: tuple[int, int] = (0, 0)
        self._folder: tuple[int, int] = (0, 0)
        self._created: list[str] = []

    @property
    def key(self) -> str:
        # docstring inherited
        return f"file:{os.path.realpath(self.path)}"

    def _read_record(self) -> dict | None:
        try:
            with open(self.path, "rb") as f:
                return json.loads(f.read(RECORD_BYTES) or b"null")
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
            return None

    def _lock(self) -> int:
        """An open descriptor of the lock file holding the flock; BlockingIOError when held.
        StorageError naming a symbolic link at the lock file's path or its folder's: taking
        the lease truncates and writes the file, which must be the buffer's own."""
        folder = os.path.dirname(self.path)
        if os.path.islink(folder):
            self._refuse_link(folder)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._refuse_link(self.path)
                raise
            try:
                _flock_exclusive(fd)
                with contextlib.suppress(FileNotFoundError):  # deleted by the holder releasing it
                    if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                        return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def acquire(self, break_lock: bool = False) -> None:
        # docstring inherited
        if self._fd is not None:
            return
        folders = [os.path.dirname(self.path), self.location]
        self._created = [folder for folder in folders if not os.path.isdir(folder)]
        try:
            os.makedirs(folders[0], exist_ok=True)
            found = os.path.lexists(self.path)  # a killed writer's (a live one's refuses below)
            fd = self._lock()
        except BlockingIOError:
            self._remove_created()
            raise self._locked_error(
                self._read_record(),
                "The lock is released when that process exits; it cannot be stale, so break_lock "
                "does not apply: stop that process to take over.",
            ) from None
        except OSError as e:
            if e.errno not in _NOT_WRITABLE:
                raise
            self._remove_created()
            raise type(e)(e.errno, self._not_writable_message(e), e.filename) from e
        try:
            os.ftruncate(fd, 0)
            record = json.dumps(_record()).encode()
            if os.pwrite(fd, record, 0) != len(record):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            # given back at once (a full disk): a descriptor kept would hold the flock, and
            # every later open of this process would find the buffer locked by "an unknown writer"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(fd)
            self._remove_created()
            from .base import StorageError  # base imports this module

            raise StorageError(f"cannot write the writer lease {self.path!r}: {e.strerror or e}") from e
        try:
            self._folder_fd = self._lock_folder()
        except BlockingIOError:
            self._unlink_own(fd)  # the file this open made: the holder's was deleted
            os.close(fd)
            self._remove_created()
            raise self._locked_error(
                {},
                "That writer holds the buffer's folder though its writer.lock is gone (deleted while it "
                "wrote); it cannot be stale: close() that writer, or stop its process, to take over.",
            ) from None
        self._fd, self._pid, self.inherited = fd, os.getpid(), found
        locked = os.fstat(fd)
        self._locked = (locked.st_dev, locked.st_ino)  # the file locked, for ``check_held``
        if self._folder_fd is not None:
            folder = os.fstat(self._folder_fd)
            self._folder = (folder.st_dev, folder.st_ino)
        _held.add(self)

    def release(self) -> None:
        # docstring inherited
        fd, self._fd = self._fd, None
        _held.discard(self)
        if fd is None:
            return
        folder_fd, self._folder_fd = self._folder_fd, None
        try:
            if self._pid == os.getpid():
                # a folder this process may no longer write (made read-only, or its file system
                # remounted so) keeps the file, unlocked: the next writer takes it over as a
                # stopped writer's (``inherited``); raising here would keep the flock below
                with contextlib.suppress(OSError):
                    self._unlink_own(fd)
                self._remove_created()
        finally:
            os.close(fd)  # closing the last descriptor of the open file drops the flock
            if folder_fd is not None:
                os.close(folder_fd)

    def _unlink_own(self, fd: int) -> None:
        """Delete the lock file ``fd`` locks, only where the path still names it: the folder may
        have moved (``upgrade`` swaps another in), and the path then names the lock file of a
        writer of that folder."""
        with contextlib.suppress(FileNotFoundError):
            locked, named = os.fstat(fd), os.stat(self.path)
            if (locked.st_dev, locked.st_ino) == (named.st_dev, named.st_ino):
                os.unlink(self.path)

    def _lock_folder(self) -> int | None:
        """A descriptor of the buffer's folder holding an exclusive flock, which the holder keeps
        with its lock file's: deleting ``writer.lock`` ("a stale lock") under a live writer lets
        no second writer in. None where the file system locks no folder; BlockingIOError when
        another open holds it."""
        try:
            fd = os.open(self.location, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            _flock_exclusive(fd)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:  # no flock on folders here (some network file systems)
            os.close(fd)
            return None
        return fd

    def check_held(self) -> None:
        # docstring inherited: the path must still name the folder this lease locks (or, where
        # folders take no lock, its lock file). A folder moved away (renamed, replaced by another
        # buffer or a link to one) would send the writes that go by path into whatever is there
        # now, where another writer may hold the lease: this writer stops writing
        if self._fd is None or self.lost is not None or self._pid != os.getpid():
            return
        path, identity = (self.location, self._folder) if self._folder_fd is not None else (self.path, self._locked)
        try:
            named = os.stat(path)
        except OSError:
            named = None
        if named is None or (named.st_dev, named.st_ino) != identity:
            self.lost = (
                f"{path!r} is no longer the one this writer locked (the buffer's folder was moved, renamed or "
                "replaced since it was opened), so it writes nothing more there: another writer may hold "
                "the folder there now. Open the buffer again to write"
            )
            logger.error("%s; this writer stops writing", self.lost)

    def _refuse_link(self, path: str) -> NoReturn:
        from .base import StorageError  # base imports this module

        raise StorageError(
            f"refusing to open {self.location!r} for writing: {path!r} is a symbolic link (to "
            f"{os.readlink(path)!r}), and taking the writer lease would write through it. Nothing was "
            "written; remove the link (a buffer's replaybuf/ folder and its files are its own)"
        )

    def _not_writable_message(self, error: OSError) -> str:
        """Why a writable open of a folder this process may not write failed, and how to read it."""
        return (
            f"cannot write to {self.location!r}: its writer lease cannot be taken "
            f"({error.strerror or error}: the folder or its file system is read-only to this process). "
            "Nothing was written; open an existing buffer there with read_only=True to read it"
        )

    def _remove_created(self) -> None:
        """Remove the folders ``acquire`` created, where still empty."""
        for folder in self._created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        self._created = []

    def _after_fork(self) -> None:
        # docstring inherited: close the child's copy, so the lock still dies with the holder
        for fd in (self._fd, self._folder_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._folder_fd = None
        _held.discard(self)
        super()._after_fork()

    def stopped(self) -> bool:
        # docstring inherited: a lock file nobody locks (a release deletes it)
        return self._fd is None and os.path.lexists(self.path) and self.holder() is None

    def holder(self) -> dict | None:
        # docstring inherited: probed through a read-only descriptor with a shared lock, which
        # a writer's exclusive one refuses, so asking creates and writes nothing (a killed
        # writer's lock file on a folder this process may not write is read as well)
        if self._fd is not None:
            return self._read_record()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self._folder_holder()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._read_record() or {}
        finally:
            os.close(fd)
        return self._folder_holder()

    def _folder_holder(self) -> dict | None:
        """{} (a writer, unknown) when a writer whose lock file was deleted holds the folder."""
        try:
            fd = os.open(self.location, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return {}
        except OSError:
            return None
        finally:
            os.close(fd)
        return None

    def unlock(self) -> dict | None:
        # docstring inherited
        holder = self.holder()
        if holder is not None:
            raise BufferLockedError(
                f"unlock: {self.location!r} is being written by {describe_holder(holder)}, which is running: a "
                "local lock is released when its process exits, so it is never stale and is not removed. "
                "Nothing was changed; stop that process instead",
                holder,
            )
        return None


class ProcessLease(WriterLease):
    """The lease of a ``memory://`` buffer, which lives in one process: this process holds it
    (opens share it through ``take``), with no object and no heartbeat; a thread renewing an
    object in fsspec's memory store would race every listing of that store."""

    _record: dict | None = None  # this process's lease record while it holds the lease

    def acquire(self, break_lock: bool = False) -> None:
        # docstring inherited: nothing else can hold it (``take`` shares it within the process)
        self._record = _record()
        _held.add(self)

    def release(self) -> None:
        # docstring inherited
        _held.discard(self)
        self._record = None

    def holder(self) -> dict | None:
        # docstring inherited: the lease this process holds on the buffer, through any object
        held = _in_process.get(self.key, self)
        return getattr(held, "_record", None)

    def unlock(self) -> dict | None:
        # docstring inherited: the holder is this process, which gives it back by closing
        return self.holder()


def _expiry(holder: dict) -> float:
    """When ``holder``'s lease expires (Unix time): 0, expired, where its record does not say it
    as a finite number (damaged, like a record that is not JSON)."""
    try:
        expires = float(holder.get("expires", 0))
    except (TypeError, ValueError):
        return 0.0
    return expires if math.isfinite(expires) else 0.0


def _moment(unix_time: float) -> str:
    """``unix_time`` as an ISO date for messages (a damaged record's may be beyond any date)."""
    try:
        return datetime.fromtimestamp(unix_time, UTC).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return f"Unix time {unix_time:g}"


def _parse_record(raw: bytes | None) -> dict:
    """The lease record in ``raw``; {} where damaged (not a JSON object, or None: too large)."""
    if raw is None:
        return {}
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return {}
    return record if isinstance(record, dict) else {}


class ObjectLease(WriterLease):
    """A lease object on an object store, created with ``If-None-Match: *`` and renewed by a
    heartbeat thread; it holds ``{host, pid, since, expires, token}`` (``expires`` in Unix time).

    Parameters
    ----------
    kv
        The buffer's store.
    location
        The buffer's URL, for messages.
    seconds
        How long the lease lasts without renewal; ``lease_seconds()`` when None.
    identity
        The buffer as this process tells it from others (``key``): its URL in one spelling and
        its endpoint, so that two spellings of one buffer share one lease and one URL on two
        servers takes two; ``location`` when None.
    """

    def __init__(self, kv: StoreKV, location: str, seconds: float | None = None, identity: str | None = None):
        super().__init__(location)
        self.identity = location if identity is None else identity
        self.kv = kv
        self.seconds = lease_seconds() if seconds is None else seconds
        self.token: str | None = None
        self._stop = threading.Event()
        self._release_requested = False
        self._release_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # until when the lease is surely ours: the expiry it was last taken or renewed with,
        # counted from before that request (``check_held``)
        self._valid_until = 0.0

    @property
    def key(self) -> str:
        # docstring inherited
        return f"{type(self).__name__}:{self.identity}"

    def _read_record(self) -> dict | None:
        try:  # a record is ~100 bytes: a larger object is damage, refused unread (a ValueError)
            raw = self.kv.get_document(LEASE_KEY, RECORD_BYTES)
        except ValueError:
            return {}
        return None if raw is None else _parse_record(raw)

    def _read_versioned(self) -> tuple[dict, ObjectVersion] | None:
        """The record and its version, in one GET (stores that replace conditionally); None
        when there is no lease object."""
        got = self.kv.get_versioned(LEASE_KEY, RECORD_BYTES)
        return None if got is None else (_parse_record(got.data), got.version)

    def _ours(self, record: dict | None) -> TypeGuard[dict]:
        """Whether ``record`` is this lease's (its token)."""
        return record is not None and self.token is not None and record.get("token") == self.token

    def _new_record(self) -> bytes:
        return json.dumps(_record(expires=time.time() + self.seconds, token=self.token)).encode()

    def acquire(self, break_lock: bool = False) -> None:
        # docstring inherited
        if self.token is not None:
            return
        self.token = uuid.uuid4().hex
        started = time.time()
        try:
            if not self.kv.create(LEASE_KEY, self._new_record()):
                self._take_over(break_lock)
                self.inherited = True
        except BaseException:
            self.token = None
            raise
        self.lost, self._pid, self._release_requested = None, os.getpid(), False
        self._valid_until = started + self.seconds
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"replaybuf-lease-{self.location}", daemon=True)
        self._thread.start()
        _held.add(self)
        # exit hooks run last registered first: this one must run before zarr's, which stops the
        # event loop every request of the store runs on
        atexit.unregister(_release_at_exit)
        atexit.register(_release_at_exit)

    def _take_over(self, break_lock: bool) -> None:
        """Replace an expired (or, with ``break_lock``, any) lease by ours, or raise
        BufferLockedError naming the holder."""
        if self.kv.replaces_conditionally:
            self._take_over_if_unchanged(break_lock)
        else:
            self._take_over_unconditionally(break_lock)

    def _take_over_if_unchanged(self, break_lock: bool) -> None:
        """Write ours over the record read, conditional on its version: a renewal or another
        take-over landing in between refuses ours, and the record is read and judged again
        (two writers taking over one expired lease: the first write wins, the other is refused
        as by a live holder)."""
        holder = None
        for _ in range(TAKE_OVER_TRIES):
            got = self._read_versioned()
            if got is None:  # released meanwhile
                if self.kv.create(LEASE_KEY, self._new_record()):
                    return
                continue
            holder, version = got
            if self._ours(holder):  # our write landed; the client's retry of it was refused
                return
            self._check_takeable(holder, break_lock)
            if self.kv.replace_if(LEASE_KEY, self._new_record(), version):
                # read back: an S3-compatible server that ignores If-Match wrote ours
                # unconditionally, and another take-over may have landed over it
                now = self._read_record()
                if self._ours(now):
                    return
                holder = now
                break
        raise self._locked_error(holder, "Another writer took the expired lease at the same time.")

    def _take_over_unconditionally(self, break_lock: bool) -> None:
        """Write ours over the record read, then check that ours stands (stores without a
        conditional replace).

        Two writers taking over the same expired lease at once may both write theirs, and the
        re-read below cannot tell which write lands last if both read back before the other
        writes. Each renewal re-reads the token first, so the writer whose lease was replaced
        stops writing at its next renewal: two writers overlap for at most ``seconds / 4``.
        """
        holder = self._read_record()
        if holder is not None:
            self._check_takeable(holder, break_lock)
        broken = None if holder is None else holder.get("token")
        for _ in range(TAKE_OVER_TRIES):
            self.kv.set(LEASE_KEY, self._new_record())
            now = self._read_record()
            if self._ours(now):
                return
            # the holder broken (``break_lock``: alive) renewed over ours in the same moment: it
            # rereads the token at its next renewal, so ours written again, it sees ours and stops
            if not (break_lock and broken is not None and now and now.get("token") == broken):
                break
            time.sleep(TAKE_OVER_PAUSE_S)
        raise self._locked_error(now, "Another writer took the expired lease at the same time.")

    def _check_takeable(self, holder: dict, break_lock: bool) -> None:
        """BufferLockedError naming ``holder`` unless its lease has expired or ``break_lock``."""
        expires = _expiry(holder)
        if expires > time.time() and not break_lock:
            raise self._locked_error(
                holder,
                f"If that writer stopped without closing, its lease expires at {_moment(expires)}; to take it "
                f"now, pass break_lock=True or run `replaybuf unlock {self.location}`.",
            )
        logger.warning("taking over the writer lease of %s from %s", self.location, describe_holder(holder))

    def renew(self) -> None:
        """Extend the lease, or mark it ``lost`` when another writer holds it now. Where the store
        replaces conditionally, the extension is written over the record read only, so a
        take-over landing in between refuses it instead of being overwritten."""
        started = time.time()
        if not self.kv.replaces_conditionally:
            record = self._read_record()
            if self._ours(record):
                self.kv.set(LEASE_KEY, self._extended(record))
                self._valid_until = started + self.seconds
            else:
                self._lose(record)
            return
        got = self._read_versioned()
        if got is not None and self._ours(got[0]):
            if self.kv.replace_if(LEASE_KEY, self._extended(got[0]), got[1]):
                self._valid_until = started + self.seconds
                return
            # refused, so changed since read: taken over, or our PUT landed and the client's
            # retry of it (its answer lost) was refused, which leaves ours extended
            got = self._read_versioned()
            if got is not None and self._ours(got[0]):
                self._valid_until = started + self.seconds
                return
        self._lose(None if got is None else got[0])

    def check_held(self) -> None:
        # docstring inherited: a writer whose heartbeat has not renewed the lease for half its
        # expiry (a paused process: SIGSTOP, a suspended machine, a starved thread) renews it
        # here, before its next write: its lease may have expired and been taken over meanwhile,
        # and the writes that follow would land in the buffer the new holder writes
        if self.token is None or self.lost is not None or self._pid != os.getpid():
            return
        if time.time() < self._valid_until - self.seconds / 2:
            return
        try:
            self.renew()
        except Exception as error:  # the store unreachable: the lease is ours until it expires
            if time.time() >= self._valid_until:
                self.lost = f"the writer lease of {self.location!r} expired unrenewed ({error})"
                logger.error("%s; this writer stops writing", self.lost)

    def _extended(self, record: dict) -> bytes:
        return json.dumps({**record, "expires": time.time() + self.seconds}).encode()

    def _lose(self, holder: dict | None) -> None:
        """The lease was taken over by ``holder``: stop renewing, and refuse every write."""
        self.lost = f"the writer lease of {self.location!r} was taken over by {describe_holder(holder)}"
        logger.error("%s; this writer stops writing", self.lost)
        self._stop.set()

    def _heartbeat(self) -> None:
        """Renew every quarter of the expiry until released; a renewal that fails (store down)
        is retried, and once the lease has expired unrenewed it is marked lost."""
        last = time.time()
        while not self._stop.wait(self.seconds / 4):
            try:
                self.renew()
                last = time.time()
            except Exception as error:
                if time.time() - last >= self.seconds:
                    self.lost = f"the writer lease of {self.location!r} expired unrenewed ({error})"
                    return
                logger.warning("renewing the writer lease of %s failed: %s", self.location, error)
        if self._release_requested:
            self.release()

    def release(self) -> None:
        # docstring inherited
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread() and self._pid == os.getpid():
            self._thread.join(timeout=5)  # a renewal in flight, or the release handed to it, ends
        with self._release_lock:
            token, self.token = self.token, None
            if token is not None and self._pid == os.getpid():
                with contextlib.suppress(Exception):  # the store is down: the lease expires instead
                    # read, then deleted unconditionally: obstore's DELETE takes no If-Match. Only a
                    # ``break_lock`` take-over can land in between (ours is live), and loses its record
                    record = self._read_record()
                    if record and record.get("token") == token:
                        self.kv.delete_many([LEASE_KEY])
            # only now: until the object is deleted, the exit hook must find the lease and wait
            # for this release (a finalizer at exit hands it to the heartbeat, a daemon thread)
            _held.discard(self)

    def release_soon(self) -> None:
        # docstring inherited: the heartbeat thread deletes the lease object
        self._release_requested = True
        self._stop.set()

    def holder(self) -> dict | None:
        # docstring inherited
        return self._read_record()

    def unlock(self) -> dict | None:
        # docstring inherited
        holder = self._read_record()
        if holder is not None:
            self.kv.delete_many([LEASE_KEY])
        return holder


_in_process: dict[str, WriterLease] = {}


def take(lease: WriterLease, break_lock: bool = False, erase: bool = False) -> WriterLease:
    """Take ``lease``, or share the lease this process already holds on the same buffer.

    Writable opens of one buffer within one process share its lease: memmap-replay-buffer's
    README (this library's API) reopens a buffer with ``from_folder`` while the first object is
    alive and keeps writing with it. An open that will ``erase`` the buffer (``overwrite=True``,
    as when a notebook cell that creates the buffer runs again) replaces it: the lease's
    ``epoch`` moves on, and the opens that shared it before refuse every further write (their
    buffer is gone). Other processes are refused. ``give_back`` releases the lease when the
    last open sharing it is closed.
    """
    held = _in_process.get(lease.key)
    if held is not None and held.lost is None and held._pid == os.getpid():
        if erase:
            held.epoch += 1
        lease = held
    else:
        lease.acquire(break_lock)
        _in_process[lease.key] = lease
    lease._users += 1
    return lease


def give_back(lease: WriterLease, soon: bool = False) -> None:
    """One open sharing ``lease`` is done with it; the last one releases it (``soon``: from a
    garbage-collection finalizer, see ``release_soon``)."""
    lease._users -= 1
    if lease._users > 0:
        return
    if _in_process.get(lease.key) is lease:
        del _in_process[lease.key]
    if soon:
        lease.release_soon()
    else:
        lease.release()


def give_back_dropped(lease: WriterLease) -> None:
    """``give_back`` for the finalizer of an open dropped without closing: at once, unless this
    thread is running a garbage collection (``collecting``), then ``soon``."""
    give_back(lease, soon=collecting())


# whether a garbage collection is running: a finalizer or ``__del__`` it runs may be inside any
# lock (an event loop's, a thread pool's, a map pool's), so what it releases must wait on none.
# gc calls ``move_to_end(phase, info)`` ("start" or "stop"; ``info`` a non-empty dict, so true:
# to the end), a C method: the phase seen last is last. A Python function there would run
# bytecode in every collection, where a pending Ctrl-C raises KeyboardInterrupt that gc drops
# ("Exception ignored in"): the interrupt lost, and a "stop" missed left "collecting" for good.
_gc_phases = collections.OrderedDict(start=None, stop=None)
_NOT_COLLECTING = collections.OrderedDict(start=None, stop=None)
gc.callbacks.append(_gc_phases.move_to_end)  # type: ignore[arg-type]  # info: a true `last`


def collecting() -> bool:
    """Whether a garbage collection is running: in this thread, or in another one while a
    finalizer it runs waits (CPython runs one at a time), where the cautious path costs little.
    (An order-sensitive comparison: it iterates nothing a collection could change under it.)"""
    return _gc_phases != _NOT_COLLECTING


_held: weakref.WeakSet[WriterLease] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lease in list(_held):
        lease._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _release_at_exit() -> None:
    """Release the leases still held: at exit nothing else deletes an object-store lease
    (finalizers hand that to daemon threads, which exit stops). Registered again by each
    ``ObjectLease.acquire``, so it runs before the exit hooks of modules imported later."""
    for lease in list(_held):
        lease.release()
