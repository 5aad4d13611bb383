"""Key-value access to a zarr store's objects, used by the direct chunk path.

``LocalKV`` works on files (atomic writes by temp file + rename, optional fsync); ``StoreKV``
wraps any zarr v3 ``Store`` (fsspec, obstore, memory) and issues many requests at once.
Both are cheap to pickle: they hold a location, not an open handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import shutil
import stat
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from ._compiled import compiled
from ._mapping import map_file
from .base import ANY_SIZE, LOG_PREFIX, StorageError, document_limit, document_too_large

if TYPE_CHECKING:
    # what identifies one version of an object for a conditional replace: its ETag, and its
    # version id where the bucket keeps versions; opaque to callers
    from obstore import UpdateVersion as ObjectVersion

    from .base import Storage as _StorageMixin  # KVBlobs is mixed in before Storage
else:
    _StorageMixin = object

T = TypeVar("T")

#: a read of part of an object: (key, start, stop), ``stop`` None for the rest of the object
ByteRange = tuple[str, int, int | None]
#: a read into a buffer: (key, first byte, a writable byte view that receives ``len(view)`` bytes)
ReadInto = tuple[str, int, memoryview]
#: ``consume(i, data)`` takes the i-th result of a batched read (None: no such object)
Consume = Callable[[int, bytes | None], None]
#: what a write takes: hot shards are built in place and handed over as a view
Blob = bytes | memoryview


class Versioned(NamedTuple):
    """An object read with its version (``StoreKV.get_versioned``): ``data`` is None when the
    object is over the limit asked (left unread: damage), so it can still be replaced."""

    data: bytes | None
    version: ObjectVersion


# keys whose file paths a LocalKV remembers
_MAX_PATHS = 1 << 20
# small objects a LocalKV keeps mapped (``mapped``: the chunks of per-episode arrays)
_MAX_MAPPED = 256
# object-store requests one StoreKV call keeps in flight (``StoreKV.max_in_flight``)
MAX_IN_FLIGHT = 32
# a local step log is read in pieces of this many bytes: recovery never holds it whole
LOG_PIECE_BYTES = 8 << 20
POOL_THREADS = max(4, 2 * (os.cpu_count() or 1))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None


def thread_pool() -> ThreadPoolExecutor:
    """A per-process pool for I/O and codec work (codecs release the GIL); recreated after fork."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="replaybuf")
        _pool_pid = os.getpid()
    return _pool


