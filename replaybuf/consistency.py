"""The one consistent read: every read path of a buffer another process may be writing
(loaders, ``get_all_data``, ``to_dask``, ``stats``, ``data[...]``, video, the viewer,
concatenated buffers) goes through ``read_consistent``.

The writer's commit order (``buffer.py``) makes a slot's ``_generation`` the guard: it is set
to 0 before a slot's data is touched and published, with a new, larger value, only after the
data and meta rows are written; a value never returns. So if a slot's generation reads ``g > 0``
before and after a read, the slot held episode ``g`` during the whole read, and what was read
(data, meta rows, length) belongs to it. A read therefore

1. names the snapshot it saw: the slots it reads and their generations (a plan, e.g. from the
   buffer's mirror as of ``refresh()``, which is itself checked this way), with their lengths
   and meta rows as of the plan;
2. reads data through the storage, passing the planned generations (``storage/base.py``,
   "Generations");
3. reads the generations of only those slots again, keeps the slots that did not change, and
   re-plans (rereads) or drops the others, a bounded number of times. A storage that
   ``verifies_generations`` (the read cache) did that check itself in step 2, so step 3 reads
   nothing: a batch served from local copies costs no request to the backing store; so did the
   zarr backend's gathers (``Storage.verifies_gathers``: a timestep batch). It reports
   the slots that moved with ``GenerationMismatchError`` instead, and so may the caller for
   what it read besides the storage (a dataset's meta rows from the buffer's mirror).

The writer rewrites a reused slot's data objects in place, so step 2 may also fail to decode a
slot being rewritten: such an error is a retry, not an error. Only an error where no slot
changed is raised as it is; when slots keep changing through every retry,
``ConcurrentWriteError`` (retryable) is raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from .snapshots import SnapshotError
from .storage import BufferReplacedError, ConcurrentWriteError, CorruptChunkError, GenerationMismatchError
from .view import mirror_lock

if TYPE_CHECKING:
    from .buffer import ReplayBuffer
    from .storage.base import Storage
    from .view import BufferView

# rereads of the slots that changed during a read; a writer would have to commit into the same
# slot during each of them to exhaust this
RETRIES = 4
# reads of the bookkeeping by a refresh that saw a slot with a length but no generation
# (between a commit's two writes) before calling it damage, or every slot changed by a writer
REFRESH_READS = 3
# a slot failing its checksum while an in-place edit of it runs is read again, EDIT_WAIT_S apart,
# up to this many times in all before the read gives up (ConcurrentWriteError: retryable)
EDIT_WAITS = 200
EDIT_WAIT_S = 0.001


class _EditWatch:
    """Tells a checksum failure of a slot another process is editing in place (``update``:
    its rows and checksum rewritten inside a ``_revision`` bracket, odd while the edit runs)
    from damage: a failure counts as damage once the slot's revision read after it is even and
    the same as after the previous failure of that slot, so no edit ran in between."""

    def __init__(self, storage: Storage):
        self.storage, self.waits = storage, 0
        self.seen: dict[int, int] = {}  # slot -> its revision read after its last failure
        self.alive: bool | None = None  # whether a live writer holds the buffer (``_writer_alive``)

    def racing(self, error: Exception) -> bool:
        """Whether ``error`` may be a read racing an edit (then waits ``EDIT_WAIT_S``)."""
        slot = getattr(error, "slot", None)
        if not isinstance(error, CorruptChunkError) or slot is None:
            return False
        try:
            revision = self._revision(slot)
        except Exception:  # noqa: BLE001 - a buffer that keeps no revisions: no edit to wait for
            return False
        if revision % 2 == 1 and not self._writer_alive() and self._revision(slot) == revision:
            # no edit runs without a live writer (one that finished and closed since moved the
            # revision, read again after the lease): a killed one left it, and no wait helps
            raise CorruptChunkError(
                f"{error}; slot {slot} was left mid-edit (odd meta/_revision) by a writer that stopped: its "
                "rows fail their checksum until the next writable open finishes the edit (applies it again whole "
                "from the edit log; an earlier release's edit, which logged none, is re-sealed as stored): "
                "ReplayBuffer.from_folder(path) once",
                field=error.field,
                slot=slot,
                steps=error.steps,
                location=error.location,
            ) from error
        racing = revision % 2 == 1 or self.seen.get(slot) != revision
        self.seen[slot] = revision
        if racing:
            self.waits += 1
            time.sleep(EDIT_WAIT_S)
        return racing

    def _revision(self, slot: int) -> int:
        """Slot ``slot``'s ``_revision`` as stored now."""
        return int(self.storage.read_meta_rows("_revision", np.array([slot], np.int64))[0])

    def _writer_alive(self) -> bool:
        """Whether a live writer holds the buffer (asked once: an odd revision without one is a
        killed writer's edit, which the reader would otherwise wait out as ``ConcurrentWriteError``,
        retryable, although no retry can succeed); True when the lease cannot be read."""
        if self.alive is None:
            try:
                self.alive = self.storage.writer_lease().live_holder() is not None
            except Exception:  # noqa: BLE001 - an unreadable lease: wait as for a live edit
                self.alive = True
        return self.alive


