"""The Storage protocol, the backend registry, and ``make_storage``.

A Storage is where one buffer's bytes live. ``buffer.py`` only talks to this protocol and never
branches on the backend: a backend implements the eight primitives marked abstract below, and
everything else (counters, the step log, batched reads and writes) is built on them here.

The contract (``replaybuf.testing.StorageTests`` checks it on every backend):

- **Lifecycle.** Constructing a Storage does no I/O that writes. ``exists``, then ``create``
  (opens for writing) or ``open(read_only)``; until then ``read_only`` is True. One writer per
  location at a time; any number of readers, in any processes, beside it.
- **Keys.** Side objects (``read_blob`` ...) have ``/``-separated keys relative to the location,
  the buffer's own under ``replaybuf/``. A backend never reads, lists or deletes outside its
  location (``s3://b/buf`` leaves ``s3://b/buf2`` alone). Prefixes passed to ``list_blobs`` and
  ``delete_blobs`` are empty or end in ``/``: file systems and object stores match other
  prefixes differently.
- **Atomicity.** ``write_blob`` replaces an object whole: a reader sees the old or the new
  bytes, never a mix, and never a partial object after a crash. ``commit_state`` is one such
  write and the last step of every commit: a reader that loads the counters it published also
  sees every ``write_rows``/``write_meta`` the writer made before it (durably so with
  ``fsync``).
- **Rows in place.** ``write_rows`` may overwrite in place, not atomically: the commit protocol
  calls it only for slots no reader trusts (``episode_lens`` 0, or invalidated first). A reader
  reading such a slot meanwhile may see a mix of old and new steps, so readers check
  ``episode_lens`` and ``_generation`` after reading. ``update_rows`` is the one write into
  committed episodes (the API's in-place edits), without a new generation: the buffer brackets
  it with writes of the slots' ``_revision`` (odd while the edit runs, a new random even value
  once done; each commit publishes its writer session's), which caches key their copies by
  with the generation. ``write_meta`` writes each
  element in place; ``episode_lens`` and ``_generation`` of a slot are its publication.
- **Reads.** ``read_rows``, ``gather``, ``read_spans`` and ``read_meta`` return the stored
  values (never-written steps read as 0; a reader may serve them from its caches until its next
  ``drop_caches``), for unsorted and repeated episodes, empty spans included. They agree with
  each other. They are the only way callers outside ``replaybuf/storage/`` read data: the array
  objects of ``array`` are the backends' own.
- **Generations.** ``read_rows``, ``gather`` and ``read_spans`` take ``generations``: per
  episode (per pair for ``gather``) the ``_generation`` the caller planned for the slot. What a
  read then guarantees depends on ``verifies_generations``:

  - False (zarr, memmap, hdf5): generations are hints that may key the backend's caches (the
    zarr chunk cache and resident copies: a row cached for one generation is never served for
    another); the read returns the stored rows, as any read does. A reader beside a writer
    re-reads ``_generation`` of the slots it read afterwards (``consistency.read_consistent``)
    and discards the rows of slots that moved.
  - True (the read cache, ``CachedStorage``): every row returned belongs to the generation
    named for its slot (served from a copy keyed by it, or read and then found still at it),
    else ``GenerationMismatchError`` names the slots that hold another generation now. The
    caller needs no re-check of its own, so a read served wholly from a local copy reads
    nothing from the backing store.

  Without ``generations`` a read returns what is stored now and verifies nothing.
  ``verifies_reads(names)`` tells per field: the zarr backend verifies the fields it holds
  resident (each row checked against its slot's stored generation after it was loaded), and
  its reads of them raise GenerationMismatchError as a verifying storage's do.
  ``verifies_gathers(names)`` tells the same of ``gather`` alone: the zarr backend verifies
  every gather given generations (the slots read are checked after the read, the maps of hot
  shards once per map), so a timestep batch needs no re-check of its own.
- **Replacement.** Generations never return at a location: a buffer created over another
  (``overwrite=True``) counts on from the highest generation the old one published
  (``ReplayBuffer._create``), so a generation planned in the old buffer never matches a slot of
  the new one. A read-only storage also tells when the buffer at its location is no longer the
  one it opened (``replaced``): readers ask at ``refresh()`` (which opens the new buffer), at
  every re-plan and, where it costs a stat (memmap, hdf5: the files they map or hold open),
  after every read's re-check, and raise ``BufferReplacedError`` instead of returning rows.
- **Writes.** Data and meta are written through ``write_rows``, ``update_rows`` and
  ``write_meta`` only; nothing outside ``replaybuf/storage/`` writes through ``array``.
- **Read-only.** On a Storage opened read-only every write (the write methods above and
  ``array(...)[...] = ...``) raises PermissionError before anything is written, and reads write
  nothing (no lock files, no metadata updates). A Storage that cannot write at all
  (``supports_writes`` False) raises NotImplementedError instead.
- **Processes.** A Storage pickles as its location and settings, without open files, sessions
  or event loops; the copy reopens what it needs lazily in the process that unpickles it.
  ``drop_caches`` makes the next reads see what other writers committed before the call.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import sys
import time
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar
from urllib.parse import urlsplit

import numpy as np

from ..schema import FORMAT_VERSION, Field, Schema
from .lease import BufferLockedError, FileLease, WriterLease, give_back_dropped
from .lease import give_back as give_back_lease
from .lease import take as take_lease
from .spans import Spans, read_spans_by_rows

STATE_KEY = "replaybuf/state.json"
# inside an upgrade's copy (``.<name>.upgrading-<pid>``) until it is swapped in: which buffer it
# copies, from which process; written before the copy's create (``maintenance.upgrade``)
UPGRADE_MARKER = "replaybuf/upgrading.json"
# the slots a writer is writing in place before publishing them (``Storage.mark_writing``)
WRITING_KEY = "replaybuf/writing"
# the in-place edit running, logged before its writes (``replaybuf.editlog``)
EDIT_KEY = "replaybuf/edit"
# the buffer-level attributes (``replaybuf.attrs``)
ATTRS_KEY = "replaybuf/attrs.json"
LOG_PREFIX = "replaybuf/steplog/"
# what the buffer derived from its episodes, keyed by slot and generation (``sketches``,
# ``snapshots``): erased with it; they name episodes no longer stored (and a buffer created
# where the old one could not be read has unknown generations to count on from)
SKETCHES_PREFIX = "replaybuf/sketches/"
SNAPSHOTS_PREFIX = "replaybuf/snapshots/"
# the most bytes of a metadata object (zarr.json documents, the counters, the writing record,
# attrs, leases, sketches; snapshots allow more per episode): a larger one is refused by its
# size before it is read, so a damaged or planted multi-GB file never reaches memory. Step
# logs are not metadata: an episode in progress may be any size.
MAX_DOCUMENT_BYTES = 64 << 20
# ``read_blob``'s limit for the segments of a step log
ANY_SIZE = -1
_ArrayT = TypeVar("_ArrayT")


class BufferNotFoundError(FileNotFoundError, ValueError):
    """No replaybuf buffer exists at the given location. Also a ValueError: memmap-replay-buffer's
    ``from_folder`` raised one ('metadata.pkl not found'), and code catching it keeps working."""


class UnfinishedCreateError(BufferNotFoundError):
    """The location holds the start of a buffer whose create never finished (killed, or still
    under way in another process; an ``overwrite=True`` erasing the buffer before it counts):
    it holds no episode to keep, so ``overwrite=True`` loses nothing."""


class BufferDamagedError(ValueError):
    """A stored file or object of the buffer cannot be parsed or contradicts the config; the
    message names the file, what it holds and what was expected."""


class NewerFormatError(ValueError):
    """The buffer is of a format newer than this replaybuf reads (a newer release wrote it):
    not damage, a refusal; the message says to install a newer replaybuf."""


class StorageError(RuntimeError):
    """The backing store failed (disk full, connection lost, ...) while reading or writing."""


class UnfinishedEditError(StorageError):
    """The buffer holds an in-place edit a stopped (killed) writer left part applied (slots at
    an odd ``meta/_revision`` with no live writer): their rows and meta values are part old,
    part new until the next writable open finishes the edit (from the edit log). Raised by what
    would take them as whole: a copy (``convert``, ``upgrade``), ``get_all_data`` and the other
    whole-buffer reads of ``analysis``. Not retryable: no writer is running to finish it."""


class CorruptChunkError(StorageError):
    """Stored bytes of an episode fail their checksum, cannot be decoded, or are missing.

    A StorageError (not a ValueError): the caller's arguments are fine, the medium is not. The
    message names the field, the slot, the timesteps and the file or key; the same facts are
    attributes (None when unknown, e.g. after crossing a DataLoader worker boundary, which
    rebuilds the error from its message). ``replaybuf verify`` lists every damaged episode and
    ``verify(path, repair=True)`` drops them.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        slot: int | None = None,
        steps: tuple[int, int] | None = None,
        location: str | None = None,
    ):
        super().__init__(message)
        self.field, self.slot, self.steps, self.location = field, slot, steps, location
        self.checksums: str | None = None  # the file of the checksum it failed, kept apart from the data

    @classmethod
    def at(cls, field: str, slot: int, steps: tuple[int, int], location: str, reason: str) -> CorruptChunkError:
        """The error for steps ``[steps[0], steps[1])`` of ``slot`` stored at ``location``."""
        return cls(
            f"{field}: slot {slot}, timesteps {steps[0]}..{steps[1] - 1}: {reason} ({location})",
            field=field,
            slot=slot,
            steps=steps,
            location=location,
        )

    @classmethod
    def against_kept(
        cls, field: str, slot: int, steps: tuple[int, int], location: str, checksums: str
    ) -> CorruptChunkError:
        """The error for an episode whose data at ``location`` fails the crc32c kept apart from
        it in ``checksums``: its data is damaged, or one of the two files was copied in from
        another buffer or an older copy, which neither file alone can tell; both are named
        (``checksums`` is an attribute too)."""
        error = cls.at(
            field,
            slot,
            steps,
            location,
            f"episode fails its crc32c kept in {checksums} (its data is damaged, or this data file or that "
            "checksum file was copied in from another buffer or an older copy)",
        )
        error.checksums = checksums
        return error


