"""Named snapshots: a recorded set of committed episodes that a reader opens later, exactly.

``buffer.snapshot(name)`` writes ``replaybuf/snapshots/<name>/snapshot.json`` through the
Storage blob API (one atomic write: a killed writer leaves it absent or whole; the same on every
backend and object store; JSON, no pickle): the slots of the committed episodes, their
generations and lengths, and the counters. A snapshot *holds* its episodes: the writer's commit
protocol (``Committer.new_group`` and ``Committer.invalidate``) refuses to reuse a slot whose
episode a snapshot holds, before anything is written, unless the buffer was opened with
``drop_snapshots_on_overwrite=True`` (the snapshots holding the slot are then dropped, with a
warning, just before the slot is invalidated).

``ReplayBuffer.from_folder(path, snapshot=name)`` is a read-only view whose bookkeeping mirror
shows only the snapshot's episodes and its counters (``view``), so every read path (loaders,
``get_all_data``, ``stats``, ``data[...]``) reads exactly that set, whatever the writer
appended since. Snapshots pin which episodes exist, not their values: ``update()`` and meta
writes still change a held episode in place.

Only the writer (the lease holder) creates or drops snapshots: it keeps the held episodes in
RAM, so a snapshot written by another process while it writes would not be honored.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .inputs import fill_value
from .schema import Schema
from .storage import SNAPSHOTS_PREFIX, BufferDamagedError, check_state, document_limit, empty_state
from .storage.base import Storage

PREFIX = SNAPSHOTS_PREFIX
FORMAT = 1
MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class SnapshotError(ValueError):
    """A snapshot is missing, damaged, misnamed, or no longer matches the buffer."""


class SnapshotHeldError(SnapshotError):
    """A write would overwrite (or unpublish) an episode a snapshot holds; nothing was written."""


@dataclass(frozen=True)
class Snapshot:
    """A recorded episode set: ``slots`` (ascending) with their ``generations`` and ``lengths``,
    and the counters (``num_episodes``, ``episode_index``, ``total_episodes``) at the time."""

    name: str
    slots: np.ndarray
    generations: np.ndarray
    lengths: np.ndarray
    state: dict[str, int]
    created: float


def check_name(name: Any) -> str:
    """``name`` if it is a valid snapshot name: letters, digits, ``.``, ``_``, ``-`` (not first),
    at most ``MAX_NAME`` characters; no path separators."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise SnapshotError(
            f"invalid snapshot name {name!r}: expected 1 to {MAX_NAME} letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit; no path separators)"
        )
    return name


def key(name: str) -> str:
    """The blob key of snapshot ``name``."""
    return f"{PREFIX}{check_name(name)}/snapshot.json"


def max_bytes(schema: Schema) -> int:
    """The most bytes a snapshot of a buffer of ``schema`` can take: a metadata object's, and 64
    per episode it may record (its slot, generation and length as JSON ints)."""
    return document_limit() + 64 * schema.max_episodes


def exists(storage: Storage, name: str) -> bool:
    """Whether snapshot ``name`` is stored (a listing: its size does not matter)."""
    return key(name) in storage.list_blobs(f"{PREFIX}{name}/")


def names(storage: Storage) -> list[str]:
    """The names of the snapshots stored in ``storage``, sorted. A folder whose name no snapshot
    can have (``check_name``), or a ``snapshot.json`` deeper down, holds none: ``snapshot()``
    never wrote it, and it would otherwise block every overwrite with an error that no
    ``drop_snapshot`` call can clear."""
    found = {k[len(PREFIX) :].partition("/") for k in storage.list_blobs(PREFIX)}
    return sorted(n for n, _, rest in found if rest == "snapshot.json" and _NAME.fullmatch(n) and len(n) <= MAX_NAME)


def encode(snapshot: Snapshot) -> bytes:
    return json.dumps(
        {
            "format": FORMAT,
            "name": snapshot.name,
            "created": snapshot.created,
            "state": snapshot.state,
            "slots": snapshot.slots.tolist(),
            "generations": snapshot.generations.tolist(),
            "lengths": snapshot.lengths.tolist(),
        }
    ).encode()


def _int_list(doc: dict, name: str, low: int, high: int) -> np.ndarray:
    values = doc.get(name)
    if not isinstance(values, list) or not all(type(v) is int and low <= v < high for v in values):
        raise ValueError(f"{name!r} must be a list of ints in [{low}, {high})")
    return np.asarray(values, np.int64)