def _storage(source: Any) -> Storage:
    return source if not hasattr(source, "storage") else source.storage


def _writing_here(source: Any) -> TypeGuard[ReplayBuffer]:
    """Whether ``source`` is a writable buffer that writes in this process, whose mirror holds
    what it committed. A forked child's copy (a DataLoader worker of the writer) holds the
    mirror as of the fork while the writer goes on committing: it reads what is stored."""
    if getattr(source, "read_only", True) is not False or not hasattr(source, "generations"):
        return False
    lease = getattr(getattr(source, "storage", None), "held_lease", None)
    return lease is not None and lease.lost is None


def committed_generations(source: ReplayBuffer | Storage | Any, slots: np.ndarray) -> np.ndarray:
    """The generation each of ``slots`` holds now (0: empty or being written).

    ``source`` is a buffer (the writer answers from its own mirror, ``_writing_here``) or a
    storage; only the entries of ``slots`` are read, not the whole array."""
    slots = np.asarray(slots, dtype=np.int64)
    if _writing_here(source):
        return source.generations[slots]
    storage = _storage(source)
    try:
        generations = np.asarray(storage.read_meta_rows("_generation", slots), dtype=np.int64)
    except Exception as error:  # another buffer's array in place of the one opened, not damage
        if storage.replaced():
            raise BufferReplacedError(storage.location) from error
        raise
    if storage.replaced(cheap_only=True):  # what was read is of a buffer that is gone
        raise BufferReplacedError(storage.location)
    return generations


def check_same_buffer(storage: Storage) -> None:
    """``BufferReplacedError`` when the buffer ``storage`` opened is no longer at its location:
    the last step of a read planned before it (a dask graph, ``get_all_data``, ``stats``). The
    planned generations cannot tell alone: an overwrite counts on from the old buffer's (every
    planned row would read as padding), and a buffer deleted and created again counts from 1
    again (on an object store, where no stat tells, they would name the new buffer's episodes)."""
    if storage.replaced():
        raise BufferReplacedError(storage.location)


def stored_bookkeeping(
    storage: Storage, names: Iterable[str], slots: np.ndarray | None = None, as_read: dict | None = None
) -> dict[str, np.ndarray]:
    """``_generation``, ``episode_lens`` and the meta fields ``names`` of ``slots`` (None: all
    slots), read from the store and mutually consistent.

    Generations are read before and after the rest; a slot whose generation moved in between
    (or that has no published length) comes back with generation 0 and length 0: its length
    and meta rows are not trusted. What ``refresh()`` loads and every re-plan reads.
    ``as_read`` (a dict) receives the generations as first read, before any was set to 0, and
    under ``"moved"`` the mask of slots whose generation moved during the reads."""

    def read(name: str) -> np.ndarray:
        try:
            return storage.read_meta(name) if slots is None else storage.read_meta_rows(name, slots)
        except Exception as error:  # another buffer's array in place of the one opened, not damage
            if storage.replaced():
                raise BufferReplacedError(storage.location) from error
            raise

    before = np.asarray(read("_generation"), dtype=np.int64)
    if as_read is not None:
        as_read["_generation"] = before
    out = {"episode_lens": np.array(read("episode_lens"))}
    out.update({n: np.array(read(n)) for n in names if n not in ("_generation", "episode_lens")})
    after = np.asarray(read("_generation"), dtype=np.int64)
    # a length with generation 0 both times is kept as read: no commit leaves that for long,
    # so ``refresh`` reports it as damage (a lost _generation chunk) instead of hiding episodes
    if as_read is not None:
        as_read["moved"] = after != before
    unstable = (after != before) | (out["episode_lens"] == 0)  # a negative length is damage, kept
    out["_generation"] = np.where(unstable, 0, before)
    out["episode_lens"][unstable] = 0
    return out