class ChecksumEntryError(CorruptChunkError):
    """The stored checksum of an episode is damaged, not (as far as can be told) its data: an
    entry of a memmap or hdf5 buffer's ``replaybuf/checksums.npy`` fails its own check, so the
    episode cannot be checked against it. ``location`` names checksums.npy; ``data_verified``
    says whether the episode's data still matches the crc32c the damaged entry holds (a flip in
    the entry's other bits). ``replaybuf verify --repair`` re-seals the entry from the data
    instead of dropping the episode."""

    def __init__(self, message: str, *, data_verified: bool = False, **facts: Any):
        super().__init__(message, **facts)
        self.data_verified = data_verified


class ChunkChecksumError(ChecksumEntryError):
    """A stored zarr chunk's own crc32c (the 4 bytes after its payload, or a shard index's) is
    damaged, not its data: it is one bit away from the crc32c of the bytes it covers, which
    damaged data cannot cause (``_codecs.crc_bit_flipped``). Reads still raise it; ``location``
    names the chunk's file (and inner chunk), ``data_verified`` is always True, and
    ``replaybuf verify --repair`` re-seals the chunk in place instead of dropping the episode."""

    def __init__(self, message: str, *, data_verified: bool = True, **facts: Any):
        super().__init__(message, data_verified=data_verified, **facts)


class EpisodeLengthError(CorruptChunkError):
    """A committed episode's stored length is damaged, not its data: the data fails its
    checksum at the length ``meta/episode_lens`` holds and matches it at ``matches`` steps (0:
    unknown; memmap, hdf5: the checksum entries do not depend on the length). ``location`` names the
    lengths' file; ``replaybuf verify --repair`` restores the length instead of dropping the
    episode. From format 5, where the meta checksum covers the length, the data file may be
    the one that is not the episode's (``found``)."""

    def __init__(self, message: str, *, matches: int = 0, **facts: Any):
        super().__init__(message, **facts)
        self.matches = matches

    @classmethod
    def found(
        cls, field: str, slot: int, length: int, data_says: str, matches: int, lengths: str, data: str, summed: bool
    ) -> EpisodeLengthError:
        """The error for ``slot`` stored with ``length`` steps (in file ``lengths``) whose data
        of array ``field`` (file ``data``) ``data_says`` ``matches`` steps. Where ``_meta_sum``
        covers lengths (``summed``: format 5), every open checked the length there, so a data
        file copied in from another buffer or an older copy is as likely as a damaged length:
        both files are named and neither is blamed; ``verify --repair`` restores the length
        only where the meta checksum and every field agree on one, else drops the episode."""
        said = f"meta/episode_lens: slot {slot} holds {length} steps, but its {field} {data_says} {matches} steps"
        if summed:
            message = (
                f"{said}: the length, or that data file, is damaged or not this episode's (copied in from another "
                f"buffer or an older copy) ({lengths}; {data}). `replaybuf verify --repair` restores the length "
                "where the slot's meta checksum and every field agree on one, else drops the episode"
            )
        else:
            message = (
                f"{said}: the length is damaged, not the data ({lengths}). `replaybuf verify --repair` restores it"
            )
        return cls(message, field="meta/episode_lens", slot=slot, steps=(0, length), location=lengths, matches=matches)


class LostLengthError(EpisodeLengthError, BufferDamagedError):
    """Committed slots' stored lengths read 0 (a zeroed or damaged ``meta/episode_lens``):
    their generations are ones the counters count, and no writer is unpublishing them. Every
    open refuses it, so no episode silently vanishes; ``slots`` lists them (``slot``: the
    first) and ``replaybuf verify --repair`` restores each length its data shows."""

    def __init__(self, message: str, *, slots: list[int], **facts: Any):
        super().__init__(message, slot=slots[0], **facts)
        self.slots = slots


class GenerationMismatchError(RuntimeError):
    """A read given ``generations`` by a storage that ``verifies_generations`` found slots
    holding other generations: a writer reused them since the caller planned the read.
    ``slots`` lists them; nothing the read wrote into a caller's ``out`` may be used. Retryable
    with a new plan (``consistency.read_consistent`` re-plans or redraws those slots)."""

    def __init__(self, location: str, slots: Any):
        self.location, self.slots = location, sorted({int(s) for s in np.asarray(slots).reshape(-1)})
        super().__init__(
            f"slots {self.slots} of {location!r} no longer hold the generations the read was planned for "
            "(a writer reused them); plan the read again"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.location, self.slots)


class ConcurrentWriteError(RuntimeError):
    """A writer kept changing the slots being read through every bounded retry. Retryable:
    call again (or ``refresh()`` and call again)."""

    def __init__(self, location: str, slots: Iterable[int], retries: int):
        self.location, self.slots, self.retries = location, [int(s) for s in slots], retries
        super().__init__(
            f"slots {self.slots} of {location!r} were rewritten by a concurrent writer during each of "
            f"{retries + 1} reads; the read is retryable"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.location, self.slots, self.retries)


class StalePlanError(ConcurrentWriteError):
    """Lazy arrays (``to_dask``, ``get_all_data(lazy=True)``, ``to_xarray``) computed after a
    writer rewrote or dropped some of the episodes they were planned with: their rows can no
    longer be read as those episodes, and padding under the planned lengths and meta values
    would pass for data. Retryable: ``refresh()`` and plan again."""

    def __init__(self, location: str, slots: Iterable[int]):
        self.location, self.slots, self.retries = location, sorted({int(s) for s in slots}), 0
        RuntimeError.__init__(
            self,
            f"slots {self.slots} of {location!r} were rewritten or dropped by a writer since these lazy arrays were "
            "planned (at the buffer's last refresh()); their rows can no longer be read as the planned episodes. "
            "refresh() and plan again (to_dask(), get_all_data(lazy=True)); get_all_data() reads such slots again "
            "as the episodes they hold now, and a snapshot (the writer's buffer.snapshot(name)) pins its episodes",
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.location, self.slots)


class BufferReplacedError(ConcurrentWriteError):
    """The buffer a reader opened is no longer the one at its location: another process
    created a new buffer there (``overwrite=True``) or upgraded it, so the files or objects the
    reader holds, and the episodes it planned, belong to a buffer that is gone. Nothing of the
    read is returned. Retryable: ``refresh()`` opens the new buffer when its config is the
    reader's (and raises this error again, naming the differences, when it is not)."""

    def __init__(self, location: str, detail: str = ""):
        self.detail = detail
        RuntimeError.__init__(
            self,
            f"the buffer at {location!r} was replaced by another process (overwrite=True or an upgrade) "
            f"since this reader opened it{': ' + detail if detail else ''}; nothing of the read was returned. "
            "Call refresh() to read the new buffer (or reopen it with ReplayBuffer.from_folder)",
        )
        self.location, self.slots, self.retries = location, [], 0

    def __reduce__(self) -> tuple:
        return type(self), (self.location, self.detail)


# bytes of hot episodes a writer keeps before compacting the oldest (ReplayBuffer's hot_bytes)
DEFAULT_HOT_BYTES = 1 << 30


@dataclasses.dataclass
class CompactionSummary:
    """What ``compact()`` did: episodes compacted, their shards' bytes before and after, and the
    wall time it took."""

    episodes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0