def map_settled(task: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
    """``thread_pool().map``, except that a failure is raised only once no other task is
    running: a write or copy that failed leaves nothing still writing behind the caller's back
    (a create cut short by a full disk is erased after its last temp file, never before)."""
    futures = [thread_pool().submit(task, item) for item in items]
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            if not future.cancel():
                future.exception()  # waits for a running one


def _in_loader_worker() -> bool:
    """Whether this is a DataLoader worker process: the workers are the parallelism there, and
    pool threads on top of them only contend for the same cores."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def in_pool(count: int, task: Callable[[int], None], spread: bool = False) -> None:
    """Run ``task(i)`` for i < count on up to one thread per core, the calling thread one of
    them, each taking the next i as it finishes one (a future costs more than a small read, and
    a core another process holds up leaves its share to the others). On 2 cores small tasks run
    in the calling thread: a read + decode of a frame holds the GIL for part of its ~35 us, and
    a second thread cost more than it gained (timestep and n-step sampling ran 20-40% faster
    inline). ``spread``: each task is milliseconds of work that frees the GIL (a shard's frames
    decoded through ``ChunkCodec.decode_many_into``), spread whatever the core count."""
    if count <= 1 or _in_loader_worker() or not spread and (count <= 2 or CORES <= 2):
        for i in range(count):
            task(i)
        return
    pending = itertools.count()

    def run() -> None:
        while (i := next(pending)) < count:
            task(i)

    with _helped(run, min(count, CORES) if spread else min(count, CORES, max(2, count // 8))):
        pass


def in_pool_as_planned(plan: Iterable[Sequence[T]], task: Callable[[T], None]) -> None:
    """Run ``task(item)`` for every item of the groups ``plan`` yields, as ``in_pool(spread=True)``
    does, while the calling thread is still making the later groups: the other cores start on
    the first items at once instead of idling through the planning (a cold whole-buffer read
    planned its 40 shards for ~8 ms before decoding any). The caller joins the work once the
    plan is done. A planning error is raised after the items already handed out are finished
    (they write into the caller's arrays); inline in a DataLoader worker or on one core."""
    if CORES <= 1 or _in_loader_worker():
        for group in plan:
            for item in group:
                task(item)
        return
    items: list[T] = []
    handed = 0
    planned = False
    ready = threading.Condition()

    def run() -> None:
        nonlocal handed
        while True:
            with ready:
                while handed == len(items) and not planned:
                    ready.wait()
                if handed == len(items):
                    return
                item = items[handed]
                handed += 1
            task(item)

    try:
        with _helped(run, CORES):
            try:
                for group in plan:
                    with ready:
                        items.extend(group)
                        ready.notify_all()
            finally:
                with ready:
                    planned = True
                    ready.notify_all()
    finally:
        # the items go now (they may hold maps of files): a pool thread's finished work item
        # still holds ``run``, so ``items``, for a moment after the caller goes on
        items.clear()


@contextlib.contextmanager
def _helped(run: Callable[[], None], threads: int) -> Iterator[None]:
    """``threads - 1`` copies of ``run`` on the pool from the start of the block, and one in
    the calling thread at its end (after the block, whether or not it raised): the caller goes
    on only once every copy that started is done."""
    helpers = [thread_pool().submit(run) for _ in range(threads - 1)]
    try:
        yield
    finally:
        try:
            run()
        finally:
            # a helper not started yet (the pool busy elsewhere) has nothing left to take; one
            # that started writes into the caller's arrays: it finishes before the caller goes on
            started = [helper for helper in helpers if not helper.cancel()]
            for helper in started:
                helper.exception()
    for helper in started:
        helper.result()


# bytes kept free beyond a write's own (``LocalKV.check_room``): metadata and temp files around it
WRITE_HEADROOM = 1 << 20

# copies of at least this many bytes in all are spread over the pool (``copy_spans``)
PARALLEL_COPY_BYTES = 4 << 20


def copy_spans(count: int, copy: Callable[[int], None], nbytes: int, parallel: bool = True) -> None:
    """Run ``copy(k)`` for k < count, spread over one thread per core (``in_pool``) when the
    copies total ``nbytes`` >= PARALLEL_COPY_BYTES: numpy releases the GIL while it copies, and
    two cores move a batch of whole episodes ~1.5x as fast as one (an 8-episode frame batch:
    1.6 ms inline, 1.0-1.1 ms spread); more threads than cores only contend for them (and for
    the kernel's zeroing of a fresh result's pages). ``parallel=False`` (a caller running its
    own parallel tasks) copies inline."""
    if parallel and count > 1 and nbytes >= PARALLEL_COPY_BYTES:
        in_pool(count, copy, spread=True)
    else:
        for k in range(count):
            copy(k)


class KeyValue(ABC):
    """Object access by key: the primitives the chunk path and the side objects need."""

    # whether ``write_at`` overwrites bytes of a stored object in place (local files)
    writes_in_place = False

    @abstractmethod
    def get_many(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        """The bytes of each key (None where absent), fetched concurrently where possible. With
        ``limit``, an object larger than that is read only to its first ``limit + 1`` bytes
        where the store gives its size before its bytes (local files, S3 through obstore;
        fsspec stores read it whole): the caller's size check fails on it, and a damaged or
        planted multi-GB object never reaches memory."""

    @abstractmethod
    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | None]:
        """Byte ranges ``(key, start, stop)``; a negative ``start`` with ``stop=None`` asks for
        the last ``-start`` bytes. None where the key is absent."""

    @abstractmethod
    def get_documents(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        """The whole objects ``keys`` (None where absent), each a metadata object of at most
        ``limit`` bytes (default ``MAX_DOCUMENT_BYTES``): a larger one raises BufferDamagedError
        naming it, its size and the limit, judged by its size before its bytes are read (a
        damaged or planted multi-GB object never reaches memory)."""

    @abstractmethod
    def set_many(self, items: Mapping[str, Blob], atomic: bool = True) -> None:
        """Write each key; ``atomic`` replaces it whole (readers never see a torn object).
        Non-atomic writes are for objects no reader trusts yet (unpublished slots)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete the keys that exist."""

    @abstractmethod
    def list_prefix(self, prefix: str) -> list[str]:
        """Sorted keys starting with ``prefix``."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The bytes of ``key`` (None where absent), as the store tells them, unread."""

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_document(self, key: str, limit: int | None = None) -> bytes | None:
        """``get_documents`` of one key."""
        return self.get_documents([key], limit)[0]

    def where(self, key: str) -> str:
        """The file path or URL of ``key``, for error messages."""
        return key

    def mapped(self, key: str, nbytes: int) -> np.ndarray | None:
        """The object as a read-only shared map (uint8) where it is a local file of exactly
        ``nbytes``, else None (absent, another size, or a store without files). A reader takes
        a copy of what it indexes: writes in place show in the map at once, and a replaced file
        is mapped again. The per-batch re-check of generations (``ChunkedArray.take``)."""
        return None

    def get_each(self, keys: Sequence[str], consume: Consume, spread: bool = False, limit: int | None = None) -> None:
        """Call ``consume(i, bytes or None)`` for every key, spread over the thread pool (so
        decoding in ``consume`` runs in parallel; codecs release the GIL); ``spread``: even on
        2 cores (``in_pool``); ``limit`` as ``get_many``."""
        values = self.get_many(keys, limit)
        in_pool(len(values), lambda i: consume(i, values[i]), spread)

    def get_into(self, requests: Sequence[ReadInto]) -> list[int | None]:
        """Bytes ``start .. start + len(out)`` of object ``key`` into ``out`` (a writable byte
        view), for each ``(key, start, out)``; returns each object's size (None: absent, ``out``
        untouched). An object shorter than that leaves ``out`` partly written: callers compare
        the size with the one they expect. Here the objects are fetched whole (concurrently)
        and copied; ``LocalKV`` reads each file straight into ``out``, so a bulk load holds no
        second copy of what it reads."""
        sizes: list[int | None] = []
        for (_, start, out), data in zip(requests, self.get_many([key for key, _, _ in requests])):
            if data is not None:
                part = memoryview(data)[start : start + len(out)]
                out[: len(part)] = part
            sizes.append(None if data is None else len(data))
        return sizes

    def get_ranges_each(
        self,
        requests: Sequence[ByteRange],
        consume: Consume,
        generations: Sequence[int] | None = None,
        spread: bool = False,
    ) -> None:
        """``get_each`` for byte ranges (as ``get_ranges`` takes them; ``spread`` as there).
        ``generations`` (one per request: the generation of the slot the object belongs to) lets
        a store keep the object open between calls for as long as the generation holds."""
        values = self.get_ranges(requests)
        in_pool(len(values), lambda i: consume(i, values[i]), spread)

    def get_ranges_into(
        self, requests: Sequence[ByteRange], out: memoryview, generations: Sequence[int] | None = None
    ) -> list[int]:
        """Byte ranges ``(key, start, stop)`` (``stop`` given) into the writable bytes ``out``,
        one after another from its start; per request the bytes read (fewer where the object
        ends first) or -1 where the key is absent. ``generations`` as ``get_ranges_each``."""
        got, at = [], 0
        for (_, start, stop), data in zip(requests, self.get_ranges(requests)):
            assert stop is not None  # the caller sized ``out`` by the ranges
            if data is None:
                got.append(-1)
            else:
                out[at : at + len(data)] = data
                got.append(len(data))
            at += stop - start
        return got

    def set(self, key: str, data: bytes) -> None:
        self.set_many({key: data})

    def list_top(self) -> list[str]:
        """Sorted names at the top of the root: ``name`` for an object, ``name/`` for a folder
        (a prefix with objects under it)."""
        return sorted({k.split("/", 1)[0] + ("/" if "/" in k else "") for k in self.list_prefix("")})

    def delete_prefix(self, prefix: str) -> None:
        self.delete_many(self.list_prefix(prefix))

    def check_erasable(self, entries: Sequence[str]) -> None:
        """PermissionError naming where the top-level ``entries`` (``list_top``) could not all
        be deleted; a no-op where that is only known by trying (an object store)."""

    def append(self, key: str, data: bytes) -> bool:
        """Append to an object in place where the medium allows; False when it does not."""
        return False

    def close(self) -> None:
        """Release open handles; the object stays usable."""

    def drop_read_handles(self, keys: Sequence[str] | None = None) -> None:
        """Close the files kept open or mapped for reading, those of ``keys`` only when given
        (a no-op where nothing is kept open)."""

    def links(self) -> list[str]:
        """Paths of the symbolic links under the root (none where the medium has no links)."""
        return []

    def write_at(self, key: str, offset: int, data: bytes) -> bool:
        """Overwrite bytes of an existing object in place where the medium allows; False when
        it does not (or the object is absent)."""
        return False

    def fingerprints(self, keys: Sequence[str]) -> list[tuple[int, ...]] | None:
        """Per key, a value that changes whenever the object is written or replaced (absent:
        an empty tuple), or None where that costs as much as reading the object."""
        return None


def _read_only_mount(folder: str) -> bool:
    """Whether ``folder`` is on a file system mounted read-only (False where unknown)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs on Windows
        return False


class _ReadHandle:
    """An open read-only file descriptor, closed when the last reference to it goes (so a
    read in progress on another thread keeps it open while the cache drops it)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __del__(self, _close=os.close):
        try:
            _close(self.fd)
        except OSError:
            pass


class _ReadHandles:
    """Files kept open for generation-keyed range reads (random frame sampling: an open() costs ~5x
    a pread), shared by every LocalKV of the process and bounded in count. A handle serves a
    read only under the generation it was opened for; writes in this process drop it."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: OrderedDict[str, tuple[int, _ReadHandle]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str, generation: int) -> _ReadHandle | None:
        """An open handle on ``path`` valid for ``generation``; None when the file is absent."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None and entry[0] == generation:
                self._entries.move_to_end(path)
                return entry[1]
        try:
            handle = _ReadHandle(open_stored(path))
        except FileNotFoundError:
            return None
        with self._lock:
            self._entries[path] = (generation, handle)
            self._entries.move_to_end(path)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        return handle

    def drop(self, paths: Sequence[str]) -> None:
        if self._entries:
            with self._lock:
                for path in paths:
                    self._entries.pop(path, None)

    def drop_under(self, folder: str) -> None:
        if self._entries:
            with self._lock:
                for path in [p for p in self._entries if p.startswith(folder)]:
                    del self._entries[path]

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


_read_handles = _ReadHandles(limit=256)
os.register_at_fork(after_in_child=_read_handles._after_fork)


def _pread(fd: int, start: int, stop: int) -> bytes:
    """Bytes ``start .. stop`` of an open file (fewer where it ends first): one pread, more only
    past what one read returns (2 GiB on Linux)."""
    data = os.pread(fd, stop - start, start)
    if len(data) in (0, stop - start):
        return data
    parts = [data]
    start += len(data)
    while start < stop and (part := os.pread(fd, stop - start, start)):
        parts.append(part)
        start += len(part)
    return b"".join(parts)


def _pread_into(fd: int, out: memoryview, start: int) -> int:
    """Read an open file from ``start`` into ``out``: the bytes read (fewer where it ends first)."""
    done = 0
    while done < len(out) and (count := os.preadv(fd, [out[done:]], start + done)):
        done += count
    return done


_pread_many = compiled("pread_many")  # None: built without a compiler, a preadv per range


def _read_ranges(
    fds: list[int], requests: Sequence[ByteRange], out: memoryview, where: Callable[[str], str]
) -> list[int]:
    """``requests[k]``'s range of the open file ``fds[k]`` (-1: absent) into ``out``, one after
    another: per request the bytes read, or -1 where absent. A failed read raises the OSError
    naming the file (``where(key)``)."""
    starts = np.fromiter((start for _, start, _ in requests), np.int64, len(requests))
    sizes = np.fromiter((stop - start for _, start, stop in requests), np.int64, len(requests))  # type: ignore[operator]
    if _pread_many is None:
        got, at = [], 0
        for fd, (key, _, _), start, size in zip(fds, requests, starts.tolist(), sizes.tolist()):
            try:
                got.append(-1 if fd < 0 else _pread_into(fd, out[at : at + size], start))
            except OSError as e:
                raise OSError(e.errno, e.strerror, where(key)) from None
            at += size
        return got
    done = np.empty(len(requests), np.int64)
    _pread_many(np.asarray(fds, np.int64), starts, sizes, out, done)
    failed = np.flatnonzero(done < -1)  # -1 - errno
    if len(failed):
        code = -1 - int(done[failed[0]])
        raise OSError(code, os.strerror(code), where(requests[int(failed[0])][0]))
    return done.tolist()


def _open_no_follow(path: str, flags: int) -> int:
    """``os.open`` for writing that refuses a symbolic link at ``path`` (it could lead out of
    the buffer's folder), with an error naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StorageError(
                f"refusing to write through the symbolic link {path!r}: a buffer writes only its own files"
            ) from None
        raise


def own_file(path: str) -> None:
    """Make the stored file ``path`` a file of its own before it is written in place, where it
    has other names (hard links: planted, or a backup made with ``cp -al``), which may be
    outside the buffer: its bytes are copied to a new file that replaces it by a rename, so the
    other names keep what they held and no write of the buffer reaches them. A file with one
    name (every file a buffer makes) costs one ``lstat``."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink <= 1:
        return
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".", suffix=".partial")
    try:
        with open(path, "rb") as source, os.fdopen(fd, "wb") as copy:
            shutil.copyfileobj(source, copy, 1 << 20)
            os.fchmod(copy.fileno(), stat.S_IMODE(st.st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_stored(path: str) -> int:
    """A read-only descriptor of the stored file ``path`` (FileNotFoundError when absent), opened
    without blocking: a FIFO or a device at a stored object's name (never one a buffer writes)
    is refused naming it, where a plain open of a FIFO would wait forever for a writer to it. A
    folder there is left to the read, which names it (EISDIR)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO or a device where a stored object belongs)", path)
    return fd


class LocalKV(KeyValue):
    """Files under a root folder; the layout zarr's LocalStore uses."""

    writes_in_place = True

    def __init__(self, root: str, fsync: bool = False):
        self.root = root
        self.fsync = fsync
        self._appenders: dict[str, int] = {}
        self._appenders_pid = os.getpid()
        self._paths: dict[str, str] = {}
        self._maps: dict[str, tuple[int, np.ndarray]] = {}  # path -> (inode, map) for ``mapped``

    def __getstate__(self):
        return {**self.__dict__, "_appenders": {}, "_paths": {}, "_maps": {}}

    def _read_range_keyed(self, request: ByteRange, generation: int) -> bytes | None:
        key, start, stop = request
        handle = _read_handles.get(self._path(key), generation)
        if handle is None:
            return None
        if start < 0:
            size = os.fstat(handle.fd).st_size
            start, stop = max(0, size + start), size
        assert stop is not None  # only a suffix request (start < 0) has no stop
        return _pread(handle.fd, start, stop)

    def get_ranges_into(
        self, requests: Sequence[ByteRange], out: memoryview, generations: Sequence[int] | None = None
    ) -> list[int]:
        # docstring inherited: one pread each, straight into place (no bytes object per range:
        # sampled frames are read one small range each), all in one call of the compiled
        # extension where it is built; one open (or kept handle) per run of requests of one object
        per_request = [None] * len(requests) if generations is None else generations
        fds: list[int] = []
        opened: list[int] = []
        handles = []  # kept handles stay referenced (open) until the reads are done
        try:
            for (key, generation), run in itertools.groupby(zip(requests, per_request), lambda r: (r[0][0], r[1])):
                fd = -1
                if generation is not None:
                    handle = _read_handles.get(self._path(key), generation)
                    if handle is not None:
                        handles.append(handle)
                        fd = handle.fd
                else:
                    with contextlib.suppress(FileNotFoundError):
                        fd = open_stored(self._path(key))
                        opened.append(fd)
                fds.extend(fd for _ in run)
            return _read_ranges(fds, requests, out, self._path)
        finally:
            for fd in opened:
                os.close(fd)

    def close_appenders(self, prefix: str = "") -> None:
        """Close the append handles of keys under ``prefix`` (all by default)."""
        for key in [k for k in self._appenders if k.startswith(prefix)]:
            fd = self._appenders.pop(key)
            if self._appenders_pid == os.getpid():
                os.close(fd)

    def where(self, key: str) -> str:
        # docstring inherited
        return self._path(key)

    def mapped(self, key: str, nbytes: int) -> np.ndarray | None:
        # docstring inherited: one stat per call; the map is kept while the path names the same
        # inode (which a kept map holds, so its number is not reused) at the same size
        path = self._path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_size != nbytes or nbytes <= 0 or not stat.S_ISREG(st.st_mode):
            return None
        known = self._maps.get(path)
        if known is not None and known[0] == st.st_ino:
            return known[1]
        whole = self.map(key)  # a file put in its place since the stat is mapped again next time
        if whole is None or len(whole) != nbytes:
            return None
        if len(self._maps) >= _MAX_MAPPED:
            self._maps.clear()
        self._maps[path] = (st.st_ino, whole)
        return whole

    def _path(self, key: str) -> str:
        # asked once per sampled frame: joined once per key (the dict is bounded by the keys of
        # one buffer, ~fields x episodes)
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) >= _MAX_PATHS:
                self._paths.clear()
            path = self._paths[key] = os.path.join(self.root, *key.split("/"))
        return path

    def fingerprints(self, keys: Sequence[str]) -> list[tuple[int, ...]] | None:
        # docstring inherited: a replaced file has a new inode, one written in place a new mtime
        prints: list[tuple[int, ...]] = []
        for key in keys:
            try:
                st = os.stat(self._path(key))
            except FileNotFoundError:
                prints.append(())
            else:
                prints.append((st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
        return prints

    def size(self, key: str) -> int | None:
        # docstring inherited
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    def _read(self, key: str, limit: int | None = None) -> bytes | None:
        return self._read_range((key, 0, None), limit)

    def get_many(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        if len(keys) <= 4:
            return [self._read(k, limit) for k in keys]
        return list(thread_pool().map(lambda k: self._read(k, limit), keys))

    def _read_range(self, request: ByteRange, limit: int | None = None) -> bytes | None:
        """The bytes of ``request``; the whole file (``stop`` None) no further than ``limit + 1``."""
        key, start, stop = request
        try:
            fd = open_stored(self._path(key))
        except FileNotFoundError:
            return None
        # one pread of the size fstat gives: a file object's read() of a 2 MB shard cost ~4x
        # as much (4.1 against 1.1 us a frame of 84x84x3: it grows its buffer past the size,
        # then shrinks it)
        try:
            if start < 0 or stop is None:  # a suffix, or the whole object from ``start``
                size = os.fstat(fd).st_size
                start, stop = (max(0, size + start), size) if start < 0 else (start, size)
                if limit is not None:
                    stop = min(stop, start + limit + 1)
            return _pread(fd, start, stop)
        except OSError as e:  # a folder where a file belongs (EISDIR): name it
            raise OSError(e.errno, e.strerror, self._path(key)) from None
        finally:
            os.close(fd)

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | None]:
        if len(requests) <= 4:
            return [self._read_range(r) for r in requests]
        return list(thread_pool().map(self._read_range, requests))

    def _read_document(self, key: str, limit: int) -> bytes | None:
        path = self._path(key)
        try:
            fd = open_stored(path)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise document_too_large(path, size, limit)
            return _pread(fd, 0, size)  # at most the size just checked, should the file grow
        except OSError as e:  # a folder where a file belongs (EISDIR): name it
            raise OSError(e.errno, e.strerror, path) from None
        finally:
            os.close(fd)

    def get_documents(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        # docstring inherited: the size from fstat of the open file, then one pread of it
        most = document_limit(limit)
        if len(keys) <= 4:
            return [self._read_document(k, most) for k in keys]
        return list(thread_pool().map(lambda k: self._read_document(k, most), keys))

    def _read_into(self, request: ReadInto) -> int | None:
        key, start, out = request
        try:
            fd = open_stored(self._path(key))
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], start + done)
                if not n:
                    break  # the file ends first: the caller sees its size
                done += n
            return size
        except OSError as e:  # a folder where a file belongs (EISDIR): name it
            raise OSError(e.errno, e.strerror, self._path(key)) from None
        finally:
            os.close(fd)

    def get_into(self, requests: Sequence[ReadInto]) -> list[int | None]:
        # docstring inherited: each file is read straight into its buffer (no bytes object)
        sizes: list[int | None] = [None] * len(requests)

        def read(i: int) -> None:
            sizes[i] = self._read_into(requests[i])

        in_pool(len(requests), read)
        return sizes

    def map(self, key: str) -> np.ndarray | None:
        """The whole file of ``key`` mapped read-only (``_mapping.map_file``), None where it is
        absent: a bulk decode reads it in place, where ``get_many`` would first copy it out of
        the page cache (~10% of a cold ``get_all_data``). Only for files replaced whole by a
        rename, never written in place: a map of a file truncated under it faults (SIGBUS)."""
        try:
            fd = open_stored(self._path(key))
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):  # a folder where a file belongs: named as a read names it
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self._path(key))
            return map_file(fd, st.st_size) if st.st_size else np.empty(0, np.uint8)
        finally:
            os.close(fd)

    def get_each(self, keys: Sequence[str], consume: Consume, spread: bool = False, limit: int | None = None) -> None:
        # Read and consume in the same pool task: file reads and decoding overlap.
        in_pool(len(keys), lambda i: consume(i, self._read(keys[i], limit)), spread)

    def get_ranges_each(
        self,
        requests: Sequence[ByteRange],
        consume: Consume,
        generations: Sequence[int] | None = None,
        spread: bool = False,
    ) -> None:
        # docstring inherited
        if generations is None:
            in_pool(len(requests), lambda i: consume(i, self._read_range(requests[i])), spread)
        else:
            read = self._read_range_keyed
            in_pool(len(requests), lambda i: consume(i, read(requests[i], generations[i])), spread)

    def _write_in_place(self, item: tuple[str, Blob]) -> None:
        # written over the old bytes, then cut to size: no O_TRUNC, whose truncation to 0
        # makes ext4 (auto_da_alloc) start writing the file back at close: 2-4 ms a write here
        key, data = item
        path = self._path(key)
        _read_handles.drop([path])
        try:
            fd = _open_no_follow(path, os.O_WRONLY | os.O_CREAT)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = _open_no_follow(path, os.O_WRONLY | os.O_CREAT)
        if os.fstat(fd).st_nlink > 1:
            # a hard link (planted, or a copy made with ``cp -l``): its other names may be
            # outside the buffer, so this name is made a file of its own, never written through
            os.close(fd)
            os.unlink(path)
            fd = _open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if os.fstat(fd).st_size > len(data):
                    os.ftruncate(fd, len(data))
                if self.fsync:
                    os.fsync(fd)
        except OSError as e:
            e.filename = e.filename or path
            raise

    def _write(self, item: tuple[str, Blob]) -> None:
        key, data = item
        path = self._path(key)
        _read_handles.drop([path])
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".partial")
        except OSError as e:
            e.filename = path  # the object, not the temp file it could not make
            raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.filename in (None, tmp):
                e.filename = path  # the object, not its temp file
            raise

    def set_many(self, items: Mapping[str, Blob], atomic: bool = True) -> None:
        write = self._write if atomic else self._write_in_place
        try:
            if len(items) <= 2:
                for item in items.items():
                    write(item)
            else:
                map_settled(write, items.items())
        except OSError as e:
            where = e.filename or self.root  # set by ``_write`` and ``_write_in_place``
            raise StorageError(f"writing to {where!r} failed: {e.strerror or e}") from e

    def delete_many(self, keys: Sequence[str]) -> None:
        _read_handles.drop([self._path(key) for key in keys])
        for key in keys:
            self.close_appenders(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        self.close_appenders(prefix)
        path = self._path(prefix.rstrip("/"))
        _read_handles.drop_under(path)
        if os.path.islink(path):
            os.unlink(path)  # the link only, never what it points to
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)  # removes links inside, never follows them
        else:
            super().delete_prefix(prefix)

    def check_erasable(self, entries: Sequence[str]) -> None:
        # docstring inherited: every folder among the entries, and under them, must be writable
        # (their permissions, a read-only file system): the erase of a folder skips what it
        # cannot delete, and went on to delete the rest of the buffer. (A root that may not be
        # written refuses the writer lease, before any erase.)
        folders: list[str] = []
        for entry in entries:
            top = self._path(entry.rstrip("/"))
            if entry.endswith("/") and not os.path.islink(top):
                folders += [folder for folder, _, _ in os.walk(top)]  # links are not followed
        for folder in folders:
            if not os.access(folder, os.W_OK | os.X_OK):
                reason = "read-only file system" if _read_only_mount(folder) else "permissions"
                raise PermissionError(
                    errno.EACCES,
                    f"cannot erase the buffer at {self.root!r}: this process may not delete entries in {folder!r} "
                    f"({reason}); nothing was erased",
                )

    def list_top(self) -> list[str]:
        # docstring inherited: empty folders count, a link counts as a file
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)

    def list_prefix(self, prefix: str) -> list[str]:
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        keys = []
        for folder, _, files in os.walk(base):
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and not name.endswith(".partial"):
                    keys.append(key)
        return sorted(keys)

    def append(self, key: str, data: bytes) -> bool:
        if self._appenders_pid != os.getpid():
            self._appenders, self._appenders_pid = {}, os.getpid()
        path = self._path(key)
        try:
            fd = self._appenders.get(key)
            if fd is None:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = self._appenders[key] = _open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:
            raise StorageError(f"appending to {path!r} failed: {e}") from e
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # a write cut short (the disk filling up) is continued, or fails below
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            # the log is cut back to its last whole record: a retry, or the next writable
            # open's recovery, never meets a torn record in the middle of the log
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise StorageError(f"appending to {path!r} failed: {e}") from e
        return True

    def close(self) -> None:
        self.close_appenders()
        self.drop_read_handles()

    def drop_read_handles(self, keys: Sequence[str] | None = None) -> None:
        # docstring inherited
        if keys is None:
            _read_handles.drop_under(self.root)
            self._maps.clear()
        else:
            paths = [self._path(key) for key in keys]
            _read_handles.drop(paths)
            for path in paths:
                self._maps.pop(path, None)

    def write_at(self, key: str, offset: int, data: bytes) -> bool:
        path = self._path(key)
        try:
            fd = _open_no_follow(path, os.O_WRONLY)
            if os.fstat(fd).st_nlink > 1:  # never written through a hard link (``own_file``)
                os.close(fd)
                own_file(path)
                fd = _open_no_follow(path, os.O_WRONLY)
        except FileNotFoundError:
            return False
        except OSError as e:  # a folder or file system made read-only: as a failed write
            raise StorageError(f"writing to {path!r} failed: {e.strerror or e}") from e
        try:
            written = os.pwrite(fd, data, offset)
            if written != len(data):  # the disk filled part way (the next write would say so)
                raise OSError(
                    errno.ENOSPC, f"{written} of {len(data)} bytes written: no space left (or a file size limit)"
                )
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            raise StorageError(f"writing to {path!r} failed: {e.strerror or e}") from e
        finally:
            os.close(fd)
        return True

    def _scan(self) -> tuple[list[str], list[str]]:
        """The symbolic links and the temp files of interrupted writes under the root (one
        pass over directory entries, no stat per file); links are not followed."""
        links, partials, folders = [], [], [self.root]
        while folders:
            try:
                entries = list(os.scandir(folders.pop()))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_symlink():
                    links.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif entry.name.endswith(".partial"):
                    partials.append(entry.path)
        return sorted(links), partials

    def links(self) -> list[str]:
        # docstring inherited
        return self._scan()[0]

    def check_room(self, nbytes: int, what: str) -> None:
        """StorageError unless the disk under the root has ``nbytes`` + ``WRITE_HEADROOM`` free:
        a write refused before it starts instead of one cut short."""
        stat = os.statvfs(self.root)
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes + WRITE_HEADROOM:
            raise StorageError(
                f"no space left on the disk of {self.root!r}: {what} may write {nbytes} bytes and needs "
                f"{nbytes + WRITE_HEADROOM} free (with {WRITE_HEADROOM} of headroom), {free} are; nothing was written"
            )

    def prepare_writes(self) -> None:
        """At a writable open: refuse a folder that holds symbolic links (a write through one
        could land outside the buffer), then delete temp files a killed writer left behind."""
        links, partials = self._scan()
        if links:
            named = ", ".join(repr(link) for link in links[:5]) + (
                f" and {len(links) - 5} more" if len(links) > 5 else ""
            )
            raise StorageError(
                f"refusing to open {self.root!r} for writing: it holds symbolic links ({named}), and a write "
                "through one could change files outside the buffer; replace each by a copy of what it "
                "points to, or open the buffer read-only"
            )
        for path in partials:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class StoreKV(KeyValue):
    """Any zarr v3 Store (object stores, fsspec, memory), driven through zarr's event loop.

    ``open_store`` is called lazily and again in a forked or spawned child, so no HTTP session
    or event loop crosses a process boundary.
    """

    # requests in flight at once per call, reads and writes alike; set it on the class (all
    # stores) or on one store's ``kv`` to suit a slower or faster link
    max_in_flight = MAX_IN_FLIGHT

    def __init__(self, open_store: Callable[[], object], name: str):
        self._open_store = open_store
        self.name = name
        self._store = None
        self._pid = None
        self._unpickled = False

    @property
    def store(self):
        if self._store is None or self._pid != os.getpid():
            store = self._open_store()
            if self._unpickled and self.name.startswith("memory://"):
                self._check_memory_visible(store)
            self._store, self._pid = store, os.getpid()
        return self._store

    def _check_memory_visible(self, store: Any) -> None:
        """A ``memory://`` buffer lives in the process that made it (and its forks): a copy
        unpickled in another process (a spawned DataLoader worker, dask's processes scheduler)
        would read an empty store as a buffer of nothing, so it is refused by name, at every
        use there."""
        if not self._run(store.exists("zarr.json")):
            raise StorageError(
                f"{self.name!r} lives in the memory of the process that created it; this process "
                f"(pid {os.getpid()}, started by spawn or a process pool) cannot see it. Use a local "
                "folder or an object store, fork-started DataLoader workers, or the threads scheduler"
            )

    def __getstate__(self):
        return {**self.__dict__, "_store": None, "_pid": None, "_unpickled": True}

    def where(self, key: str) -> str:
        # docstring inherited
        return f"{self.name.rstrip('/')}/{key}"

    def _run(self, coro):
        from ._settle import run

        try:
            return run(coro)
        except (OSError, ConnectionError, TimeoutError) as e:
            raise StorageError(f"store {self.name!r} failed: {e}") from e

    def _run_bounded(self, calls: Sequence[Callable[[], Awaitable]]) -> list:
        """Run the requests ``calls`` make concurrently, at most ``max_in_flight`` at a time,
        so one large read or write is never a burst of thousands of requests."""
        limit = asyncio.Semaphore(self.max_in_flight)

        async def one(call):
            async with limit:
                return await call()

        async def every_call():
            # every call settles before a failure is raised: a write still in flight would
            # land after the caller cleaned up
            results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        return list(self._run(every_call()))

    def get_many(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        # docstring inherited: on obstore an object's size comes with the GET's response headers,
        # so one over ``limit`` is read no further than its first ``limit + 1`` bytes (a second,
        # ranged GET: damage only); other stores read whole objects, ``limit`` or not (bounding
        # them would cost a HEAD per chunk on fsspec stores)
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.storage import ObjectStore

        store, proto, inner = self.store, default_buffer_prototype(), self._innermost()

        async def whole(key: str) -> bytes | None:
            buf = await store.get(key, proto)
            return None if buf is None else buf.to_bytes()

        async def bounded(key: str) -> bytes | None:
            assert limit is not None
            size = await self._obstore_size_or_bytes(inner, key, limit)
            if not isinstance(size, int):
                return size
            buf = await store.get(key, proto, byte_range=RangeByteRequest(0, limit + 1))
            return None if buf is None else buf.to_bytes()

        one = bounded if limit is not None and isinstance(inner, ObjectStore) else whole
        return self._run_bounded([functools.partial(one, k) for k in keys])

    async def _obstore_size_or_bytes(self, inner: Any, key: str, most: int) -> bytes | int | None:
        """One GET of ``key`` on the obstore store ``inner``: None when absent, its bytes when
        within ``most``, else its size (from the response headers; the body is left unread, so
        a damaged or planted multi-GB object never reaches memory)."""
        import obstore

        from ._remote import NamedErrorStore

        store = self.store
        named = store._named if isinstance(store, NamedErrorStore) else lambda _, __: contextlib.nullcontext()
        with named("GET", key):
            try:
                got = await obstore.get_async(inner.store, key)
            except (FileNotFoundError, obstore.exceptions.NotFoundError):
                return None
            size = int(got.meta["size"])
            return size if size > most else bytes(await got.bytes_async())

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | None]:
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest
        from zarr.core.buffer import default_buffer_prototype

        store, proto = self.store, default_buffer_prototype()

        async def one(request):
            key, start, stop = request
            byte_range = SuffixByteRequest(-start) if start < 0 else RangeByteRequest(start, stop)
            buf = await store.get(key, proto, byte_range=byte_range)
            return None if buf is None else buf.to_bytes()

        return self._run_bounded([functools.partial(one, r) for r in requests])

    def get_documents(self, keys: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        # docstring inherited: one GET each. On obstore its size comes with the response headers
        # and the body is read only when it is within ``limit``; other stores are asked for the
        # first ``limit + 1`` bytes (then a HEAD for the error's size)
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.storage import ObjectStore

        store, proto, most = self.store, default_buffer_prototype(), document_limit(limit)
        inner = self._innermost()

        async def via_obstore(key: str) -> bytes | int | None:
            return await self._obstore_size_or_bytes(inner, key, most)

        async def via_range(key: str) -> bytes | int | None:
            buf = await store.get(key, proto, byte_range=RangeByteRequest(0, most + 1))
            if buf is None or len(buf) <= most:
                return None if buf is None else buf.to_bytes()
            try:  # its size, for the error: a HEAD only here
                return await store.getsize(key)
            except FileNotFoundError:  # deleted since: at least what was read
                return len(buf)

        one = via_obstore if isinstance(inner, ObjectStore) else via_range
        out: list[bytes | None] = []
        for key, got in zip(keys, self._run_bounded([functools.partial(one, k) for k in keys])):
            if isinstance(got, int) or (got is not None and len(got) > most):
                raise document_too_large(self.where(key), got if isinstance(got, int) else len(got), most)
            out.append(got)
        return out

    def set_many(self, items: Mapping[str, Blob], atomic: bool = True) -> None:
        from zarr.core.buffer import default_buffer_prototype

        store, proto = self.store, default_buffer_prototype()
        self._run_bounded([functools.partial(store.set, k, proto.buffer.from_bytes(v)) for k, v in items.items()])

    def delete_many(self, keys: Sequence[str]) -> None:
        store = self.store
        self._run_bounded([functools.partial(store.delete, k) for k in keys])

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist yet, in one conditional PUT
        (``If-None-Match: *``); False when it exists. The writer lease is built on this.

        zarr's ``set_if_not_exists`` hides whether it wrote, and on fsspec stores checks then
        writes (two requests: a race), so the clients are called directly."""
        from zarr.storage import FsspecStore, ObjectStore

        store = self._innermost()

        async def put() -> bool:
            if isinstance(store, ObjectStore):
                import obstore

                try:
                    await obstore.put_async(store.store, key, data, mode="create")
                except obstore.exceptions.AlreadyExistsError:
                    return False
                except obstore.exceptions.BaseError as e:
                    raise StorageError(f"conditional PUT {key!r} on {self.name!r} failed: {e}") from e
                return True
            if isinstance(store, FsspecStore):
                try:
                    await store.fs._pipe_file(f"{store.path.rstrip('/')}/{key}", data, mode="create")
                except FileExistsError:
                    return False
                return True
            raise StorageError(f"store {self.name!r} ({type(store).__name__}) offers no conditional write")

        return self._run(put())

    def _innermost(self) -> Any:
        """The store under every wrapper (NamedErrorStore, zarr's own)."""
        from zarr.storage import WrapperStore

        store = self.store
        while isinstance(store, WrapperStore):
            store = store._store
        return store

    @property
    def replaces_conditionally(self) -> bool:
        """Whether ``get_versioned`` and ``replace_if`` work here: on obstore stores (S3), whose
        PUT takes ``If-Match``. fsspec's filesystems offer no read that returns the object's
        version with its bytes nor a write conditional on it (gcsfs writes ``ifGenerationMatch``
        only as 0, for ``create``), so gs://, s3fs and memory:// stores say False."""
        from zarr.storage import ObjectStore

        return isinstance(self._innermost(), ObjectStore)

    def get_versioned(self, key: str, limit: int) -> Versioned | None:
        """``key`` and its version, in one GET; None when absent. The body is read only when
        within ``limit`` bytes. StorageError where not ``replaces_conditionally``."""
        store = self._conditional_store()

        async def get() -> Versioned | None:
            import obstore

            try:
                got = await obstore.get_async(store, key)
            except (FileNotFoundError, obstore.exceptions.NotFoundError):
                return None
            except obstore.exceptions.BaseError as e:
                raise StorageError(f"GET {key!r} on {self.name!r} failed: {e}") from e
            version: ObjectVersion = {}  # obstore refuses a None in a PUT's mode
            if got.meta["e_tag"] is not None:
                version["e_tag"] = got.meta["e_tag"]
            if got.meta["version"] is not None:
                version["version"] = got.meta["version"]
            if not version:  # nothing to make a PUT conditional on
                raise StorageError(f"GET {key!r} on {self.name!r} returned neither an ETag nor a version")
            data = bytes(await got.bytes_async()) if int(got.meta["size"]) <= limit else None
            return Versioned(data, version)

        return self._run(get())

    def replace_if(self, key: str, data: bytes, version: ObjectVersion) -> bool:
        """Write ``key`` only if it is still at ``version`` (from ``get_versioned``), in one
        conditional PUT (``If-Match``); False when it changed or vanished since. A PUT whose
        answer was lost and that the client retried is refused too (its first try changed the
        object): a caller tells that case by reading the object again.
        StorageError where not ``replaces_conditionally``."""
        store = self._conditional_store()

        async def put() -> bool:
            import obstore

            try:
                await obstore.put_async(store, key, data, mode=version)
            except (FileNotFoundError, obstore.exceptions.NotFoundError, obstore.exceptions.PreconditionError):
                return False
            except obstore.exceptions.BaseError as e:
                raise StorageError(f"conditional PUT {key!r} on {self.name!r} failed: {e}") from e
            return True

        return self._run(put())

    def _conditional_store(self) -> Any:
        """The obstore store under ``store``, or StorageError when there is none."""
        if not self.replaces_conditionally:
            raise StorageError(f"store {self.name!r} offers no conditional replace")
        return self._innermost().store

    def size(self, key: str) -> int | None:
        # docstring inherited: one HEAD
        store = self.store

        async def head() -> int | None:
            try:
                return await store.getsize(key)
            except FileNotFoundError:
                return None

        return self._run(head())

    def list_prefix(self, prefix: str) -> list[str]:
        store = self.store

        async def listing():
            return [k async for k in store.list_prefix(prefix)]

        return sorted(self._run(listing()))


class KVBlobs(_StorageMixin):
    """The side-object primitives of a Storage (counters, step logs) over ``self.kv``; mixed in
    before ``Storage`` by every backend whose blobs are files or objects."""

    kv: KeyValue

    def read_blob(self, key: str, limit: int | None = None) -> bytes | None:
        # docstring inherited
        return self.kv.get(key) if limit == ANY_SIZE else self.kv.get_document(key, limit)

    def read_blob_head(self, key: str, nbytes: int) -> bytes | None:
        # docstring inherited: one ranged read of a file; of an object, after its size (a store
        # refuses a range past an object's end: HTTP 416 for an empty one)
        if isinstance(self.kv, LocalKV):
            return self.kv.get_ranges([(key, 0, nbytes)])[0]
        size = self.kv.size(key)
        if not size:
            return None if size is None else b""
        return self.kv.get_ranges([(key, 0, min(nbytes, size))])[0]

    def write_blob(self, key: str, data: bytes) -> None:
        # docstring inherited
        self._check_writable()
        self.kv.set(key, data)

    def write_record(self, key: str, data: bytes | memoryview) -> None:
        # docstring inherited: in place (one write, no rename, on local disk)
        self._check_writable()
        self.kv.set_many({key: data}, atomic=False)

    def delete_blobs(self, prefix: str) -> None:
        # docstring inherited
        self._check_writable()
        self.kv.delete_prefix(prefix)

    def list_blobs(self, prefix: str) -> list[str]:
        # docstring inherited
        return self.kv.list_prefix(prefix)

    def links(self) -> list[str]:
        # docstring inherited
        return self.kv.links()

    def log_pieces(self, name: str, limit: int) -> Iterator[bytes]:
        # docstring inherited: a local log (one appended file) is read LOG_PIECE_BYTES at a time,
        # whatever its size; an object store's segments each whole (one GET), refused by size
        if not isinstance(self.kv, LocalKV):
            yield from super().log_pieces(name, limit)
            return
        for key in self.list_blobs(f"{LOG_PREFIX}{name}/"):
            pos = 0
            while piece := self.kv.get_ranges([(key, pos, pos + LOG_PIECE_BYTES)])[0]:
                yield piece
                pos += len(piece)

    def log_size(self, name: str) -> int | None:
        # docstring inherited
        return sum(self.kv.size(k) or 0 for k in self.list_blobs(f"{LOG_PREFIX}{name}/"))

    def append_log(self, name: str, data: bytes) -> None:
        # docstring inherited
        self._check_writable()
        if not self.kv.append(f"{LOG_PREFIX}{name}/log", data):
            super().append_log(name, data)