def replanner(
    storage: Storage, slots: np.ndarray, lens: np.ndarray | None = None, meta: dict[str, np.ndarray] | None = None
) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The ``replan`` of ``read_consistent`` for a plan of ``slots`` whose items are read again
    as the episode their slot holds now: the items' bookkeeping is read from the store again
    (``stored_bookkeeping``) into ``lens`` and the ``meta`` rows (updated in place)."""
    rows = {} if meta is None else meta

    def replan(items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        try:
            again = stored_bookkeeping(storage, list(rows), slots[items])
        finally:  # the episodes there now may be another buffer's: never mixed in
            if storage.replaced():
                raise BufferReplacedError(storage.location)
        if lens is not None:
            lens[items] = again["episode_lens"]
        for name, values in rows.items():
            values[items] = again[name]
        return slots[items], again["_generation"]

    return replan


def read_consistent(
    source: ReplayBuffer | Storage | Any,
    slots: np.ndarray,
    generations: np.ndarray,
    read: Callable[[np.ndarray], Any],
    replan: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
    *,
    whole: bool = False,
    exhausted: str = "raise",
    retries: int = RETRIES,
    verified: bool | None = None,
    snapshot: str | None = None,
) -> np.ndarray:
    """Read items ``0 .. n-1`` (item i: slot ``slots[i]`` planned at ``generations[i]``; 0 or
    less: empty, not read) until each was read while its slot held the planned episode.

    ``read(items)`` reads the items listed (indices into ``slots``) into the caller's output,
    passing ``generations[items]`` to every storage read; ``whole=True``: every call reads
    every live item (a batch read at once), and only the last call's values count. After each
    read the generations of the items' slots are read again (``committed_generations``), unless
    the storage ``verifies_generations`` (``verified``: the caller's answer for what ``read``
    reads, ``Storage.verifies_reads``); items that changed, or that a
    ``GenerationMismatchError`` from ``read`` names, are re-planned by ``replan(items)``, which
    returns their new (slots, generations) (and updates what the caller reads for them, e.g.
    lengths), or dropped without ``replan``. Any other error raised by ``read`` is a retry when
    some item changed, and raised when none did.

    Returns ``kept``: True where the item's last read holds its (last) planned episode; False
    for empty or dropped items, whose values the caller must discard. ``slots`` and
    ``generations`` are updated in place by re-plans. When items still change after
    ``retries`` rereads: ``ConcurrentWriteError``, or with ``exhausted='drop'`` they are
    dropped (a sampler draws without them).

    ``snapshot`` (default: ``source.snapshot_name``, a snapshot view's): the plan is that
    snapshot's episodes, so an item whose slot no longer holds its planned episode raises
    ``SnapshotError`` instead of being re-planned or dropped.
    """
    if exhausted not in ("raise", "drop"):
        raise ValueError(f"exhausted must be 'raise' or 'drop', got {exhausted!r}")
    # a writable buffer's own reads: no commit, edit or close() of another thread runs meanwhile
    with mirror_lock(source, writer_only=True):
        return _read_consistent(source, slots, generations, read, replan, whole, exhausted, retries, verified, snapshot)


def _read_consistent(
    source: ReplayBuffer | Storage | Any,
    slots: np.ndarray,
    generations: np.ndarray,
    read: Callable[[np.ndarray], Any],
    replan: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None,
    whole: bool,
    exhausted: str,
    retries: int,
    verified: bool | None,
    snapshot: str | None,
) -> np.ndarray:
    """``read_consistent`` (its arguments checked)."""
    snapshot = snapshot if snapshot is not None else getattr(source, "snapshot_name", None)
    if verified is None:
        verified = _storage(source).verifies_generations
    kept = np.zeros(len(slots), dtype=bool)
    todo = np.flatnonzero(generations > 0)
    failed: Exception | None = None
    edits = _EditWatch(_storage(source))
    attempt = 0
    while attempt <= retries:
        attempt += 1
        if len(todo) == 0:
            return kept
        try:
            read(todo)
            failed = None
        except BufferReplacedError:
            raise
        except Exception as error:  # a decode error of a slot being rewritten is a retry
            failed = error
        if isinstance(failed, GenerationMismatchError):  # the slots it names moved
            changed = np.isin(slots[todo], failed.slots)
        elif verified and failed is None:
            if _storage(source).replaced(cheap_only=True):  # a buffer created again may count the same generations
                raise BufferReplacedError(_storage(source).location)
            changed = np.zeros(len(todo), dtype=bool)
        else:
            changed = committed_generations(source, slots[todo]) != generations[todo]
        if failed is not None and not changed.any():
            if not edits.racing(failed):
                raise failed
            if edits.waits >= EDIT_WAITS:
                raise ConcurrentWriteError(_storage(source).location, list(edits.seen), retries) from failed
            attempt -= 1  # an edit's wait is no retry
            continue
        moved = todo[changed]
        if snapshot is not None and len(moved):
            raise snapshot_gone(snapshot, _storage(source).location, slots[moved]) from failed
        if len(moved) and replan is not None:
            slots[moved], generations[moved] = replan(moved)
        else:
            generations[moved] = 0
        if whole:
            kept[:] = False
        if failed is not None:
            todo = todo[generations[todo] > 0]  # what this read left half read, read again
            continue
        kept[todo[~changed]] = True
        if not changed.any():
            return kept
        todo = np.flatnonzero(generations > 0) if whole else moved[generations[moved] > 0]
    # the last read's failure came with every item left dropped (their slots moved): nothing unread
    if len(todo) == 0 or (exhausted == "drop" and failed is None):
        return kept
    raise ConcurrentWriteError(_storage(source).location, np.unique(slots[todo]), retries) from failed


def check_settled(buffer: BufferView) -> None:
    """For a buffer with no committed episode to read: ``ConcurrentWriteError`` (retryable)
    naming the slots its last ``refresh()`` found a writer changing (``unsettled_slots``), as
    it only looks empty; nothing when it is empty indeed."""
    unsettled = buffer.unsettled_slots()
    if len(unsettled):
        raise ConcurrentWriteError(buffer.storage.location, unsettled, REFRESH_READS - 1)


def snapshot_gone(name: str, location: str, slots: np.ndarray) -> SnapshotError:
    """The ``SnapshotError`` of a snapshot view whose recorded episodes in ``slots`` were
    overwritten or dropped since it was opened: its reads would no longer be that snapshot."""
    return SnapshotError(
        f"snapshot {name!r} of {location!r}: the recorded episode(s) in slot(s) {np.unique(slots).tolist()} were "
        "overwritten or dropped since the view was opened (the snapshot was dropped, or a writer opened with "
        "drop_snapshots_on_overwrite=True reused them); nothing of them is returned"
    )


@dataclass
class ConsistentEpisodes:
    """Episodes that stayed committed and unchanged while they were read."""

    slots: np.ndarray
    generations: np.ndarray
    lens: np.ndarray
    data: dict[str, np.ndarray]
    meta: dict[str, np.ndarray]
    dropped: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)


def read_episodes_consistent(
    buffer: ReplayBuffer | Any,
    slots: Sequence[int] | np.ndarray,
    fields: Sequence[str] | None = None,
    generations: Sequence[int] | np.ndarray | None = None,
    t0: int = 0,
    t1: int | None = None,
    with_meta: bool = True,
) -> ConsistentEpisodes:
    """Read whole episodes (or their steps ``t0 .. t1``) from ``slots`` of a buffer another
    process may be writing.

    Returns the slots that held one committed episode throughout the read, with their data
    (``(n, T, *shape)``, zero past each length, ``T`` the longest kept length less ``t0``, or
    ``t1 - t0``; ``0 <= t0 <= t1 <= max_timesteps``, else ValueError before anything is read),
    meta fields and lengths as stored; ``dropped`` lists the slots left out (empty, being
    rewritten, or no longer holding ``generations`` when a batch plan passes them); when the
    buffer itself was deleted or created again, ``BufferReplacedError`` instead. A slot
    that changed during the read is read again as the episode it holds now when no
    ``generations`` are passed. A snapshot view reads its recorded episodes (a slot outside it
    is empty) and raises ``SnapshotError`` for one no longer stored. ``with_meta=False``
    leaves meta fields out (``meta`` is empty).
    """
    given = np.asarray(slots)
    if given.size and given.dtype.kind not in "iu":  # a cast read 0.5 and True as slots 0 and 1
        raise TypeError(f"read_episodes_consistent: slots must be episode indices (ints), got {slots!r}")
    slots = given.astype(np.int64)
    if slots.ndim != 1:
        raise ValueError(f"slots must be a 1-d sequence of episode indices, got shape {slots.shape}")
    bad = slots[(slots < 0) | (slots >= buffer.max_episodes)]
    if len(bad):
        raise ValueError(f"slots {bad.tolist()} out of range - must be in [0, {buffer.max_episodes})")
    if isinstance(fields, str):  # its letters would be taken as the names
        raise TypeError(
            f"read_episodes_consistent: fields must be a sequence of field names, got the string {fields!r}"
        )
    fields = list(buffer.schema.fields) if fields is None else list(fields)
    unknown = sorted(set(fields) - set(buffer.schema.fields))
    if unknown:
        raise ValueError(
            f"read_episodes_consistent: invalid field names {unknown} - must be among {sorted(buffer.schema.fields)}"
        )
    for name, step in (("t0", t0), ("t1", t1)):  # a float failed in range(), a string in the comparison
        if step is not None and (isinstance(step, bool | np.bool_) or not isinstance(step, int | np.integer)):
            raise TypeError(f"read_episodes_consistent: {name} must be an int step, got {step!r}")
    if generations is not None and np.size(generations) and np.asarray(generations).dtype.kind not in "iu":
        raise TypeError(f"read_episodes_consistent: generations must be ints, got {generations!r}")  # 1.5 was 1
    stop = buffer.max_timesteps if t1 is None else t1
    if not 0 <= t0 <= stop <= buffer.max_timesteps:
        raise ValueError(
            f"read_episodes_consistent: steps t0={t0} .. t1={t1} must satisfy 0 <= t0 <= t1 <= max_timesteps "
            f"({buffer.max_timesteps})"
        )
    # the bookkeeping read too: an hdf5 reader's refresh of another thread would close its file
    with mirror_lock(buffer, writer_only=True):
        return _read_episodes(buffer, slots, fields, generations, t0, t1, stop, with_meta)


def _read_episodes(
    buffer: ReplayBuffer | Any,
    slots: np.ndarray,
    fields: list[str],
    generations: Sequence[int] | np.ndarray | None,
    t0: int,
    t1: int | None,
    stop: int,
    with_meta: bool,
) -> ConsistentEpisodes:
    """``read_episodes_consistent`` (its arguments checked)."""
    storage, meta_names = buffer.storage, list(buffer.schema.meta_fields) if with_meta else []
    plan = stored_bookkeeping(storage, meta_names, slots)
    snapshot = getattr(buffer, "snapshot_name", None)
    if snapshot is not None:  # a snapshot view reads its recorded episodes, or raises
        expected = np.asarray(buffer.generations, np.int64)[slots] if generations is None else generations
        gone = (np.asarray(expected) > 0) & (plan["_generation"] != expected)
        if gone.any():
            raise snapshot_gone(snapshot, storage.location, slots[gone])
        generations = expected
    if generations is not None:
        generations = np.asarray(generations, dtype=np.int64)
        if generations.shape != slots.shape:
            raise ValueError(f"generations has shape {generations.shape}, slots {slots.shape}: pass one per slot")
        plan["_generation"] = np.where(plan["_generation"] == generations, generations, 0)
    gens, lens = plan["_generation"], plan["episode_lens"].astype(np.int64)
    rows: dict[str, np.ndarray] = {}

    def width(items: np.ndarray) -> int:
        """Steps read of each item: ``t1 - t0``, or up to the longest of ``items`` (a mask)."""
        return (stop - t0) if t1 is not None else max(0, int(lens[items].max(initial=0)) - t0)

    def read(items: np.ndarray) -> None:
        end = t0 + width(gens > 0)
        for name in fields:
            values = storage.read_rows(name, slots[items], t0, end, gens[items])
            values[np.arange(t0, end)[None, :] >= lens[items][:, None]] = 0
            if name not in rows or rows[name].shape[1] < values.shape[1]:
                grown = np.zeros((len(slots), values.shape[1], *values.shape[2:]), values.dtype)
                if name in rows:
                    grown[:, : rows[name].shape[1]] = rows[name]
                rows[name] = grown
            rows[name][items, : values.shape[1]] = values
            rows[name][items, values.shape[1] :] = 0  # an earlier, wider read's rows of another episode

    replan = replanner(storage, slots, lens, {n: plan[n] for n in meta_names})
    kept = read_consistent(buffer, slots, gens, read, None if generations is not None else replan)
    if not kept.all() and storage.replaced():  # left out as gone: of a buffer deleted or created again
        raise BufferReplacedError(storage.location)
    cut = width(kept)
    empty = {n: np.zeros((0, cut, *f.shape), f.dtype) for n, f in buffer.schema.fields.items() if n in fields}
    return ConsistentEpisodes(
        slots=slots[kept],
        generations=gens[kept],
        lens=lens[kept],
        data={n: rows[n][kept, :cut] if n in rows else empty[n] for n in fields},
        meta={n: plan[n][kept] for n in meta_names},
        dropped=np.setdiff1d(slots, slots[kept]),
    )