def decode(raw: bytes, name: str, schema: Schema, where: str) -> Snapshot:
    """The snapshot stored as ``raw``, checked against ``schema``; ``SnapshotError`` naming
    ``where`` (the file) when it is damaged or does not fit the buffer."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"expected a JSON object with format {FORMAT}")
        if doc.get("name") != name:
            raise ValueError(f"it names snapshot {doc.get('name')!r}")
        slots = _int_list(doc, "slots", 0, schema.max_episodes)
        generations = _int_list(doc, "generations", 1, 2**63 - 1)
        lengths = _int_list(doc, "lengths", 1, schema.max_timesteps + 1)
        if not len(slots) == len(generations) == len(lengths):
            raise ValueError(
                f"slots, generations and lengths differ in size ({len(slots)}, {len(generations)}, {len(lengths)})"
            )
        if len(slots) and (np.diff(slots) <= 0).any():
            raise ValueError("slots are not distinct and ascending")
        state = doc.get("state")
        if not isinstance(state, dict) or not all(k in state for k in empty_state()):
            raise ValueError(f"'state' must hold {', '.join(empty_state())}")
        check_state(state, schema, "'state'")
        created = doc.get("created")
        if not isinstance(created, (int, float)):
            raise ValueError("'created' must be a number")
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: nested too deep
        raise SnapshotError(f"snapshot {name!r} is damaged ({where}): {error}") from None
    return Snapshot(name, slots, generations, lengths, {k: state[k] for k in empty_state()}, float(created))


def load(storage: Storage, name: str, schema: Schema) -> Snapshot:
    """Snapshot ``name`` of ``storage``; ``SnapshotError`` when it is absent (listing those that
    exist) or damaged."""
    try:
        raw = storage.read_blob(key(name), limit=max_bytes(schema))
    except BufferDamagedError as error:  # larger than any snapshot of this buffer: never read
        raise SnapshotError(f"snapshot {name!r} is damaged: {error}") from None
    if raw is None:
        raise SnapshotError(f"no snapshot {name!r} in {storage.location!r} - snapshots: {names(storage)}")
    return decode(raw, name, schema, storage.describe_key(key(name)))


def create(storage: Storage, name: str, schema: Schema, meta: dict[str, np.ndarray], state: dict) -> Snapshot:
    """Record the committed episodes of ``meta`` (the writer's mirror) and ``state`` as snapshot
    ``name`` (one atomic blob write); an existing name is refused."""
    if exists(storage, name):
        raise SnapshotError(f"snapshot {name!r} already exists in {storage.location!r}; drop_snapshot({name!r}) first")
    slots = np.flatnonzero(meta["episode_lens"] > 0)
    snapshot = Snapshot(
        name,
        slots,
        meta["_generation"][slots].astype(np.int64),
        meta["episode_lens"][slots].astype(np.int64),
        {k: int(state[k]) for k in ("num_episodes", "episode_index", "total_episodes")},
        time.time(),
    )
    storage.write_blob(key(name), encode(snapshot))
    return snapshot


def drop(storage: Storage, name: str) -> None:
    """Delete snapshot ``name``; ``SnapshotError`` when there is none (damaged ones included)."""
    if not exists(storage, name):
        raise SnapshotError(f"no snapshot {name!r} in {storage.location!r} - snapshots: {names(storage)}")
    storage.delete_blobs(f"{PREFIX}{name}/")


def holding(storage: Storage) -> list[str]:
    """The snapshots of ``storage`` that record at least one episode (a damaged one counts), read
    without the buffer's schema: what ``overwrite=True`` would erase from under them."""
    found = []
    for name in names(storage):
        try:  # one over MAX_DOCUMENT_BYTES (BufferDamagedError, unread) counts as damaged
            doc = json.loads(storage.read_blob(key(name)) or b"{}")
            held = not isinstance(doc, dict) or not isinstance(doc.get("slots"), list) or len(doc["slots"]) > 0
        except (ValueError, UnicodeDecodeError, RecursionError):
            held = True
        if held:
            found.append(name)
    return found


def check_overwrite(storage: Storage, drop: bool) -> list[str]:
    """Before ``overwrite=True`` erases a buffer: refuse (``SnapshotHeldError``) when snapshots
    hold some of its episodes, unless ``drop`` (``drop_snapshots_on_overwrite=True``); returns
    those snapshots (for ``warn_dropped``)."""
    held = holding(storage)
    if held and not drop:
        raise SnapshotHeldError(
            f"overwrite=True would erase the episodes of {storage.location!r} held by snapshot(s) {held}; "
            "nothing was written - reopen it with overwrite=False (or from_folder), drop_snapshot() them first, "
            "or pass drop_snapshots_on_overwrite=True"
        )
    return held


def warn_dropped(location: str, held: list[str]) -> None:
    """Warn that ``overwrite=True`` with ``drop_snapshots_on_overwrite=True`` erased the ``held``
    snapshots with the episodes they recorded (the storage erases every snapshot on create)."""
    if held:
        warnings.warn(
            f"snapshot(s) {held} of {location!r} dropped: overwrite=True erased the episodes they held "
            "(drop_snapshots_on_overwrite=True)",
            stacklevel=3,
        )


def held_episodes(storage: Storage, schema: Schema) -> dict[int, tuple[int, list[str]]]:
    """slot -> (generation, names of the snapshots holding that episode), over every snapshot."""
    held: dict[int, tuple[int, list[str]]] = {}
    for name in names(storage):
        snapshot = load(storage, name, schema)
        for slot, generation in zip(snapshot.slots.tolist(), snapshot.generations.tolist()):
            known = held.get(slot)
            # snapshots may record different episodes of a slot: only its latest can be overwritten
            if known is None or known[0] < generation:
                held[slot] = (generation, [name])
            elif known[0] == generation:
                known[1].append(name)
    return held


def view(
    snapshot: Snapshot, schema: Schema, meta: dict[str, np.ndarray], storage: Storage
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(bookkeeping mirror, counters) showing only ``snapshot``'s episodes, from ``meta`` as just
    loaded: other slots are empty, with their meta fields at the defaults. ``SnapshotError`` when
    a recorded episode is no longer in its slot; ``BufferDamagedError`` when it is but with
    another length (a committed episode's length never changes: the stored length or the
    snapshot's record is damaged)."""
    where = repr(storage.location)
    generations, lengths = meta["_generation"][snapshot.slots], meta["episode_lens"][snapshot.slots]
    damaged = np.flatnonzero((generations == snapshot.generations) & (lengths != snapshot.lengths))
    if len(damaged):
        i = int(damaged[0])
        raise BufferDamagedError(
            f"meta/episode_lens of {where} or snapshot {snapshot.name!r} ({storage.describe_key(key(snapshot.name))}) "
            f"is damaged: slot {int(snapshot.slots[i])} holds generation {int(generations[i])} with length "
            f"{int(lengths[i])}, the snapshot recorded that episode with length {int(snapshot.lengths[i])} "
            "(a committed episode's length never changes)"
        )
    changed = np.flatnonzero(generations != snapshot.generations)
    if len(changed):
        i = int(changed[0])
        raise SnapshotError(
            f"snapshot {snapshot.name!r} of {where}: slot {int(snapshot.slots[i])} holds generation "
            f"{int(generations[i])} (length {int(lengths[i])}), the snapshot recorded generation "
            f"{int(snapshot.generations[i])} (length {int(snapshot.lengths[i])}); {len(changed)} recorded "
            "episode(s) were overwritten or dropped (by clear(), drop_episodes(), a writer opened with "
            "drop_snapshots_on_overwrite=True, or one that predates snapshots)"
        )
    others = np.ones(schema.max_episodes, bool)
    others[snapshot.slots] = False
    out = {name: values.copy() for name, values in meta.items()}
    out["episode_lens"][others] = 0
    out["_generation"][others] = 0
    for name, field in schema.meta_fields.items():
        out[name][others] = fill_value(field)
    return out, dict(snapshot.state)


class HeldEpisodes:
    """The episodes the snapshots of ``storage`` hold, as the writer's commit protocol checks
    them before it reuses, clears or drops a slot (loaded when first needed, kept in RAM)."""

    def __init__(self, storage: Storage, schema: Schema):
        self.storage, self.schema = storage, schema
        self.drop_on_overwrite = False
        self._held: dict[int, tuple[int, list[str]]] | None = None

    def reset(self) -> None:
        """Reload from storage at the next check (a snapshot was created or dropped)."""
        self._held = None

    def check(self, slots: np.ndarray, generations: np.ndarray, action: str, drop: bool = False) -> None:
        """Refuse (``SnapshotHeldError``) to ``action`` the episodes ``slots`` hold now (their
        ``generations``; 0: none) that a snapshot holds, before anything is written. With
        ``drop_on_overwrite`` the check passes, and ``drop=True`` (just before the write) deletes
        those snapshots with a warning."""
        if not np.any(generations):  # no committed episode among them: nothing to load or refuse
            return
        if self._held is None:
            self._held = held_episodes(self.storage, self.schema)
        held = self._held
        clashes = {
            slot: held[slot][1]
            for slot, generation in zip(np.asarray(slots).tolist(), np.asarray(generations).tolist())
            if slot in held and generation == held[slot][0]
        }
        if not clashes:
            return
        every = sorted({n for holders in clashes.values() for n in holders})
        slot, holders = next(iter(clashes.items()))
        if not self.drop_on_overwrite:
            raise SnapshotHeldError(
                f"cannot {action} slot {slot} of {self.storage.location!r}: its episode is held by snapshot(s) "
                f"{holders} ({len(clashes)} held slot(s) in this call, held by {every}); nothing was written - "
                "drop_snapshot() first, or open the buffer with drop_snapshots_on_overwrite=True"
            )
        if drop:
            for name in every:
                self.storage.delete_blobs(f"{PREFIX}{name}/")
            self.reset()
            warnings.warn(
                f"snapshot(s) {every} of {self.storage.location!r} dropped: {action} of slot(s) {sorted(clashes)} "
                "they held (drop_snapshots_on_overwrite=True)",
                stacklevel=6,
            )