class ArrayLike(Protocol):
    """What ``buffer.data[name]`` and ``buffer.meta_data[name]`` return: numpy-style indexing."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def __getitem__(self, key: Any) -> np.ndarray: ...

    def __setitem__(self, key: Any, value: Any) -> None: ...


# ndarray methods an ``ArrayBase`` answers on a copy of its whole contents, as the seed's
# numpy memmaps do (``buffer.data['reward'].sum()``, ``buffer.meta_data['score'].mean()``)
NDARRAY_READS = frozenset(
    {
        "all", "any", "argmax", "argmin", "argsort", "astype", "clip", "copy", "cumprod", "cumsum", "flatten",
        "item", "max", "mean", "min", "nonzero", "prod", "ravel", "reshape", "round", "squeeze", "std", "sum",
        "swapaxes", "T", "tobytes", "tolist", "transpose", "var",
    }
)  # fmt: skip


class ArrayBase(np.lib.mixins.NDArrayOperatorsMixin):
    """``ndim``, ``size``, ``len()``, ``np.asarray()``, numpy's operators (``view == 1``,
    ``view + 1``) and reading ndarray methods (``NDARRAY_READS``) of an ``ArrayLike``, built on
    its ``shape`` and ``__getitem__``: written once for the backends' arrays and the buffer's
    views of them, so code written for the seed's memmaps runs on them."""

    __hash__ = object.__hash__  # identity, as before the operators (the mixin's __eq__ unsets it)

    @property
    def ndim(self: ArrayLike) -> int:
        return len(self.shape)

    @property
    def size(self: ArrayLike) -> int:
        return int(np.prod(self.shape))

    def __len__(self: ArrayLike) -> int:
        return self.shape[0]

    def __array__(self: ArrayLike, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self[:])
        return out if dtype is None else out.astype(dtype)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """A ufunc of the contents; never in place (``view += 1``): writes go through indexing."""
        if any(isinstance(x, ArrayBase) for x in kwargs.get("out", ())):
            raise TypeError(
                f"{self!r}: an in-place operator ({ufunc.__name__} into the view) is not supported and "
                "nothing was written; write the stored values through indexing, e.g. view[...] = view[...] + 1"
            )
        inputs = tuple(np.asarray(x) if isinstance(x, ArrayBase) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in NDARRAY_READS:
            return getattr(np.asarray(self), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class WrappedArray(ArrayBase):
    """An ``ArrayBase`` with the shape and dtype of the array object ``_wrapped()`` returns (an
    h5py dataset, a memmap, a snapshot's values), asked on every use: it may be reopened."""

    def _wrapped(self) -> Any:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        return self._wrapped().shape

    @property
    def dtype(self) -> np.dtype:
        return self._wrapped().dtype


# the per-episode array of each slot's meta checksum (``replaybuf/metasums.py``)
META_SUM = "_meta_sum"


def bookkeeping_fields(schema: Schema) -> dict[str, Field]:
    """Per-episode arrays every backend stores besides the user's meta fields.

    ``episode_lens`` (int32, as the seed) is the published length of each slot: 0 means the slot
    holds no committed episode. ``_generation`` (int64) is the 1-based ordinal of the commit that
    filled the slot, so readers can order a circular buffer chronologically and notice reuse.
    ``_revision`` (int64) is a random even value that each commit (its writer session's) and
    each in-place edit of the slot's rows (odd while one runs) gives the slot anew: a cached
    copy is keyed by (generation, revision), so neither an edit nor an episode written again
    into a copy of the buffer restored from a backup is served stale (``storage/_cache.py``;
    ``commit.py``). ``_meta_sum`` (uint64) checksums each committed slot's
    meta values and generation (``replaybuf/metasums.py``), from format ``META_SUMS_FORMAT``.
    Buffers written before them lack them (``OPTIONAL_META``, ``UNKEPT_META``).
    """
    del schema
    return {
        "episode_lens": Field("episode_lens", np.dtype("int32")),
        "_generation": Field("_generation", np.dtype("int64")),
        "_revision": Field("_revision", np.dtype("int64")),
        META_SUM: Field(META_SUM, np.dtype("uint64")),
    }


# bookkeeping arrays a buffer written by an earlier release may lack: a read-only open reads
# them as zeros (``AbsentMeta``), a writable open creates them (zeros)
OPTIONAL_META: dict[str, np.dtype] = {"_revision": np.dtype("int64")}
# the first format that keeps ``_meta_sum`` and a crc32c in its counters. An earlier release
# writes earlier formats and would leave them stale (a false damage report): a buffer of an
# earlier format neither keeps nor checks them, and stays in its format
META_SUMS_FORMAT = 4
# the first format whose ``_meta_sum`` covers each slot's length too: an earlier one's entries
# do not, and a buffer keeps the entries of its format
LENGTH_SUMS_FORMAT = 5
# bookkeeping arrays a buffer of a format before ``META_SUMS_FORMAT`` does not keep: read as
# zeros (``AbsentMeta``) whether or not a file is there, never created nor written
UNKEPT_META: dict[str, np.dtype] = {META_SUM: np.dtype("uint64")}


class AbsentMeta(ArrayBase):
    """An ``OPTIONAL_META`` array a buffer lacks, as a read-only open sees it, or an
    ``UNKEPT_META`` array of an earlier format: all zeros."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype, location: str):
        self.name, self.shape, self.dtype, self.location = name, shape, np.dtype(dtype), location

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.zeros(self.shape, self.dtype)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise PermissionError(f"meta/{self.name} of {self.location!r} is absent (an earlier release wrote it)")

    def take(self, episodes: np.ndarray) -> np.ndarray:
        """Entries ``episodes`` (the zarr arrays' ``take``)."""
        return np.zeros((len(np.asarray(episodes).reshape(-1)), *self.shape[1:]), self.dtype)


def empty_state() -> dict:
    """Counters of an empty buffer."""
    return {"num_episodes": 0, "episode_index": 0, "total_episodes": 0}


COUNTERS = tuple(empty_state())
# the key of the counters object's own crc32c (of the rest, as ``commit_state`` writes it)
STATE_CHECKSUM = "crc32c"
# every key a counters object may hold (``writing``: an earlier release's)
STATE_KEYS = frozenset((*COUNTERS, "cleared", "empty_episodes", "writing", STATE_CHECKSUM))


def state_body(state: dict) -> bytes:
    """The counters object ``state`` as ``commit_state`` stores it, without its crc32c."""
    return json.dumps({k: v for k, v in state.items() if k != STATE_CHECKSUM}, sort_keys=True).encode()


def document_limit(limit: int | None = None) -> int:
    """``limit``, or ``MAX_DOCUMENT_BYTES`` (its value now) when None."""
    return MAX_DOCUMENT_BYTES if limit is None else limit


def document_too_large(where: str, size: int, limit: int) -> BufferDamagedError:
    """The error for the metadata object ``where`` of ``size`` bytes, over ``limit`` (unread)."""
    setting = " (replaybuf.storage.MAX_DOCUMENT_BYTES)" if limit == MAX_DOCUMENT_BYTES else ""
    return BufferDamagedError(
        f"{where}: {size:,} bytes, over the {limit:,}-byte limit of this metadata object{setting}; "
        "not read: damaged, or not written by replaybuf"
    )


def parse_json(raw: bytes, where: str) -> dict:
    """The JSON object in ``raw``, or BufferDamagedError naming ``where`` (a file or key)."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise BufferDamagedError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise BufferDamagedError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def expected_layouts(
    schema: Schema, meta_sums: bool = True
) -> dict[tuple[str, bool], tuple[tuple[int, ...], np.dtype]]:
    """(name, meta) -> (shape, dtype) of every array a buffer with ``schema`` stores
    (``UNKEPT_META`` left out unless ``meta_sums``: a format that keeps them)."""
    out = {
        (n, False): ((schema.max_episodes, schema.max_timesteps, *f.shape), f.dtype) for n, f in schema.fields.items()
    }
    for n, f in {**schema.meta_fields, **bookkeeping_fields(schema)}.items():
        if meta_sums or n not in UNKEPT_META:
            out[n, True] = ((schema.max_episodes, *f.shape), f.dtype)
    return out


def check_layout(where: str, shape: tuple[int, ...], dtype: np.dtype, expected: tuple[tuple[int, ...], np.dtype]):
    """Refuse a stored array whose shape or dtype is not the one the config implies."""
    if tuple(shape) != tuple(expected[0]) or np.dtype(dtype) != np.dtype(expected[1]):
        raise BufferDamagedError(
            f"{where} holds {np.dtype(dtype)}{list(shape)}, the config expects "
            f"{np.dtype(expected[1])}{list(expected[0])}"
        )


def check_state(state: dict, schema: Schema, where: str) -> dict:
    """The counters ``state`` with every value checked against the config.

    A commit replaces the counters object atomically, so values of the wrong type or outside
    their range are damage, not a crash's residue: refused, naming the file.
    """
    for key in COUNTERS:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BufferDamagedError(f"{where}: {key} is {value!r}, expected an int >= 0")
    if state["num_episodes"] > schema.max_episodes:
        raise BufferDamagedError(
            f"{where}: num_episodes is {state['num_episodes']}, over max_episodes {schema.max_episodes}"
        )
    if state["episode_index"] >= schema.max_episodes:
        raise BufferDamagedError(
            f"{where}: episode_index is {state['episode_index']}, expected < max_episodes {schema.max_episodes}"
        )
    for key in ("writing", "empty_episodes"):  # slots being written; committed length-0 episodes
        slots = state.get(key, [])
        if not isinstance(slots, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < schema.max_episodes for s in slots
        ):
            raise BufferDamagedError(
                f"{where}: {key} is {slots!r}, expected a list of slots in [0, {schema.max_episodes})"
            )
    return state


def last_occurrences(keys: np.ndarray) -> np.ndarray:
    """The index of the last occurrence of each distinct value of ``keys``, in sorted order of
    the values: a write naming one place twice keeps its last value, as numpy assignment does."""
    _, first_from_end = np.unique(keys[::-1], return_index=True)
    return len(keys) - 1 - first_from_end


def edited_rows(
    read: Callable[[np.ndarray, int], np.ndarray], episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(slots, rows) for ``Storage.update_steps`` by whole rows: the slots ``episodes`` names
    (sorted, unique) and their rows through the last step named at least (``read(slots,
    steps)``), with ``values`` set at the pairs named (a pair named twice: its last value)."""
    steps = int(timesteps.max()) + 1
    keep = last_occurrences(episodes * steps + timesteps)
    slots, inverse = np.unique(episodes[keep], return_inverse=True)
    rows = np.array(read(slots, steps))
    rows[inverse, timesteps[keep]] = values[keep]
    return slots, rows


def unpublished_slots(lens: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """Slots with a length but no generation: a reader caught between a commit's two writes,
    or a lost ``_generation`` chunk (a missing chunk reads as 0)."""
    return np.flatnonzero((lens > 0) & (generations == 0))


def check_bookkeeping(lens: np.ndarray, generations: np.ndarray, schema: Schema, where: str) -> None:
    """Refuse per-episode lengths and generations no commit can have written."""
    bad = np.flatnonzero((lens < 0) | (lens > schema.max_timesteps))
    if len(bad):
        raise BufferDamagedError(
            f"meta/episode_lens of {where}: slots {bad[:10].tolist()} hold lengths {lens[bad[:10]].tolist()}, "
            f"outside [0, max_timesteps={schema.max_timesteps}]"
        )
    bad = np.flatnonzero(generations < 0)
    if len(bad):
        raise BufferDamagedError(
            f"meta/_generation of {where}: slots {bad[:10].tolist()} hold negative generations "
            f"{generations[bad[:10]].tolist()}"
        )
    bad = unpublished_slots(lens, generations)
    if len(bad):
        raise BufferDamagedError(
            f"meta/_generation of {where}: committed slots {bad[:10].tolist()} have generation 0 "
            "(a lost or zeroed _generation chunk); their order cannot be recovered"
        )


def meta_file(storage: Storage, name: str) -> str:
    """Where meta array ``name`` of ``storage`` is stored (its file, or its key and location)."""
    try:
        return str(storage.data_file(name, meta=True))  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError, KeyError):
        return str(storage.describe_key(f"meta/{name}"))


def committed_without_length(lens: np.ndarray, generations: np.ndarray, state: dict) -> np.ndarray:
    """Slots whose length reads 0 although their generation is one the counters count (a
    commit publishes its generation, then its length, then the counters: a commit cut short,
    or a live one, has a newer generation). Only a writer unpublishing them leaves that, for
    a moment: a circular reuse or a drop clears the length, then the generation."""
    return np.flatnonzero((lens == 0) & (generations > 0) & (generations <= int(state["total_episodes"])))


def stopped_writer_leftovers(storage: Storage, lens: np.ndarray, generations: np.ndarray, state: dict) -> np.ndarray:
    """The slots among ``committed_without_length`` that a writer killed while unpublishing
    them may have left so: the next slots to write (a circular reuse clears them from there on),
    and the slots of its writing record (a drop or clear marks them first; a torn record:
    every one)."""
    suspects = committed_without_length(lens, generations, state)
    writing = storage.writing_slots()
    if writing is None:
        return suspects
    max_episodes = len(lens)
    newest = int(generations.max()) if len(generations) else 0
    slot = int(np.argmax(generations) + 1) if newest > int(state["total_episodes"]) else int(state["episode_index"])
    reusing = set(writing)
    for _ in range(max_episodes):
        slot %= max_episodes
        if slot not in suspects:
            break
        reusing.add(slot)
        slot += 1
    return suspects[np.isin(suspects, np.fromiter(reusing, np.int64, len(reusing)))]


def check_lost_lengths(
    storage: Storage, lens: np.ndarray, generations: np.ndarray, state: dict, beside_writer: bool = False
) -> None:
    """Refuse committed slots (``committed_without_length``) whose length is lost: their
    ``episode_lens`` chunk is not stored at all (deleted, or a dangling link), or it holds 0
    for them (zeroed, damaged). Either would make every episode in it vanish, and a writable
    open would then clear their generations for good. Lengths of 0 are left alone
    ``beside_writer`` (a live writer may be unpublishing them: the caller read again, and reads
    them as empty), and where a killed writer may have left them half unpublished
    (``stopped_writer_leftovers``, until the next writable open recovers them)."""
    committed = committed_without_length(lens, generations, state)
    if not len(committed):
        return
    lost = storage.unstored_meta_slots("episode_lens", committed)
    if len(lost):
        raise BufferDamagedError(
            f"meta/episode_lens of {storage.location}: the chunk holding the lengths of committed slots "
            f"{lost[:10].tolist()} is missing (they have generations, the counters count them); "
            "restore it from a backup, or copy the buffer"
        )
    if beside_writer:
        return
    if storage.writer_stopped():
        committed = np.setdiff1d(committed, stopped_writer_leftovers(storage, lens, generations, state))
    if len(committed):
        where = meta_file(storage, "episode_lens")
        raise LostLengthError(
            f"meta/episode_lens of {storage.location}: committed slots {committed[:10].tolist()} hold length 0, "
            f"but their generations {generations[committed[:10]].tolist()} are ones the counters count "
            f"(total_episodes {int(state['total_episodes'])}) and no writer is unpublishing them: their lengths "
            f"are damaged ({where}). `replaybuf verify --repair` restores each length its data shows",
            field="meta/episode_lens",
            slots=committed.tolist(),
            location=where,
        )


class Storage(ABC):
    """One buffer's bytes: arrays ``data/<field>`` (episode, time, *shape), ``meta/<field>``
    (episode, *shape), the counters object and the step log; see the module docstring for
    what every method guarantees.

    A backend must implement the eight abstract primitives (``exists``, ``create``, ``open``,
    ``array``, ``read_blob``, ``write_blob``, ``delete_blobs``, ``list_blobs``) and may override
    any other method for speed (the built-in backends override ``time_chunk``, ``write_rows``,
    ``update_rows``, ``write_meta``, ``read_rows``, ``_read_spans``, ``gather``, ``preload``,
    ``read_meta``, ``drop_caches``, ``close`` and ``describe``; zarr the hot tier's
    ``start_hot_tier``, ``compact`` and ``hot_shards``; ``KVBlobs`` gives ``append_log``
    real appends). Callers branch on the capability flags below, never on ``isinstance`` or
    ``backend_name``.

    Parameters
    ----------
    location
        A local path or a URL the backend understands.
    storage_options
        Passed to the underlying store (endpoint, credentials, ...); never stored.
    fsync
        Make every committed write durable against power loss, not only process crashes.
    """

    #: the name the backend is registered under (``replaybuf info`` and ``repr`` show it)
    backend_name: ClassVar[str] = ""
    #: False for storages that only read (the concatenation of several buffers): every write
    #: raises NotImplementedError, and ``create``/``open(read_only=False)`` are refused
    supports_writes: ClassVar[bool] = True
    #: takes URLs of object stores (``s3://``, ``gs://``, ``memory://``), not only local paths
    supports_remote: ClassVar[bool] = False
    #: a reader's ``drop_caches`` (its ``refresh()``) closes what its reads use (HDF5's file):
    #: a read-only ReplayBuffer holds its lock through each read (``view.mirror_lock``), so a
    #: refresh of another thread waits for it instead of closing the file under it
    closes_at_refresh: bool = False
    #: honours a field's ``compressor`` spec (``convert(compressor=...)`` refuses it otherwise)
    supports_field_codecs: ClassVar[bool] = False
    #: a read given ``generations`` returns only rows of those generations, else raises
    #: GenerationMismatchError: callers skip their own re-check (see "Generations" above)
    verifies_generations: ClassVar[bool] = False
    #: the on-disk format version this backend writes (``replaybuf upgrade`` brings older ones to it)
    newest_format_version: ClassVar[int] = FORMAT_VERSION
    #: the format version in the opened buffer's stored config, or the one ``create`` wrote
    #: (None: neither yet, or a memmap-replay-buffer folder, which stores none)
    format_version: int | None = None
    #: the opened buffer's ``_meta_sum`` entries are hashed as its format's first commits on
    #: main hashed them (``early_hashing``): found by ``metasums.settle`` from its committed slots
    meta_sums_as_earlier: bool = False
    _lease: WriterLease | None = None
    _lease_finalizer: weakref.finalize | None = None
    _lease_epoch = 0

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        self.location = str(location)
        self.storage_options = dict(storage_options or {})
        self.fsync = fsync
        self.read_only = True

    @property
    def keeps_meta_sums(self) -> bool:
        """Whether the buffer keeps ``_meta_sum`` and its counters' crc32c (format
        ``META_SUMS_FORMAT`` and later; a backend's ``create`` writes its newest format)."""
        return self.format_version is not None and self.format_version >= META_SUMS_FORMAT

    @property
    def seed_may_write(self) -> bool:
        """Whether the memmap-replay-buffer library may write this buffer (a folder of its own,
        or one replaybuf adopted): its writes move no slot's generation or revision, so no
        copy keyed by them may outlive this open (the read cache keeps none of its rows)."""
        return False

    @property
    def binds_shards(self) -> bool:
        """Whether each shard of the buffer's sharded arrays (zarr image fields) holds a binding
        to its field and slot (and from zarr format 6 to its buffer), written and checked (zarr
        format 5 and later: ``_shards.ShardBinding``)."""
        return False

    @property
    def sums_lengths(self) -> bool:
        """Whether ``_meta_sum`` covers each slot's length too (format ``LENGTH_SUMS_FORMAT``
        and later): a damaged length is then found by every open, before any data is read."""
        version = self.format_version
        return (
            self.keeps_meta_sums
            and version is not None
            and version >= LENGTH_SUMS_FORMAT
            and not (self.meta_sums_as_earlier and version == LENGTH_SUMS_FORMAT)
        )

    @property
    def early_hashing(self) -> str | None:
        """What the first commits on main of the opened buffer's format (minutes each, until
        the next merge) left out of its ``_meta_sum`` entries, hashing them as the format
        before though they wrote its version: ``"lengths"`` (format 5), ``"buffer"`` (zarr
        format 6); None for the other formats. A buffer they wrote opens, reads and writes as
        written (``metasums.settle``)."""
        return "lengths" if self.keeps_meta_sums and self.format_version == LENGTH_SUMS_FORMAT else None

    @property
    def binds_meta_sums(self) -> bool:
        """Whether ``_meta_sum`` binds each slot to the buffer too, by its uuid (zarr format 6
        and later, whose ``meta/_meta_sum`` document keeps a second copy of it): the values of
        another buffer's slots, copied in with their entries, fail them."""
        return False

    def stored_layouts(self, schema: Schema) -> dict[tuple[str, bool], tuple[tuple[int, ...], np.dtype]]:
        """``expected_layouts`` of the opened buffer's format: what an open loads."""
        return expected_layouts(schema, meta_sums=self.keeps_meta_sums)

    # ---- primitives -------------------------------------------------------------------

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        """Whether ``location`` holds a buffer of this backend (used to detect backends)."""
        return False

    @abstractmethod
    def exists(self) -> bool:
        """Whether a buffer of this backend exists at the location (reads only)."""

    @abstractmethod
    def create(self, schema: Schema, overwrite: bool) -> None:
        """Create an empty buffer (erasing an existing one when ``overwrite``) and open it for writing.

        Every data and meta array reads as zeros (fill 0), ``episode_lens`` and ``_generation``
        included, and ``load_state()`` returns ``empty_state()``. Only what a buffer of this
        backend owns may be erased: a location holding anything else raises
        ``ForeignEntriesError`` before anything is deleted or written. It stores
        ``schema.to_json()`` with ``"version": newest_format_version`` and sets
        ``format_version`` to it: from format ``META_SUMS_FORMAT`` the buffer keeps per-slot
        meta checksums and sealed counters (``keeps_meta_sums``); without a version it keeps
        neither and its damage goes unnoticed.
        """

    def check_creatable(self) -> list[str]:
        """The top-level entries ``create`` would erase, all owned by a buffer of this backend;
        raise ``ForeignEntriesError`` (or the error for another backend's buffer) when the
        location holds anything else. Reads only: the buffer calls it before taking the writer
        lease, so a refused create writes nothing at all. The default refuses a location where
        another registered backend finds its buffer (``refuse_another_backends_buffer``), and
        finds nothing to erase; a backend that overrides it refuses that too."""
        refuse_another_backends_buffer(self)
        return []

    def check_schema(self, schema: Schema) -> None:
        """Refuse a new buffer's ``schema`` that this backend cannot create here (a dtype it has
        no type for, arrays reserved up front that the disk has no room for), naming the field,
        before ``create`` erases the buffer it replaces: failing in the create itself, it lost
        that buffer for nothing. Reads only; ``create`` calls it before erasing, the buffer
        before taking the writer lease."""

    @abstractmethod
    def open(self, read_only: bool) -> Schema:
        """Open an existing buffer and return its stored schema; raise BufferNotFoundError if none.

        ``read_only=True`` writes nothing, then or later (see the module docstring). The stored
        config is read back through ``_schema_from_config``, which checks it and its version
        and sets ``format_version``."""

    @abstractmethod
    def array(self, name: str, meta: bool = False) -> ArrayLike:
        """The stored array of a field (``meta`` for per-episode fields and bookkeeping):
        numpy-style indexing over the stored values. It pickles without its data.
        Assigning to it writes in place (refused when read-only); prefer ``write_rows`` and
        ``write_meta``, which the backends batch."""

    @abstractmethod
    def read_blob(self, key: str, limit: int | None = None) -> bytes | None:
        """The bytes of a small side object, or None when absent; BufferDamagedError naming it
        when it holds more than ``limit`` bytes (default ``MAX_DOCUMENT_BYTES``), judged before
        it is read. ``ANY_SIZE`` reads any size (a step log's segments)."""

    def read_blob_head(self, key: str, nbytes: int) -> bytes | None:
        """The first ``nbytes`` of a side object (all of it when shorter), or None when absent:
        a record that says its own size is read in two steps, never more than it says (the
        edit log). The default reads the whole object; backends with ranged reads read only those."""
        raw = self.read_blob(key, ANY_SIZE)
        return None if raw is None else raw[:nbytes]

    @abstractmethod
    def write_blob(self, key: str, data: bytes) -> None:
        """Write a small side object atomically (temp file + rename on disk, one PUT remotely):
        readers see the old or the new bytes, never a mix."""

    @abstractmethod
    def delete_blobs(self, prefix: str) -> None:
        """Delete every side object whose key starts with ``prefix`` (empty or ending in ``/``),
        and nothing outside this buffer's location."""

    @abstractmethod
    def list_blobs(self, prefix: str) -> list[str]:
        """Sorted keys of the side objects starting with ``prefix`` (empty or ending in ``/``);
        keys of a temp file a write has not yet renamed into place are never listed."""

    def _refuse_erasing_a_newer_format(self, config: Mapping[str, Any] | None) -> None:
        """NewerFormatError (a ValueError) where the stored ``config`` (None: no buffer) is of a format newer than
        this replaybuf reads: ``overwrite=True`` (the default) erased a buffer it could not even
        open, which a newer release wrote. For the backends' ``check_creatable``."""
        version = None if config is None else config.get("version")
        newest = self.newest_format_version
        if isinstance(version, int) and not isinstance(version, bool) and version > newest:
            raise NewerFormatError(
                f"buffer at {self.location!r} has format version {version}; this replaybuf reads formats up "
                f"to {newest} and does not erase a buffer it cannot read (overwrite=True): install a newer "
                "replaybuf (`pip install --upgrade replaybuf`), or delete the buffer yourself. Nothing was written"
            )

    def _schema_from_config(self, config: dict, where: str) -> Schema:
        """The Schema stored in ``config`` (read from ``where``), checked as a new one would be
        (sizes included), after its format ``version``: an int, at least 1 (every release wrote
        one) and at most ``newest_format_version`` (what this replaybuf reads), kept as
        ``format_version``. A version missing or below 1 is damage: read as a format before
        checksums, the buffer's checks would be skipped and its checksums read as damaged. For
        the backends' ``open``."""
        version = config.get("version")
        newest = self.newest_format_version
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            stored = f"{version!r}" if "version" in config else "missing (key 'version')"
            raise BufferDamagedError(
                f"{where}: format version is {stored}, expected an int from 1 to {newest}: the config was "
                "damaged or edited; restore its version"
            )
        if version > newest:
            raise NewerFormatError(
                f"buffer at {self.location!r} has format version {version}; "
                f"this replaybuf reads formats up to {newest}: install a newer replaybuf "
                "(`pip install --upgrade replaybuf`) to open it; `replaybuf upgrade` only rewrites earlier formats"
            )
        self.format_version = version
        self.meta_sums_as_earlier = False  # until ``metasums.settle`` finds otherwise
        try:
            return Schema.from_json(config)
        except (KeyError, TypeError, ValueError) as e:
            detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise BufferDamagedError(f"{where}: invalid buffer config: {detail}") from None

    def _array_named(self, arrays: Mapping[tuple[str, bool], _ArrayT], name: str, meta: bool) -> _ArrayT:
        """``arrays[name, meta]`` (a backend's ``array``), an ``AbsentMeta`` for an
        ``OPTIONAL_META`` array the buffer lacks or an ``UNKEPT_META`` one of an earlier format, or KeyError naming the array and the buffer."""
        try:
            return arrays[name, meta]
        except KeyError:
            absent = {**OPTIONAL_META, **({} if self.keeps_meta_sums else UNKEPT_META)}
            if meta and name in absent and ("episode_lens", True) in arrays:
                lens: Any = arrays["episode_lens", True]
                return AbsentMeta(name, lens.shape, absent[name], self.location)  # type: ignore[return-value]
            raise KeyError(f"no {'meta ' if meta else ''}array {name!r} in {self.location!r}") from None

    # ---- counters ---------------------------------------------------------------------

    def load_state(self) -> dict:
        """The last committed counters (num_episodes, episode_index, total_episodes, and any
        other keys the writer committed), read from the store now."""
        raw = self.read_blob(STATE_KEY)
        if raw is None:
            return empty_state()
        where = self.describe_key(STATE_KEY)
        state = parse_json(raw, where)
        missing = [key for key in COUNTERS if key not in state]
        if missing:  # every commit writes all of them: a missing one is damage, not a zero
            raise BufferDamagedError(f"{where}: missing {', '.join(missing)}")
        # a flipped byte in a key makes it unknown (the crc32c's included), in a value the
        # crc32c fails; an earlier format's counters keep none (one left there is not checked:
        # an earlier release may have committed counters since, keeping it as it was)
        unknown = sorted(set(state) - STATE_KEYS)
        if unknown:
            raise BufferDamagedError(f"{where}: unknown keys {unknown} (damaged, or not written by replaybuf)")
        crc = state.pop(STATE_CHECKSUM, None)
        from ._codecs import crc32c

        if self.keeps_meta_sums and crc != crc32c(state_body(state)):
            held = "hold no crc32c" if crc is None else f"do not match their crc32c {crc!r}"
            raise BufferDamagedError(
                f"{where}: the counters {held} (damaged); deleting the file makes a writable open count them "
                "again from the published episodes"
            )
        return state

    def commit_state(self, state: dict) -> None:
        """Publish the counters as one atomic object: the last step of every commit. Rows and
        meta written before the call are visible to a reader that loads these counters. A
        format that keeps meta checksums stores their crc32c with them."""
        self._check_writable()
        from ._codecs import crc32c

        plain = {k: v for k, v in state.items() if k != STATE_CHECKSUM}
        sealed = {**plain, STATE_CHECKSUM: crc32c(state_body(plain))} if self.keeps_meta_sums else plain
        self.write_blob(STATE_KEY, json.dumps(sealed, sort_keys=True).encode())

    def mark_writing(self, slots: Iterable[int]) -> None:
        """Record the slots whose rows the writer is about to write in place, before
        publishing them: rows a writer killed meanwhile leaves there are zeroed past the next
        episode's end by the next writable open (``Committer.recover``). The record replaces
        the last one and is checksummed (``writing_slots`` tells a torn one), so a backend may
        write it in place: on local disk a counters commit (a temp file and a rename) cost
        1-3 ms here, as much as a short episode's whole commit."""
        self._check_writable()
        body = json.dumps(sorted({int(slot) for slot in slots})).encode()
        self.write_record(WRITING_KEY, _checked(body))

    def writing_slots(self) -> list[int] | None:
        """The slots of the last ``mark_writing`` ([] when there is none), or None when the
        record is damaged (a writer killed while writing it) or larger than any record."""
        try:
            raw = self.read_blob(WRITING_KEY)
        except BufferDamagedError:  # over MAX_DOCUMENT_BYTES: no record this writer wrote
            return None
        if raw is None:
            return []
        body = _unchecked(raw)
        try:
            slots = json.loads(body) if body is not None else None
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            return None
        if not isinstance(slots, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in slots):
            return None
        return slots

    def write_record(self, key: str, data: bytes | memoryview) -> None:
        """Write a small side object the writer alone reads back, and checks itself: it need
        not be atomic. The default is ``write_blob``; local backends write it in place."""
        self.write_blob(key, bytes(data))

    # ---- step log: the durability of episodes in progress --------------------------------

    def append_log(self, name: str, data: bytes) -> None:
        """Append bytes to the step log ``name``. Backends with real appends override this;
        the default writes one numbered segment object per call."""
        self._check_writable()
        index = len(self.list_blobs(f"{LOG_PREFIX}{name}/"))
        self.write_blob(f"{LOG_PREFIX}{name}/{index:010d}", data)

    def read_log(self, name: str) -> bytes:
        """Everything appended to the step log ``name`` since it was last cleared, read whole
        (recovery reads it in bounded pieces: ``log_pieces``)."""
        return b"".join(self.read_blob(k, ANY_SIZE) or b"" for k in self.list_blobs(f"{LOG_PREFIX}{name}/"))

    def log_pieces(self, name: str, limit: int) -> Iterator[bytes]:
        """The bytes of the step log ``name`` in order, in pieces: here each segment whole, one
        at a time, and BufferDamagedError naming a segment over ``limit`` bytes, judged by its
        size before it is read (a damaged or planted multi-GB object is never fetched).
        Backends that append to one file read it in bounded pieces instead."""
        for key in self.list_blobs(f"{LOG_PREFIX}{name}/"):
            yield self.read_blob(key, limit) or b""

    def log_names(self) -> list[str]:
        """Names of the step logs left in the store (by writers that did not finish)."""
        return sorted({k[len(LOG_PREFIX) :].split("/")[0] for k in self.list_blobs(LOG_PREFIX)})

    def clear_log(self, name: str) -> None:
        """Delete the step log ``name`` (after its episodes were committed or abandoned)."""
        self._check_writable()
        self.delete_blobs(f"{LOG_PREFIX}{name}/")

    def copy_log_aside(self, name: str, keep: int, limit: int) -> tuple[str, int | None]:
        """Copy the first ``keep`` bytes of the step log ``name`` (read as ``log_pieces`` with
        ``limit``) to ``replaybuf/steplog-damaged-<UTC time>-<pid>/<name>``, out of recovery's
        way: a damaged log is kept for inspection. Returns that key and the bytes left out
        (``log_size``, unread: a log of absurd size is neither copied nor read whole; a
        segment refused by its size is left out with what follows), None when the store cannot
        tell them and the copy may have left some out."""
        self._check_writable()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        key = f"{LOG_PREFIX.rstrip('/')}-damaged-{stamp}-{os.getpid()}/{name}"
        kept: list[bytes] = []
        size, more = 0, False  # more: bytes past the copy, unless the store tells how many
        pieces = self.log_pieces(name, limit)
        try:
            for piece in pieces:
                kept.append(piece[: keep - size])
                size += len(kept[-1])
                if size == keep:
                    more = len(piece) > len(kept[-1]) or any(pieces)
                    break
        except BufferDamagedError:  # a segment over the limit (the damage reported names it)
            more = True
        self.write_blob(key, b"".join(kept))
        total = self.log_size(name)
        if total is None:
            return key, None if more else 0
        return key, max(total - size, 0)

    def log_size(self, name: str) -> int | None:
        """The bytes of the step log ``name``, as the store tells them (not read); None where
        it cannot tell them without reading the log (the default's segments)."""
        return None

    # ---- batched reads and writes ----------------------------------------------------------

    def time_chunk(self, name: str) -> int:
        """Timesteps per storage chunk of data field ``name`` (1 <= it <= max_timesteps):
        staging writes whole chunks, the cheapest writes; any other span is allowed."""
        return 1

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        """Write ``values`` (len(episodes), T, *shape) into ``data/name[episodes, t0:t0+T]``.

        Any ``t0`` and span (steps outside it keep their values), episodes in any order. The
        buffer calls this only for slots no reader trusts (new or invalidated), so a backend
        may write in place instead of atomically."""
        self._check_writable()
        array = self.array(name)
        for row, episode in enumerate(np.asarray(episodes)):
            array[int(episode), t0 : t0 + values.shape[1]] = values[row]

    def write_tail_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray, end: int) -> None:
        """``write_rows`` of the last rows of episodes being committed: steps ``end`` and later
        of ``values`` (up to ``t0 + T``) are padding, zeros, which a backend may leave unstored
        where unstored steps read as zeros (a zarr shard then holds only the episode's frames,
        whatever ``max_timesteps``)."""
        self.write_rows(name, episodes, t0, values)

    def check_room(self, names: Sequence[str], steps: int, what: str) -> None:
        """Refuse, before anything of it is written, a write of ``steps`` steps of each data
        field in ``names`` (an in-place edit, a whole episode) that the disk may have no room
        for: one cut short there would leave some rows written and others not, or a reused
        slot's old episode gone with no new one. StorageError naming the location, ``what``,
        the bytes the write may take and those free. The default checks nothing (stores that
        write in place into reserved files, or off local disk)."""

    def update_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        """``write_rows`` into committed episodes, in place and without a new generation (the
        buffer's ``update``, ``store_datapoint`` and ``data[...] = ...``): a reader may see the
        edit half applied, and copies keyed by generation keep the old rows. Backends that keep
        per-episode checksums recompute those of the committed episodes touched."""
        self.write_rows(name, episodes, t0, values)

    def update_steps(self, name: str, episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray) -> None:
        """``data/name[episodes[i], timesteps[i]] = values[i]`` for every i (values (N, *shape)),
        in place in committed episodes as ``update_rows`` (a pair given twice: its last value;
        no pairs: nothing): the per-step write-back of prioritized replay. Backends with a
        faster path override ``_update_steps``."""
        self._check_writable()
        episodes, timesteps = np.asarray(episodes, np.int64).reshape(-1), np.asarray(timesteps, np.int64).reshape(-1)
        if len(episodes):
            self._update_steps(name, episodes, timesteps, np.asarray(values))

    def _update_steps(self, name: str, episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray) -> None:
        """``update_steps`` with at least one pair, as int64 arrays; the default rewrites the
        touched rows through their last step touched."""
        slots, rows = edited_rows(
            lambda slots, steps: self.read_rows(name, slots, 0, steps), episodes, timesteps, values
        )
        self.update_rows(name, slots, 0, rows)

    def reseal(self, episodes: np.ndarray, lengths: np.ndarray, names: list[str] | None = None) -> None:
        """Recompute the per-episode checksums of ``episodes`` committed at ``lengths`` from their
        rows as stored, of the data fields ``names`` (None: all): a writer killed in an in-place
        edit of them may have died between rows and checksums (``Committer.finish_edits``), or
        ``verify --repair`` re-seals damaged checksum entries. Backends without such checksums
        do nothing (the default)."""

    def excess_bookkeeping(self, trim: bool = False) -> list[str]:
        """One line per bookkeeping file of the backend holding more bytes than the config gives
        it (naming it, its size and the size expected): reads take only the bytes expected, so
        the excess is a finding of ``verify`` and costs no episode; ``trim``: the file is cut to
        that size (``verify --repair``) and the lines say so. Backends without such files find
        none (the default)."""
        return []

    def lengths_matching(self, name: str, slot: int) -> list[int] | None:
        """The lengths at which ``slot``'s stored steps of data field ``name`` match what its
        stored checksums say (one read of the field's row: the repair path only), or None where
        they do not tell (no checksum kept, or one that does not depend on the length):
        ``verify --repair`` restores a lost length from them."""
        return None

    def reseal_chunks(self, name: str, slots: np.ndarray, write: bool = True) -> dict[int, list[str]]:
        """Per slot of ``slots``, where the stored chunks of data field ``name`` lie whose own
        checksum alone is damaged (``ChunkChecksumError``), each re-sealed in place from its bytes
        as stored (``write``: replaced whole, atomically) or only found (``write=False``, for
        ``verify``); a chunk damaged otherwise raises CorruptChunkError. Backends whose chunks
        carry no checksum of their own find none (the default)."""
        return {}

    def plan_generations(self, episodes: np.ndarray, generations: np.ndarray) -> None:
        """The generations ``episodes``' slots will publish, given before their data is written
        (commit step 2, ``convert``'s copies): a backend that binds each written object to its
        episode (zarr format 7: ``_shards.ShardBinding``) binds the slot's objects to it, until
        the slot's ``_generation`` is written (published or cleared); without a plan, to the
        generation the slot holds (an in-place edit). The default binds nothing."""

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` (len(episodes), *shape) into ``meta/name[episodes]``, episodes in any
        order; each element in place (``episode_lens`` and ``_generation`` publish a slot)."""
        self._check_writable()
        episodes = np.asarray(episodes)
        order = np.argsort(episodes)
        self.array(name, meta=True)[episodes[order]] = np.asarray(values)[order]

    def read_rows(
        self, name: str, episodes: np.ndarray, t0: int, t1: int, generations: np.ndarray | None = None
    ) -> np.ndarray:
        """``data/name[episodes, t0:t1]`` as one array (len(episodes), t1 - t0, *shape); episodes
        unsorted or repeated, ``t0 == t1`` allowed. ``generations``: one per episode (see the
        module docstring)."""
        array = self.array(name)
        return np.stack([np.asarray(array[int(e), t0:t1]) for e in np.asarray(episodes)])

    def read_spans(
        self,
        name: str,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: np.ndarray,
        parallel: bool = True,
        generations: np.ndarray | None = None,
    ) -> None:
        """Steps ``starts[i] .. starts[i] + lengths[i]`` of episode ``episodes[i]`` into
        ``out[i, :lengths[i]]`` (the rest of ``out`` untouched): whole-episode reads for
        get_all_data, stats and trajectory batches. ``parallel=False``: decode in the calling
        thread (the caller runs one task per core). ``generations``: one per episode (see the
        module docstring). Backends with a bulk path override ``_read_spans``."""
        self._read_spans(name, Spans.of(episodes, starts, lengths), out, parallel, generations)

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        """``read_spans`` with its spans converted once (``Spans``); the default reads through ``read_rows``."""
        read_spans_by_rows(self, name, spans, out)

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        """``data/name[episodes[i], timesteps[i]]`` for every i, as one array (N, *shape): the
        per-step read of sampling; pairs unsorted or repeated. ``generations``: one per pair
        (see the module docstring)."""
        episodes, timesteps = np.asarray(episodes), np.asarray(timesteps)
        array = self.array(name)
        out = np.empty((len(episodes), *array.shape[2:]), dtype=array.dtype)
        for episode in np.unique(episodes):
            rows = np.flatnonzero(episodes == episode)
            lo, hi = int(timesteps[rows].min()), int(timesteps[rows].max()) + 1
            out[rows] = np.asarray(array[int(episode), lo:hi])[timesteps[rows] - lo]
        return out

    def preload(self, name: str, episodes: np.ndarray, generations: np.ndarray) -> None:
        """A hint: rows of data field ``name`` of ``episodes`` at ``generations`` are about to be
        read many times (a dataset's snapshot). A backend may load them now into memory that
        forked DataLoader workers share (the zarr backend does for small fields); reads stay
        correct whether it does or not. The default does nothing."""

    def read_meta(self, name: str) -> np.ndarray:
        """The whole per-episode array ``meta/name`` in RAM, as a copy.
        ``episode_lens`` is int32, ``_generation`` int64 (see ``bookkeeping_fields``)."""
        return np.asarray(self.array(name, meta=True)[:])

    # ---- the writer lease: one writer per buffer ------------------------------------------------

    def writer_lease(self) -> WriterLease:
        """A new lease guarding writes to this buffer: a lock file in the buffer's folder by
        default; backends on object stores override this."""
        return FileLease(os.path.abspath(self.location.removeprefix("file://")))

    def acquire_writer(self, break_lock: bool = False, erase: bool = False) -> None:
        """Take the writer lease (before erasing or writing anything), or raise
        BufferLockedError naming its holder; opens in one process share it unless one will
        ``erase`` the buffer, which replaces the buffer for the earlier opens: they may no
        longer write (``lease.take``). It is released by ``release_writer``, or when this
        object is garbage collected or the interpreter exits."""
        if self._lease is not None:
            return
        lease = take_lease(self.writer_lease(), break_lock, erase)
        self._lease, self._lease_finalizer = lease, weakref.finalize(self, give_back_dropped, lease)
        # at exit the lease module releases it in this thread; this would hand it to a daemon thread
        self._lease_finalizer.atexit = False
        self._lease_epoch = lease.epoch

    @property
    def held_lease(self) -> WriterLease | None:
        """The writer lease this open holds, None when none or when a later ``overwrite=True``
        open in this process erased the buffer it wrote to."""
        return self._lease if self._lease is not None and self._lease.epoch == self._lease_epoch else None

    def writer_stopped(self) -> bool:
        """Whether a writer stopped without giving the lease back (killed), leaving what it was
        doing half done: the lease's record is left and nobody holds it, or (while this open
        holds the lease) taking it found such a record."""
        if self._lease is not None:
            return self._lease.inherited
        return self.writer_lease().stopped()

    @property
    def writer_shared(self) -> bool:
        """Whether another open in this process shares this one's writer lease (``lease.take``)."""
        return self._lease is not None and self._lease._users > 1

    def release_writer(self) -> None:
        """Give the writer lease back (a no-op when not held)."""
        if self._lease_finalizer is not None:
            self._lease_finalizer.detach()
        if self._lease is not None:
            give_back_lease(self._lease)
        self._lease = self._lease_finalizer = None

    def __getstate__(self) -> dict:
        """A pickled storage (sent to a DataLoader worker) carries no lease."""
        return {**self.__dict__, "_lease": None, "_lease_finalizer": None}

    @property
    def checks_whole_episodes(self) -> bool:
        """Whether only whole-episode reads (``read_rows``/``read_spans`` from step 0) are checked
        against a stored checksum, per-step ``gather`` not: readers of whole episodes then take
        the bulk path however short they are. False where every read is checked (zarr's chunk
        crc32c) or none is."""
        return False

    def verifies_reads(self, names: Iterable[str]) -> bool:
        """Whether reads of the data fields ``names`` given ``generations`` return only rows of
        those generations, else raise GenerationMismatchError (see "Generations"): callers of
        such reads skip their own re-check. ``verifies_generations`` unless a backend verifies
        some fields only."""
        del names
        return self.verifies_generations

    def verifies_gathers(self, names: Iterable[str]) -> bool:
        """``verifies_reads`` for ``gather`` alone (what timestep and short-window batches
        read): the zarr backend verifies every gather given generations. The default:
        ``verifies_reads``."""
        return self.verifies_reads(names)

    def stored_uuid(self) -> str | None:
        """The uuid of the config stored at the location now, read afresh (None: no config with a
        uuid, or the backend cannot tell): a read cache checks with it that the buffer it caches
        was not replaced. The default: None."""
        return None

    def unstored_meta_slots(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose row of meta ``name`` is not stored at all (it reads as 0): a
        lost chunk, where per-episode arrays are stored in chunks. The default: none (one file)."""
        del name, slots
        return np.zeros(0, np.int64)

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        """``meta/name[episodes]`` read from the store now, only those entries (what a reader
        re-checks after each read, see ``consistency.py``); never served from a cache."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        if len(episodes) == 0:
            return self.read_meta(name)[:0]
        # one slice over the entries' range: the backends' fast path (a fancy index over a zarr
        # array took 16x longer than reading its whole 1,000 entries)
        lo, hi = int(episodes.min()), int(episodes.max()) + 1
        return np.asarray(self.array(name, meta=True)[lo:hi])[episodes - lo]

    # ---- the hot tier --------------------------------------------------------------------------

    def start_hot_tier(self, hot_bytes: int, generations: np.ndarray) -> None:
        """A writer's hot tier, for backends that have one (``storage/_hot.py``): recent episodes
        of image fields stored raw and compacted in the background once their bytes exceed
        ``hot_bytes`` (0: written compressed); ``generations``: the published generation of
        every slot now. Also compacts what a killed writer left hot. A no-op elsewhere."""

    def compact(self) -> CompactionSummary:
        """Compact every hot episode now and return what was done (nothing where the backend
        has no hot tier)."""
        return CompactionSummary()

    def hot_shards(self, slots: np.ndarray) -> dict[int, int]:
        """The slots among ``slots`` with a data shard still stored hot (not compacted), and
        those shards' bytes (``replaybuf info``); none where the backend has no hot tier."""
        return {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Make written data durable as far as the backend can (a no-op for most)."""

    def drop_caches(self) -> None:
        """Forget decoded chunks and open files this process keeps for reading, so the next
        reads see what writers elsewhere changed (a no-op where reads are never cached)."""

    def drop_cached_rows(self, name: str, slots: np.ndarray) -> None:
        """Forget what this process keeps of data field ``name``'s rows in ``slots`` (decoded
        chunks, shard indexes, open files, maps), so their next read reads them as stored now:
        those copies are keyed by generation, which an in-place edit elsewhere keeps (the read
        cache's fill, ``CachedStorage``, at a revision newer than the copies). A no-op where
        reads are never cached."""

    def warn_ignored_options(self) -> None:
        """Warn of ``storage_options`` that an open of an existing buffer does not apply (the
        stored settings win); called once per buffer a user opens, after ``open``."""

    def fresh(self) -> Storage:
        """A new, unopened object for the same location and settings."""
        return type(self)(self.location, self.storage_options, fsync=self.fsync)

    def published_generations(self) -> int:
        """The highest generation the buffer stored here may have published: its counters'
        ``total_episodes``, or a larger ``_generation`` a writer killed before writing its
        counters left (what an overwrite counts on from). Read through a read-only open of a
        new object of this class (this one is not opened); raises what that open or read
        raises (a damaged buffer, an erase cut short)."""
        other = self.fresh()
        other.open(read_only=True)
        try:
            total = int(other.load_state()["total_episodes"])
            return max(total, int(np.max(other.read_meta("_generation"), initial=0)))
        finally:
            other.close()

    def replaced(self, cheap_only: bool = False) -> bool:
        """Whether the buffer at the location is no longer the one this storage opened
        read-only: another process created a new buffer there (``overwrite=True``) or upgraded
        it since, so what this storage holds (maps, open files, the planned episodes) is of a
        buffer that is gone. ``cheap_only``: answer only where it costs at most a stat (else
        False). The default, for a backend without a way to tell: never."""
        del cheap_only
        return False

    @property
    def is_local(self) -> bool:
        """The buffer is a folder on this machine written with plain file I/O (False for object
        stores and ``memory://``, whose writes run on an event loop and a thread pool)."""
        return True

    def close(self) -> None:
        """Release handles (flushing a writer's data first); the object stays usable and
        reopens what it needs on the next call."""

    def describe(self) -> dict:
        """Backend facts for ``replaybuf info``: chunking, compressor, stored vs raw bytes."""
        return {"backend": self.backend_name, "location": self.location}

    def links(self) -> list[str]:
        """Symbolic links inside the buffer's folder, which a writable open refuses (``verify``
        reports them); none for stores without links."""
        return []

    def writable_open_refusals(self) -> list[str]:
        """Damage a writable open refuses but a read-only open, which never reads it, lets
        pass (``verify`` reports it); none for most backends."""
        return []

    def describe_key(self, key: str) -> str:
        """``key`` and the buffer it belongs to, for error messages."""
        return f"{key} in {self.location}"

    def _check_writable(self) -> None:
        if self.read_only:
            raise PermissionError(f"buffer at {self.location!r} was opened read-only; writing is not allowed")
        if self._lease is not None:
            self._lease.check_held()
        self.check_lease_current()

    def check_lease_current(self) -> None:
        """BufferLockedError where this storage's writer lease was taken over, or where a later
        ``overwrite=True`` open in this process erased the buffer it wrote to; checked before a
        write's own checks, which would answer from the erased buffer's counters ("full")."""
        if self._lease is not None and self._lease.lost is not None:
            raise BufferLockedError(f"cannot write to {self.location!r}: {self._lease.lost}")
        if self._lease is not None and self._lease.epoch != self._lease_epoch:
            raise BufferLockedError(
                f"cannot write to {self.location!r}: a later open of it with overwrite=True in this process "
                "erased the buffer this object wrote to; write through that newer object"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"


# ---- registry -----------------------------------------------------------------------------

_registry: dict[str, tuple[str, str]] = {
    "zarr": ("replaybuf.storage._zarr:ZarrStorage", "zarr is a core dependency; reinstall replaybuf"),
    "memmap": ("replaybuf.storage._memmap:MemmapStorage", "reinstall replaybuf"),
    "hdf5": ("replaybuf.storage._hdf5:HDF5Storage", "install h5py: pip install 'replaybuf[h5py]'"),
}


class _Registry(Mapping[str, tuple[str, str]]):
    """The registered backends, name -> ("module:Class", install hint), read-only: those of
    installed packages' entry points included, read on first use (``_load_entry_points``)."""

    def __getitem__(self, name: str) -> tuple[str, str]:
        _load_entry_points()
        return _registry[name]

    def __iter__(self) -> Iterator[str]:
        _load_entry_points()
        return iter(dict(_registry))

    def __len__(self) -> int:
        _load_entry_points()
        return len(_registry)


registry = _Registry()
# a file whose presence in a local folder says which backend wrote it, known without importing
# the backend: a buffer of a backend that cannot be imported is named, not reported missing
_markers: dict[str, str] = {"hdf5": "data.h5"}


# the entry-point group a package names its backends in (``name = "module:Class"``), so that
# every process finds them (the ``replaybuf`` command, spawned workers), not only the one that
# called ``register_backend``
ENTRY_POINT_GROUP = "replaybuf.backends"
_entry_points_loaded = False


def _load_entry_points() -> None:
    """Register the backends installed packages name in ``ENTRY_POINT_GROUP``, once per process
    (on the first lookup, not at import: reading every package's metadata takes milliseconds).
    A name already registered keeps its backend: a built-in one, or one this process registered,
    which wins over what a package says. Importing the class waits for ``backend_class``."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in _registry:
            continue
        package = point.dist.name if point.dist is not None else "the package naming it"
        _registry[point.name] = (point.value, f"reinstall {package} (its entry point {point.name} = {point.value})")
    _entry_points_loaded = True  # after: a thread looking up meanwhile reads them too, never a partial registry


def register_backend(
    name: str, target: str, install_hint: str = "", clobber: bool = False, marker: str | None = None
) -> None:
    """Register a backend as ``"module:Class"`` in this process; refuses to replace an existing
    name unless ``clobber``. An installed package makes its backend known to every process
    instead (the ``replaybuf`` command included) with an entry point in the group
    ``replaybuf.backends``, e.g. ``[project.entry-points."replaybuf.backends"] mine =
    "mypkg.storage:MyStorage"``. ``marker``: for a backend of local folders only, a file name inside a buffer
    folder that only this backend writes: its buffers are recognised by it without importing
    the backend (which ``detect_backend`` then imports only for a folder holding it), and the
    install hint given when it cannot be imported."""
    _load_entry_points()
    if name in _registry and not clobber:
        raise ValueError(f"backend {name!r} is already registered as {_registry[name][0]!r}")
    _registry[name] = (target, install_hint)
    _markers.pop(name, None)
    if marker is not None:
        _markers[name] = marker


def backend_class(name: str) -> type[Storage]:
    """Import and return the Storage class registered as ``name``."""
    _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_registry)}")
    target, hint = _registry[name]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"backend {name!r} is not available: {hint} ({e})") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Storage)):  # a package's entry point gone stale
        raise ImportError(f"backend {name!r} is not available: {target!r} names no Storage subclass; {hint}")
    return cls


def detect_backend(location: str, storage_options: dict | None = None) -> str | None:
    """The name of the backend whose buffer is at ``location``, or None when there is none.
    A backend registered with a marker is asked (and imported) only where a local folder holds
    its marker: opening any other buffer need not load, e.g., h5py and the HDF5 library
    (~130 ms, and exit hooks of their own). Raises ImportError with the install hint when the
    buffer there belongs to a registered backend that cannot be imported (its marker is present)."""
    _load_entry_points()
    for name in list(_registry):
        marker = _markers.get(name)
        if marker is not None and not _holds_marker(location, marker):
            continue
        try:
            cls = backend_class(name)
        except ImportError:
            if marker is not None:
                raise
            continue
        if cls.can_open(location, storage_options):
            return name
    return None


def refuse_another_backends_buffer(storage: Storage) -> None:
    """ValueError where another registered backend finds its buffer at ``storage``'s location:
    creating one there is not this backend's business (its create would erase or mix with
    files it does not own), and would make the location's backend ambiguous."""
    other = detect_backend(storage.location, storage.storage_options)
    if other is not None and other != storage.backend_name:
        raise ValueError(
            f"{storage.location!r} holds a {other!r} buffer; delete it first, or open it with backend={other!r}"
        )


def _holds_marker(location: str, marker: str) -> bool:
    """Whether ``location`` is a local folder (a path or ``file://`` URL) holding an entry named
    ``marker`` (any kind: a FIFO or a folder there is the backend's to name as damage)."""
    if location.startswith("file://"):
        location = location[len("file://") :]
    elif "://" in location:
        return False
    return os.path.lexists(os.path.join(location, marker))


def refuse_unencodable_names(schema: Schema, where: str) -> None:
    """ValueError naming the first field whose name the file system encoding cannot write, for
    the backends whose files are named by their fields (local zarr, memmap): in an ASCII or
    Latin-1 locale without Python's UTF-8 mode, a create stopped at that field's file, half
    written, and an open failed with a bare UnicodeEncodeError. Reads nothing."""
    for field in (*schema.fields.values(), *schema.meta_fields.values()):
        try:
            os.fsencode(field.name)
        except UnicodeEncodeError:
            raise ValueError(
                f"{where}: field {field.name!r} names a file, which this process's file system encoding "
                f"({sys.getfilesystemencoding()}, from the locale) cannot name; run Python in UTF-8 mode "
                "(PYTHONUTF8=1 or python -X utf8) or in a UTF-8 locale; nothing was written"
            ) from None


def is_url(location: str) -> bool:
    """Whether ``location`` names an object store or other fsspec URL, not local files
    (``file://`` paths are local)."""
    return "://" in location and not location.startswith("file://")


def missing_folder_hint(location: str) -> str:
    """The end of a "no buffer at" message for a local ``location`` that does not exist: where
    a relative path was looked for, and the names beside it close to it (a misspelt path);
    else ''."""
    local = location.removeprefix("file://")
    if "://" in local or os.path.lexists(local):
        return ""
    hint = ": there is no such folder"
    if local.startswith("~"):
        return hint + " ('~' is not expanded here: pass os.path.expanduser(path))"
    if not os.path.isabs(local):
        hint += f" (looked for in the current folder {os.getcwd()!r})"
    try:
        entries = os.listdir(os.path.dirname(os.path.abspath(local)))
    except OSError:  # its parent is missing too, or unreadable
        return hint
    near = difflib.get_close_matches(os.path.basename(os.path.normpath(local)), entries, n=3, cutoff=0.75)
    if near:
        hint += "; did you mean " + " or ".join(repr(os.path.join(os.path.dirname(local), name)) for name in near) + "?"
    return hint


#: the URL schemes of object stores (lowercase), each with the one name of its store
OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}


def object_store_url(location: str) -> str | None:
    """``location`` spelled one way when it names an object store (``S3://``, ``s3a://`` ->
    ``s3://``; ``gcs://`` -> ``gs://``; trailing slashes dropped: ``s3://b/run/`` is
    ``s3://b/run``, ``s3://b/`` is ``s3://b``: the same objects), else None."""
    scheme, separator, rest = location.partition("://")
    store = OBJECT_STORE_SCHEMES.get(scheme.lower()) if separator else None
    return None if store is None else f"{store}://{rest.rstrip('/')}"


def environment_endpoint(store: str = "s3") -> str | None:
    """The endpoint the client of ``store`` ('s3' or 'gs') takes from the environment where no
    option names one: botocore's (so s3fs's) ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``;
    gcsfs's ``STORAGE_EMULATOR_HOST`` (``http://`` when it names no scheme)."""
    if store == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator in ("", "default"):
            return None
        return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def object_store_endpoint(location: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """The server an object-store ``location`` is read from, spelled one way (scheme and host
    lowercase, no trailing ``/``): ``endpoint_url``, or ``client_kwargs['endpoint_url']``, or the
    environment's (`environment_endpoint`); None for the client's default server or another
    location. Two spellings of one endpoint name one store (``convert`` refusing to
    copy a buffer onto itself, the read cache's owner records)."""
    url = object_store_url(location)
    if url is None:
        return None
    options = storage_options or {}
    client = options.get("client_kwargs")
    endpoint = options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, Mapping) else None)
    if endpoint is None:
        endpoint = environment_endpoint(url.partition("://")[0])
    if not isinstance(endpoint, str) or not endpoint:
        return None
    parts = urlsplit(endpoint)
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def warn_local_options(location: str, storage_options: dict, backend: str) -> None:
    """Warn of ``storage_options`` given with a local folder (zarr and memmap take none there):
    silently ignored, they would hide a URL whose scheme was left out (``'bucket/run1'`` with an
    endpoint and keys becomes a local folder of that name). A warning, not an error: code that
    passes one dict to its local and remote buffers alike stays working."""
    if storage_options:
        warnings.warn(
            f"storage_options {sorted(storage_options)} were given with {location!r}, a local folder, where the "
            f"{backend} backend takes none: they are ignored. They apply to object stores (s3://..., gs://...): "
            "if a URL was meant, its scheme is missing",
            UserWarning,
            stacklevel=4,
        )


def refuse_empty_location(location: str) -> None:
    """ValueError for an empty location (``''``, ``'file://'``: an unset setting), which
    ``os.path`` reads as the current folder, one the user did not name."""
    if not location.removeprefix("file://"):
        raise ValueError(
            f"the location {location!r} is empty: it names no folder (it would be the current one, "
            f"{os.getcwd()!r}, where a buffer would be created or erased); pass '.' to mean that folder"
        )


def make_storage(
    location: str | os.PathLike | Storage,
    backend: str | None = None,
    storage_options: dict | None = None,
    **kwargs: Any,
) -> Storage:
    """Turn a path, URL or Storage into a Storage.

    - a ``Storage`` instance is returned as it is;
    - ``backend`` given: that registered backend at ``location``;
    - otherwise the backend of the buffer found at ``location`` (``detect_backend``), and
      ``'zarr'`` when there is none yet. The zarr backend takes local paths and any URL
      (``memory://``, ``s3://``, ``gs://``, other fsspec protocols).
    """
    if isinstance(location, Storage):
        return location
    if not isinstance(location, str | bytes | os.PathLike):  # os.fspath names neither the argument nor a path
        raise TypeError(
            f"the location must be a folder path or URL (a str or os.PathLike), got {type(location).__name__} "
            f"{location!r}"
        )
    location = os.fspath(location)
    if not isinstance(location, str):  # bytes: every path and URL here is handled as text
        raise TypeError(f"the location must be a str or os.PathLike of str, got bytes {location!r}; decode it first")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"storage_options must be a dict of options (or None), got {type(storage_options).__name__} "
            f"{storage_options!r}"
        )
    refuse_empty_location(location)
    local = location.removeprefix("file://")
    if "://" not in local and os.path.lexists(local) and not os.path.isdir(local):
        what = "a dangling or looping link" if os.path.islink(local) and not os.path.exists(local) else "a file"
        raise NotADirectoryError(
            f"{location!r} is {what}, not a folder: a buffer is stored as a folder "
            "(pass a new or empty folder to create one, or the folder of an existing buffer)"
        )
    if "://" not in local:  # a folder under a file can never be made
        parent = os.path.dirname(os.path.abspath(local))
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise NotADirectoryError(
                f"{location!r} cannot be a folder: {parent!r} above it is a file (or a link to none), not a folder"
            )
    if backend is None:
        try:
            backend = detect_backend(location, storage_options) or "zarr"
        except PermissionError as error:  # named the marker file of whichever backend was asked first
            raise PermissionError(
                error.errno,
                f"cannot read {location!r}: {error.strerror} ({error.filename}); a buffer's folder and files "
                "must be readable to open it",
            ) from None
    return backend_class(backend)(location, storage_options, **kwargs)


def _checked(body: bytes) -> bytes:
    """``body`` behind its crc32c and length (4 bytes each, little-endian)."""
    from ._codecs import crc32c

    return crc32c(body).to_bytes(4, "little") + len(body).to_bytes(4, "little") + body


def _unchecked(record: bytes) -> bytes | None:
    """The body of a ``_checked`` record (bytes after it ignored), None when it fails its check."""
    from ._codecs import crc32c

    size = int.from_bytes(record[4:8], "little")
    body = record[8 : 8 + size]
    if len(record) < 8 or len(body) != size or crc32c(body) != int.from_bytes(record[:4], "little"):
        return None
    return body
