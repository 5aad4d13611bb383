"""The commit protocol: how episodes become visible in a Storage, and how a killed writer is
recovered.

``Committer`` owns the per-episode bookkeeping mirrored in RAM (lengths, generations, user meta
fields), the counters object and the step log, and commits every episode group (``store``,
``store_batch``, ``store_episode``, length-0 episodes, recovery) in the order that keeps every
committed episode intact through a crash:

1. a reused circular slot is invalidated first (``episode_lens = 0``, ``_generation = 0``);
2. the data slabs are written, bound to the generations step 3 publishes (zarr format 7's
   shards: ``Storage.plan_generations``; no other commit runs between a group's first write
   and its publish, so they are fixed by then);
3. the session's ``_revision`` (below), meta rows, then ``_generation`` and ``episode_lens``
   are published;
4. the counters object is committed; the step log of the episode is cleared.

Step 4 of whole episodes stored one after another (``store_episode``: length > 0, no step log)
is batched: within ``COUNTERS_INTERVAL`` seconds of the last such counters write, the counters
wait for the next write (the next episode past the interval, a commit of any other kind,
``flush()``, ``close()``); the first episode after any other commit writes them at once. Replacing the counters object (a
temp file and a rename) cost more than the rest of a short episode's commit. Nothing committed
is lost by the delay: the counters are derived from the published lengths and generations
(``reconcile_state``) when a writer opens the buffer after a kill, and a reader catches the
counters it loads up with the episodes published since (``caught_up``).

In-place edits of committed rows and meta values (``edit``) keep the generation; each is
logged whole before it is applied (``editlog.py``), so a killed writer's edit is applied again
by the next writable open, and brackets its writes with the slots' ``_revision``, odd while the
edit runs and a new random even value once done, which keys every cached copy of decoded rows with the
generation. Step 3 first gives each slot this writer session's random even revision
(``stamp_revisions``), so no two commits, nor two edits, share a (generation, revision) key even
across copies of one buffer: a folder put back from a backup and written again publishes the
generations of the episodes written after the backup, but never their revisions, so no cache of
those discarded episodes serves them. A writable open finishes the edits a killed writer left
odd (``finish_edits``). Step 3 writes each slot's
``_meta_sum`` (``metasums.py``) with its meta rows, before the generation and length (format 4
and later: ``Storage.keeps_meta_sums``).

A reader trusts only slots whose published length is > 0. ``ReplayBuffer`` validates user input
and delegates here. A commit writes no statistics sketch: the writer's first ``stats()`` stores
those of the episodes committed since (``sketches.py``), off the ``store_episode`` path.
"""

from __future__ import annotations

import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import editlog, metasums
from .editlog import Edit, Write
from .inputs import fill_value
from .metasums import META_SUM
from .schema import Schema
from .snapshots import HeldEpisodes
from .staging import EpisodeGroup, ParsedLog, StepLog, write_span
from .storage import WRITING_KEY
from .storage.base import Storage, StorageError

LOG_NAME = "episode"
# counters key: slots of committed length-0 episodes, which no published length shows
EMPTY_EPISODES = "empty_episodes"
# the longest the counters of committed whole episodes wait to be written (see above)
COUNTERS_INTERVAL = 0.05
# empty slots after a stamped one given the session's revision in the same write, so that a
# buffer filled slot after slot writes its slots' revisions once per this many episodes
REVISION_RUN_AHEAD = 1024


def new_revision(old: np.ndarray | None = None) -> int:
    """A random even ``_revision`` in [2, 2**62], unlike every value in ``old``: what keys the
    cached copies of a slot's rows with its generation, unique to one commit or edit."""
    while True:
        revision = 2 * (secrets.randbits(61) + 1)
        if old is None or not (np.asarray(old) == revision).any():
            return revision


class CountersNotWritten(StorageError):
    """The counters object could not be written (a full disk): the commits before it are
    published and kept, their counters are written again by the next commit, ``flush()`` or
    ``close()``, or derived from the published lengths by the next writable open."""


class Committer:
    """Commits episode groups to ``storage`` and keeps its bookkeeping mirror (``meta``,
    ``state``) and the step log of the group in progress."""

    def __init__(self, storage: Storage, schema: Schema, flush_every_store_step: int):
        self.storage = storage
        self.schema = schema
        self.max_episodes = schema.max_episodes
        self.max_timesteps = schema.max_timesteps
        self.flush_every_store_step = flush_every_store_step
        self.time_chunks = {n: storage.time_chunk(n) for n in schema.fields}
        self.spans = {n: write_span(f, self.time_chunks[n], self.max_timesteps) for n, f in schema.fields.items()}
        # every field's row is one chunk (or shard), always written whole: a killed writer
        # cannot leave rows past a later episode's end, so slots need no "writing" mark
        self.rows_written_whole = all(chunk >= self.max_timesteps for chunk in self.time_chunks.values())
        self.step_log = StepLog(schema.fields, schema.meta_fields)
        self.state: dict[str, Any] = {}
        self.meta: dict[str, np.ndarray] = {}
        self.dirty_slots: set[int] = set()
        # slots whose lengths a clear or drop is clearing, until their generations are cleared
        # too: one interrupted in between (a KeyboardInterrupt) is finished by the next commit
        # or flush (``finish_unpublishing``)
        self.unpublishing: set[int] = set()
        self.log_pending: list[bytes] = []
        self.log_written = False
        self.log_abandoned = False  # ``abandon_log``: the group in progress is logged no more
        self.held = HeldEpisodes(storage, schema)  # episodes named snapshots hold: never reused
        self.counters_pending = False  # self.state holds commits whose counters wait (step 4)
        self.batched_at = 0.0  # time.monotonic() of the last counters write of a batch (0: none)
        # slots whose meta values fail their checksum, loaded by an open that does not raise for
        # them (``metasums.unchecked``: verify --repair): their generations are not trusted
        self.suspect = np.zeros(0, np.int64)
        # committed slots whose lengths read 0, loaded by such an open (``LostLengthError``):
        # their generations are kept for the lengths verify --repair restores
        self.lost: tuple[int, ...] = ()
        self.revision = new_revision()  # what this session's commits publish (``stamp_revisions``)
        self.edit_interrupted = False  # an edit logged but not done (``finish_interrupted_edit``)

    def __getstate__(self) -> dict[str, Any]:
        """A pickled committer (inside a pickled, read-only buffer) carries no pending log."""
        return {**self.__dict__, "log_pending": [], "log_written": False, "counters_pending": False}

    def store_state(self, state: dict[str, Any], batched: bool = False) -> None:
        """Write the counters object ``state`` (which holds every commit so far); ``batched``:
        by a commit whose followers may batch theirs."""
        try:
            self.storage.commit_state(state)
        except (OSError, StorageError) as e:
            self.counters_pending = True  # retried by the next flush_counters
            raise CountersNotWritten(
                f"{e}; every episode committed so far is kept (its length is published), and the counters are "
                "written again by the next commit, flush() or close()"
            ) from e
        self.counters_pending = False
        self.batched_at = time.monotonic() if batched else 0.0

    def flush_counters(self) -> None:
        """Write the counters of commits whose step 4 was batched."""
        if self.counters_pending:
            self.store_state(self.state, batched=True)

    # ---- groups -----------------------------------------------------------------------------

    def new_group(self, batch_size: int, meta: dict[str, np.ndarray]) -> EpisodeGroup:
        """A group of ``batch_size`` episodes for the next slots, meta at its defaults but ``meta``;
        refused (``SnapshotHeldError``) when a slot holds an episode a snapshot holds."""
        slots = (self.state["episode_index"] + np.arange(batch_size)) % self.max_episodes
        self.held.check(slots, self.meta["_generation"][slots], "overwrite")
        group = EpisodeGroup(
            slots,
            self.schema.fields,
            self.spans,
            int(self.state["total_episodes"]),
        )
        group.meta = {
            n: np.broadcast_to(fill_value(f), (batch_size, *f.shape)).copy() for n, f in self.schema.meta_fields.items()
        }
        for name, values in meta.items():
            group.meta[name][:] = values
        return group

    def invalidate(self, group: EpisodeGroup) -> None:
        """Commit step 1: a reused slot stops being an episode before its data is overwritten."""
        if group.invalidated:
            return
        self.finish_unpublishing()
        self.finish_interrupted_edit()
        reused = group.slots[(self.meta["episode_lens"][group.slots] > 0) | (self.meta["_generation"][group.slots] > 0)]
        if len(reused) and group.length:
            # before anything is written or dropped: a circular buffer's oldest episodes go only
            # when the disk has room for the rows known so far (a whole episode's, at its
            # commit) of those replacing them
            self.storage.check_room(
                list(self.schema.fields), group.length * group.batch_size, f"overwriting slots {reused.tolist()}"
            )
        self.held.check(group.slots, self.meta["_generation"][group.slots], "overwrite", drop=True)
        # rows written but never published (an aborted or killed group, or a cleared buffer)
        # may reach max_timesteps; those are zeroed past the new episode's end at commit
        dirty = np.isin(group.slots, np.fromiter(self.dirty_slots, np.int64, len(self.dirty_slots)))
        if self.state.get("cleared"):
            dirty[:] = True
        group.previous_lens = np.where(dirty, self.max_timesteps, self.meta["episode_lens"][group.slots])
        self.dirty_slots.update(group.slots.tolist())
        if not self.rows_written_whole:
            self.storage.mark_writing(group.slots.tolist())
        if len(reused):
            # the length first: a kill in between leaves an empty slot with a stale generation
            # (cleared on reopen), never a committed slot without one
            self.write_meta("episode_lens", reused, np.zeros(len(reused), np.int32))
            self.write_meta("_generation", reused, np.zeros(len(reused), np.int64))
        # only now: an invalidation that failed part way (a full disk) is done again before
        # the next write, never skipped with the slot still published
        group.invalidated = True

    def write_slabs(self, group: EpisodeGroup, slabs: list[tuple[str, int, np.ndarray]], tail: bool = False) -> None:
        """Commit step 2 (invalidating first): rows of ``group`` that left RAM (``tail``: its
        last rows, padded past the episode's end)."""
        if not slabs:
            return
        try:
            self.invalidate(group)
            self.plan_generations(group)
            for name, t0, rows in slabs:
                if tail:
                    self.storage.write_tail_rows(name, group.slots, t0, rows, group.length)
                else:
                    self.storage.write_rows(name, group.slots, t0, rows)
        except (OSError, StorageError) as e:
            raise StorageError(
                f"writing episode(s) in slots {group.slots.tolist()} of {self.storage.location!r} failed: {e}"
            ) from e

    def commit(
        self,
        group: EpisodeGroup,
        final_meta: dict[str, np.ndarray] | None = None,
        batch_counters: bool = False,
    ) -> None:
        """Commit ``group`` (at least one step): its rows still in RAM, padded to a chunk
        boundary, then the stale chunks of a longer previous episode, then steps 3 and 4
        (``batch_counters``: step 4 batched, for whole episodes with no step log)."""
        for name, values in (final_meta or {}).items():
            group.meta[name][:] = values
        self.write_slabs(group, group.tail(self.time_chunks, self.max_timesteps), tail=True)
        self.clear_stale(group)
        try:
            self.publish(group.slots, group.length, group.meta, batch_counters and not self.log_written)
        except CountersNotWritten:
            self.discard_log()  # the episode is published: its log must not be replayed
            raise
        self.discard_log()

    def commit_empty(self, group: EpisodeGroup) -> None:
        """Commit ``group`` as episodes of length 0 with its meta values."""
        self.invalidate(group)
        self.clear_stale(group)
        self.publish(group.slots, 0, group.meta)
        self.discard_log()

    def commit_episode(self, steps: dict[str, np.ndarray], meta: dict[str, np.ndarray], length: int) -> np.ndarray:
        """Commit one checked whole episode (``length`` steps, room checked) to the next slot,
        through the same group, padding and commit path as episodes stored step by step.
        Returns the slot (as a 1-element array)."""
        group = self.new_group(1, meta)
        slabs = group.extend({n: v[None] for n, v in steps.items()}, length)
        self.write_slabs(group, slabs)  # whole chunks: no padding
        self.commit(group, batch_counters=True)
        return group.slots

    def plan_generations(self, group: EpisodeGroup) -> None:
        """Tell the storage the generations ``group`` publishes (``publish``), before its data
        is written (``Storage.plan_generations``): a group's generations are fixed once it is
        invalidated, since no other commit runs before its own (an episode in progress is
        aborted, or refused, by every other commit)."""
        self.storage.plan_generations(group.slots, self.ordinals(len(group.slots), group.length))

    def ordinals(self, count: int, length: int) -> np.ndarray:
        """The generations the next ``count`` episodes committed with ``length`` steps publish:
        the global ordinals after ``total_episodes`` (an empty slot carries none, length-0
        episodes included: replaybuf verify checks it)."""
        base = int(self.state["total_episodes"])
        return base + 1 + np.arange(count, dtype=np.int64) if length else np.zeros(count, np.int64)

    def clear_stale(self, group: EpisodeGroup) -> None:
        """Zero chunks a previous, longer episode left in a reused slot beyond the new end."""
        self.plan_generations(group)
        longest = int(group.previous_lens.max()) if group.previous_lens is not None and len(group.previous_lens) else 0
        for name, chunk in self.time_chunks.items():
            start = -(-group.length // chunk) * chunk
            end = min(-(-longest // chunk) * chunk, self.max_timesteps)
            if end > start:
                f = self.schema.fields[name]
                self.storage.write_rows(
                    name, group.slots, start, np.zeros((group.batch_size, end - start, *f.shape), f.dtype)
                )

    def publish(
        self,
        slots: np.ndarray,
        length: int,
        meta: dict[str, np.ndarray],
        batch_counters: bool = False,
    ) -> None:
        """Commit steps 3 and 4: the session's revision, meta rows, generation and length, then
        the counters (with ``batch_counters``, only when ``COUNTERS_INTERVAL`` has passed since
        the last write)."""
        self.stamp_revisions(slots)
        for name, values in meta.items():
            self.write_meta(name, slots, values)
        base = int(self.state["total_episodes"])
        ordinals = self.ordinals(len(slots), length)
        if self.storage.keeps_meta_sums:  # the checksum of what is about to be published, before it publishes
            self.write_meta(META_SUM, slots, self.meta_entries(slots, ordinals, length))
        previous = self.state
        empties = set(previous.get(EMPTY_EPISODES, ())) - set(slots.tolist())
        if not length:
            empties |= set(slots.tolist())
        state = {
            "episode_index": int((slots[-1] + 1) % self.max_episodes),
            "total_episodes": base + len(slots),
            # counted as the seed counts commits (an episode_index moved back overwrites and counts)
            "num_episodes": min(int(previous["num_episodes"]) + len(slots), self.max_episodes),
            **({"cleared": True} if previous.get("cleared") else {}),
            **({EMPTY_EPISODES: sorted(empties)} if empties else {}),
        }
        lens = np.full(len(slots), length, np.int32)
        try:
            self.write_meta("_generation", slots, ordinals)
            self.write_meta("episode_lens", slots, lens)
            self.state = state
        except BaseException as e:
            if not isinstance(e, Exception):
                self._follow_interrupted_publish(slots, ordinals, lens, state)
            raise
        self.dirty_slots.difference_update(slots.tolist())
        batch_counters = batch_counters and length > 0
        if batch_counters and time.monotonic() - self.batched_at < COUNTERS_INTERVAL:
            self.counters_pending = True
        else:
            self.store_state(self.state, batched=batch_counters)

    def _follow_interrupted_publish(
        self, slots: np.ndarray, ordinals: np.ndarray, lens: np.ndarray, state: dict[str, Any]
    ) -> None:
        """A publish interrupted (a KeyboardInterrupt) around its generation and length writes:
        where storage holds both, the episodes are published, so the mirror and the counters
        follow (written by the next commit, flush() or close()). Left behind, the next commit
        took the same slot and generation (a reader's cache keyed by it served the old rows),
        or, interrupted between the counters' two assignments, failed on every later commit."""
        stored_lens = self.storage.read_meta_rows("episode_lens", slots)
        stored_generations = self.storage.read_meta_rows("_generation", slots)
        if (stored_lens == lens).all() and (stored_generations == ordinals).all():
            self.meta["_generation"][slots] = ordinals
            self.meta["episode_lens"][slots] = lens
            self.state = state
            self.counters_pending = True

    def stamp_revisions(self, slots: np.ndarray) -> None:
        """Give ``slots``, before they publish, this session's revision where they hold another
        (a slot last committed or edited by an earlier session, or edited since), and with it
        the next ``REVISION_RUN_AHEAD`` empty slots after them that hold another too: a writer
        filling slot after slot writes revisions once per that many episodes, and one reusing
        circular slots once per slot. Empty slots hold nothing cached, so their revisions may
        move; committed ones keep theirs until reused or edited."""
        revisions = self.meta["_revision"]
        stale = np.asarray(slots, dtype=np.int64)
        stale = stale[revisions[stale] != self.revision]
        if not len(stale):
            return
        ahead = (int(stale.max()) + 1 + np.arange(min(REVISION_RUN_AHEAD, self.max_episodes))) % self.max_episodes
        empty = (self.meta["episode_lens"][ahead] == 0) & (self.meta["_generation"][ahead] == 0)
        ahead = ahead[empty & (revisions[ahead] != self.revision)]
        stamped = np.union1d(stale, ahead)
        self.write_meta("_revision", stamped, np.full(len(stamped), self.revision, np.int64))

    # ---- bookkeeping --------------------------------------------------------------------------

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` of meta field ``name`` for ``episodes`` to storage and the mirror."""
        episodes = np.asarray(episodes)
        self.storage.write_meta(name, episodes, values)
        self.meta[name][episodes] = values

    @property
    def summed(self) -> metasums.Summed:
        """What the storage's ``_meta_sum`` entries cover (``metasums.summed``)."""
        return metasums.summed(self.schema, self.storage)

    def meta_entries(self, slots: np.ndarray, generations: Any = None, length: int | None = None) -> np.ndarray:
        """The ``_meta_sum`` entries of ``slots`` for their values in the mirror, ``generations``
        and ``length`` (None: the mirror's)."""
        slots, summed = np.asarray(slots, dtype=np.int64), self.summed
        values = {name: self.meta[name][slots] for name in summed.fields}
        if length is not None:
            values["episode_lens"] = np.full(len(slots), length, np.int32)
        return metasums.entries(
            slots,
            self.meta["_generation"][slots] if generations is None else generations,
            values,
            summed,
        )

    def reseal_meta(self, slots: np.ndarray) -> None:
        """Write the ``_meta_sum`` entries of ``slots`` for the values in the mirror (none in a
        format that keeps none)."""
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        if len(slots) and self.storage.keeps_meta_sums:
            self.write_meta(META_SUM, slots, self.meta_entries(slots))

    def edit_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        """Edit meta field ``name`` of ``episodes`` in place (``store_meta_datapoint``,
        ``meta_data[...] = ...``), with their ``_meta_sum`` entries, as one edit (``edit``)."""
        self.edit([Write("meta", name, np.asarray(episodes, np.int64), values)])

    def edit(self, writes: Sequence[Write], staged: Callable[[], None] | None = None) -> None:
        """One in-place edit of committed episodes (``update``, ``update_steps``,
        ``data[...] = ...``, ``store_datapoint``, meta values), whole or not at all through a
        kill. ``staged()`` first puts the edit into the episodes in progress (RAM and step
        log; when it raises nothing else is done). Then the writes are written to the edit log
        as one record (``editlog.py``), the slots' ``_revision`` made odd, the writes applied in
        order, the revision moved to a new random even value (``new_revision``: two copies of a
        buffer edited apart never share one) and the log emptied. Every copy of decoded rows is
        keyed by (generation, revision) and none is taken at an odd revision, so no reader is
        served the rows from before (or halfway through) the edit once it has refreshed. A
        writer killed once the record is written has the edit applied again by the next writable open
        (``finish_edits``); one interrupted in this process (a KeyboardInterrupt) before the
        interrupt leaves this call, or (interrupted again) by its next edit, commit or
        ``flush()`` (``finish_interrupted_edit``). A write that raises (a
        damaged row refused, a failed write) ends the edit there, as applying it again would
        fail again. An edit the disk may have no room for is refused first
        (``check_edit_room``)."""
        slots = np.unique(np.concatenate([w.episodes for w in writes])).astype(np.int64)
        names = list(dict.fromkeys(w.name for w in writes if w.kind != "meta"))
        ends = [int(w.at) + w.steps for w in writes if w.kind == "rows"]
        ends += [int(np.max(w.at)) + 1 for w in writes if w.kind == "steps" and len(w.episodes)]
        steps = max(ends, default=0)
        self.check_edit_room(slots, names, steps)
        self.finish_interrupted_edit()
        if len(slots):
            self.check_no_other_edit()
        if staged is not None:
            staged()
        if not len(slots):
            return
        past = slots[self.meta["episode_lens"][slots] < steps].tolist() if ends else []
        if not self.rows_written_whole and set(past) - self.dirty_slots:
            # rows past a slot's committed end are zeroed when its next episode commits: in a
            # later session too, which takes the slots of the writing record (``recover``)
            self.storage.mark_writing(sorted(self.dirty_slots | set(past) | self.unpublishing))
        revisions = self.meta["_revision"][slots] | 1
        record = editlog.encode(
            Edit(slots, self.meta["_generation"][slots].copy(), revisions, list(writes)), self.schema
        )
        # from here until done, a BaseException (a KeyboardInterrupt) leaves the edit to be
        # finished from the log, or the log cleared (``finish_interrupted_edit``): at once, as
        # the object's reads finish nothing (they showed the edit half applied, or on zarr
        # raised CorruptChunkError for its odd slots), else (interrupted again) by the next
        # edit, commit or flush()
        self.edit_interrupted = True
        try:
            try:
                editlog.write(self.storage, record)
            except StorageError as e:  # nothing applied: the record, whole or cut short, is emptied
                self._clear_edit_log()
                self.edit_interrupted = False
                raise StorageError(
                    f"{e}; nothing was written: the edit was not made, the episodes keep their values"
                ) from e
            self.dirty_slots.update(past)  # rows past a slot's committed end: zeroed when its next episode commits
            try:
                self.write_meta("_revision", slots, revisions)
                self.apply(writes)
            except Exception:
                # a write refused (a damaged row) or failed (a full disk): applying it again would
                # fail again, so the log goes, and the slots stay odd, uncached, each step old or
                # new, until the next edit of them or writable open seals them as they are
                self.edit_interrupted = False
                self._clear_edit_log()
                raise
            self.write_meta("_revision", slots, np.full(len(slots), new_revision(revisions - 1), np.int64))
            self.edit_interrupted = False
            self._clear_edit_log()
        except BaseException as e:
            if self.edit_interrupted and not isinstance(e, Exception):
                self.finish_interrupted_edit()
            raise

    def apply(self, writes: Sequence[Write]) -> None:
        """Apply an edit's writes in order, then reseal the meta checksums of the slots whose
        meta values they set."""
        for write in writes:
            if write.kind == "rows":
                self.storage.update_rows(write.name, write.episodes, int(write.at), write.values)
            elif write.kind == "steps":
                self.storage.update_steps(write.name, write.episodes, np.asarray(write.at), write.values)
            else:
                self.write_meta(write.name, write.episodes, write.values)
        edited = [w.episodes for w in writes if w.kind == "meta"]
        if edited:
            self.reseal_meta(np.concatenate(edited))

    def finish_interrupted_edit(self) -> None:
        """Finish an edit of this session interrupted (a KeyboardInterrupt) once its record may
        have been written: its writes are applied again from the log and its slots sealed
        (``finish_edits``), or a record cut short is dropped. Run before the next edit and commit and by
        ``flush()`` (so ``close()``), and by the edit itself when interrupted (``edit``)."""
        if self.edit_interrupted:
            # the edit is finished from what is stored, never from this open's mirror: the
            # interrupt may have fallen between a meta write and its mirror (a slot odd on disk,
            # even here, was left odd), and another open sharing the lease may have committed to
            # or edited the slots since (a reused slot holds its new episode and checksums)
            for name, values in self.meta.items():
                values[...] = self.storage.read_meta(name)
            self.finish_edits()
            self.edit_interrupted = False

    def check_no_other_edit(self) -> None:
        """Refuse an edit, before anything is written, while the edit log holds the running edit
        of another open of this buffer in this process (one sharing the writer lease, its edit
        interrupted by a KeyboardInterrupt): this edit's record would replace that one, which
        would then never be finished, its episodes left part old and part new. Judged by the
        generations and revisions stored (the other open's mirror, not this one's); only while
        the lease is shared, as no other writer can leave a running edit behind a live one."""
        if not self.storage.writer_shared:
            return
        edit, _ = editlog.read(self.storage, self.schema)
        if edit is not None and edit.running(
            self.storage.read_meta("_generation"), self.storage.read_meta("_revision")
        ):
            raise StorageError(
                f"another open of {self.storage.location!r} in this process was interrupted in an in-place edit of "
                f"slots {edit.slots.tolist()}; its next edit, commit, flush() or close() finishes it: this edit was "
                "not made, the episodes keep their values"
            )

    def _clear_edit_log(self) -> None:
        """Empty the edit log. One left full (the store refused the write) holds a finished
        edit, which nothing applies again (``replay_edits``); the next edit replaces it."""
        try:
            editlog.clear(self.storage)
        except StorageError:
            pass

    def check_edit_room(self, slots: np.ndarray, names: Sequence[str], steps: int) -> None:
        """``Storage.check_room`` for an edit of data fields ``names`` of ``slots`` through step
        ``steps`` - 1: each slot's rows are rewritten whole, through its committed length or the
        edit's end, whichever is further, after the edit log's record of the new values (at
        most as many bytes again)."""
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        written = int(np.maximum(self.meta["episode_lens"][slots], steps).sum()) if len(slots) else 0
        self.storage.check_room(
            names, 2 * written, f"an edit of {', '.join(names) or 'meta values'} in {len(slots)} episode(s)"
        )

    def commit_state(self, **changes: Any) -> None:
        """Commit the counters with ``changes``."""
        self.state = {**self.state, **changes}
        self.store_state(self.state)

    def caught_up(self, state: dict[str, Any]) -> dict[str, Any]:
        """The counters ``state`` as a reader loaded them, caught up with episodes published
        since (``catch_up``): ``self.meta`` holds what was loaded."""
        return catch_up(state, self.meta["episode_lens"], self.meta["_generation"], self.max_episodes)

    def empty_episodes(self) -> np.ndarray:
        """Slots of committed length-0 episodes (no published length shows them)."""
        return empty_episodes(self.state, self.meta["episode_lens"])

    def count_episodes(self) -> int:
        """The episodes the published lengths show (``count_episodes``)."""
        return count_episodes(self.state, self.meta["episode_lens"], self.max_episodes)

    def listed_count(self) -> int:
        """``num_episodes`` as an open recounts it: the episodes the published lengths show, and
        at least up to the highest slot holding one (an emptied slot before it, dropped or
        unpublished by a killed commit, lists as a row of padding): ``get_all_data`` lists slots
        ``0 .. num_episodes - 1``, and none of them may hide a committed episode."""
        return listed_count(self.state, self.meta["episode_lens"], self.max_episodes)

    def clear(self) -> None:
        """Unpublish every slot and reset the counters (the arrays keep their data until reused)."""
        self.held.check(np.arange(self.max_episodes), self.meta["_generation"], "clear", drop=True)
        self.discard_log()
        self.mark_unpublishing(np.flatnonzero(self.meta["episode_lens"] > 0))
        # before the lengths: a clear interrupted part way (a KeyboardInterrupt) still has every
        # slot's next episode zero the rows it may have left, through the counters written at close
        self.state = {**self.state, "cleared": True}
        self.counters_pending = True
        for name in ("episode_lens", "_generation"):
            self.write_meta(name, np.arange(self.max_episodes), np.zeros(self.max_episodes, self.meta[name].dtype))
        self.unpublishing.clear()
        self.state = {
            "num_episodes": 0,
            "episode_index": 0,
            "total_episodes": int(self.state["total_episodes"]),
            "cleared": True,
        }
        try:
            self.store_state(self.state)
        except CountersNotWritten as e:  # not "every episode is kept": none is published now
            raise CountersNotWritten(
                f"clear: every episode was erased (no slot is published any more), but {e.__cause__}; the "
                "counters are written again by the next commit, flush() or close()"
            ) from e.__cause__

    def mark_unpublishing(self, slots: np.ndarray) -> None:
        """Record ``slots`` in the writing record (with the rows in flight) before their lengths,
        then generations, are cleared: a writer killed in between leaves committed generations
        without lengths there, which opens take for its leftovers, not for lost lengths
        (``stopped_writer_leftovers``). They stay in every record (``unpublishing``) until
        their generations are cleared."""
        self.unpublishing.update(np.asarray(slots).tolist())
        self.storage.mark_writing(sorted(self.dirty_slots | self.unpublishing))

    def finish_unpublishing(self) -> None:
        """Clear the generations of the slots a clear or drop stopped unpublishing part way
        (``unpublishing``: a KeyboardInterrupt between their two writes), as it would have: a
        slot whose length storage holds as 0 loses its generation, the others stay committed.
        Run before the next commit and by ``flush()`` (so ``close()``): a writer that closed
        leaves no generation without its length, which the next open refuses as a lost one."""
        if not self.unpublishing:
            return
        slots = np.array(sorted(self.unpublishing), np.int64)
        lens = self.storage.read_meta_rows("episode_lens", slots)
        self.meta["episode_lens"][slots] = lens  # the mirror may not have taken the write
        emptied = slots[lens == 0]
        if len(emptied):
            self.write_meta("_generation", emptied, np.zeros(len(emptied), np.int64))
            # their rows stay (a drop zeroes them last): the next episode of every slot zeroes
            # them past its end, as after a clear, in this session and the next ones
            self.state = {**self.state, "cleared": True}
            self.counters_pending = True
        self.unpublishing.clear()

    def drop(self, slots: np.ndarray) -> np.ndarray:
        """Unpublish the committed episodes among ``slots`` as a reused slot is (length, then
        generation), then zero their rows where rows are not written whole: a later, shorter episode
        in the slot zeroes only what the slot's published length says was written (0 once
        dropped), so the dropped steps past its end would stay (in this session or a later
        one). Returns the slots dropped. ``num_episodes`` stays: a dropped slot lists as a row
        of padding, and the slots after it (where the next episodes go) stay listed."""
        dropped = slots[self.meta["episode_lens"][slots] > 0]
        self.held.check(dropped, self.meta["_generation"][dropped], "drop", drop=True)
        if len(dropped):
            lengths = self.meta["episode_lens"][dropped].tolist()
            self.mark_unpublishing(dropped)
            # the length first, as ``invalidate`` does: a kill in between leaves an empty slot
            # with a stale generation (cleared on reopen), never a committed slot without one,
            # which every open refuses as damage
            self.write_meta("episode_lens", dropped, np.zeros(len(dropped), np.int32))
            self.write_meta("_generation", dropped, np.zeros(len(dropped), np.int64))
            if not self.rows_written_whole:
                for slot, length in zip(dropped.tolist(), lengths):
                    for name, field in self.schema.fields.items():
                        zeros = np.zeros((1, length, *field.shape), field.dtype)
                        self.storage.write_rows(name, np.array([slot]), 0, zeros)
            self.unpublishing.difference_update(dropped.tolist())
        return dropped

    # ---- the step log -------------------------------------------------------------------------

    def log_header(self, group: EpisodeGroup) -> None:
        """Start the step log of ``group`` (replacing whatever was pending)."""
        self.log_pending = [self.step_log.header(group.slots, group.generation_base, group.meta)]
        self.log_abandoned = False

    def flush_log(self) -> None:
        if self.log_abandoned:
            self.log_pending = []
        if self.log_pending:
            # set first: a failed append (a full disk) may have created the log, which an
            # aborted episode must still delete, or the next writable open would commit it
            self.log_written = True
            self.storage.append_log(LOG_NAME, b"".join(self.log_pending))
            self.log_pending = []

    def log_edit(self, records: list[bytes], durable: bool) -> None:
        """Log an edit of the episodes in progress (``records``: new values, or its steps cut
        back by ``timestep_index = n``) before it is applied: after the records pending, in an
        append of its own (within ``StepLog.segment_bound``), written now when ``durable`` (the
        log holds steps: the edit must survive a kill as a step does; with
        ``flush_every_store_step`` > 1 the steps pending go with it). Raises StorageError, the
        edit left out of the log, when the log cannot be written."""
        if not durable:
            self.log_pending.extend(records)
            return
        try:
            self.flush_log()  # the steps pending (kept pending when this fails)
            self.log_pending = records
            self.flush_log()
        except StorageError as e:
            if self.log_pending is records:
                self.log_pending = []  # the log on disk ends at its last whole record
            raise StorageError(
                f"{e}; the edit was not made: the episode in progress keeps its values, edit it again once the "
                "store can be written"
            ) from e
        except BaseException:
            self.abandon_log()  # interrupted: whether the log took the records is unknown
            raise

    def abandon_log(self) -> None:
        """Stop logging the group in progress and delete its log: a write to it was interrupted
        (a KeyboardInterrupt), so whether it holds the last records is unknown, and a log
        replayed with a step missing or twice would commit another episode than the one stored.
        A writer killed before the group's commit then loses it, as with
        ``flush_every_store_step=0``; the next group is logged again (``log_header``)."""
        self.log_abandoned = True
        self.discard_log()

    def discard_log(self) -> None:
        self.log_pending = []
        if self.log_written:
            self.storage.clear_log(LOG_NAME)
            self.log_written = False

    # ---- recovery at a writable open ---------------------------------------------------------

    def recover(self, step_log: bool = True) -> None:
        """Repair what a writer killed at any point of a commit left: the counters are made to
        agree with the published bookkeeping, then the episodes of its step log are committed
        (not with ``step_log=False``: the log is a live writer's episode in progress)."""
        writing = self.storage.writing_slots()
        if writing is None:  # a record torn by a kill: any empty slot may hold its rows
            warnings.warn(
                f"{self.storage.describe_key(WRITING_KEY)} is damaged (a writer killed while writing it); every "
                "empty slot is zeroed past its next episode's end when reused",
                stacklevel=4,
            )
            writing = np.flatnonzero(self.meta["episode_lens"] == 0).tolist()
        writing = [*writing, *self.state.pop("writing", ())]  # earlier formats kept it in the counters
        self.reconcile_state()
        self.finish_edits()
        # committed ones too: an edit wrote rows past their ends (``edit``)
        self.dirty_slots.update(int(s) for s in writing if 0 <= int(s) < self.max_episodes)
        if step_log:
            self.recover_step_log()
        lease = self.storage.held_lease
        if lease is not None:  # a killed writer's leftovers are gone: none is excused any more
            lease.inherited = False

    def reconcile_state(self) -> None:
        """Make the counters agree with the published lengths and generations, the truth after
        a writer died at any point of a commit: ``num_episodes`` is recounted (``listed_count``),
        ``episode_index`` follows the newest when the counters were written before it
        was published (else it stands), and generations of empty slots (a commit killed between
        its two bookkeeping writes) are cleared."""
        lens, generations = self.meta["episode_lens"], self.meta["_generation"]
        stale = np.setdiff1d(np.flatnonzero((lens == 0) & (generations != 0)), np.asarray(self.lost, np.int64))
        if len(stale):
            self.write_meta("_generation", stale, np.zeros(len(stale), np.int64))
        valid = np.setdiff1d(np.flatnonzero(lens > 0), self.suspect)
        # an open recounts what is published (a killed commit may have emptied a reused slot);
        # within a session num_episodes counts commits, as the seed does
        state = {**self.state, "num_episodes": self.listed_count()}
        if len(valid):
            newest = int(valid[np.argmax(generations[valid])])
            if int(generations[newest]) > int(state["total_episodes"]):
                # counters older than the newest published episode (a writer killed before
                # writing them): the next slot follows it. Otherwise the counters stand, as the
                # seed's do: length-0 episodes committed since, an ``episode_index`` set by hand
                state["episode_index"] = (newest + 1) % self.max_episodes
            state["total_episodes"] = max(int(state["total_episodes"]), int(generations[newest]))
        # nor below the stored count up to the next slot: the episodes committed next go there
        # and after it, and a recount of fewer (the last episodes dropped) would hide them
        stored = min(int(self.state["num_episodes"]), int(state["episode_index"]))
        state["num_episodes"] = max(state["num_episodes"], stored)
        if state != self.state:
            self.state = state
            self.store_state(state)

    def finish_edits(self) -> None:
        """Finish the in-place edits a killed (or interrupted) writer left open (an odd
        ``_revision``). Their rows are as it left them, now stable: their checksums are
        recomputed from them first (it may have died between rows and checksums, and an edit
        rewrites rows as read, which it refuses over a failing checksum). Then the edits its edit
        log holds are applied again whole (``replay_edits``); a slot edited by none of them (an
        earlier release logged no edit, or its record is damaged) keeps each step old or new.
        Every such slot moves to a new random even revision."""
        odd = np.flatnonzero(self.meta["_revision"] % 2)
        if len(odd):
            self.storage.reseal(odd, self.meta["episode_lens"][odd])
            self.reseal_meta(odd)
        self.replay_edits()
        odd = np.flatnonzero(self.meta["_revision"] % 2)
        if len(odd):
            revision = new_revision(self.meta["_revision"][odd] - 1)
            self.write_meta("_revision", odd, np.full(len(odd), revision, np.int64))

    def replay_edits(self) -> None:
        """Apply again the edit the edit log holds if it was running when its writer stopped:
        its slots still hold the generations it edited and some of them the odd revision it
        gave them (a finished edit moved them all to a new even one). Its slots are made odd
        first, so that ``finish_edits`` gives them all a new revision. A record that is no
        edit (damaged, or cut short) is copied aside and named in a warning when a slot is odd
        (``editlog.set_aside``); else no edit ran (a kill cut the record's write short, before
        any slot was marked). Then the log is emptied."""
        edit, damage = editlog.read(self.storage, self.schema)
        if damage is not None and (self.meta["_revision"] % 2).any():
            aside = editlog.set_aside(self.storage, self.schema)
            warnings.warn(
                f"the edit log {self.storage.describe_key(editlog.KEY)} is damaged ({damage}); it was copied to "
                f"{aside}. The in-place edit a writer left unfinished is not applied again: its episodes keep each "
                "step old or new",
                stacklevel=4,
            )
        if edit is None:
            if damage is not None:
                self._clear_edit_log()
            editlog.clear_legacy(self.storage)
            return
        if edit.running(self.meta["_generation"], self.meta["_revision"]):
            kept = edit.kept(self.meta["_generation"])
            self.write_meta("_revision", kept, self.meta["_revision"][kept] | 1)
            try:
                self.apply([write.only(kept) for write in edit.writes])
            except (StorageError, ValueError) as e:  # CorruptChunkError is a StorageError
                warnings.warn(
                    f"an in-place edit of slots {kept.tolist()} in {self.storage.location!r} that a writer left "
                    f"unfinished could not be applied again ({e}); each of its steps keeps its old or its new value",
                    stacklevel=4,
                )
        self._clear_edit_log()
        editlog.clear_legacy(self.storage)

    def recover_step_log(self) -> None:
        """Commit, truncated, the episodes a killed writer left in its step log; then clear it.

        A log with a damaged record (bad checksum, wrong size, values that do not fit the
        config) is copied aside with a warning naming the copy, and its valid prefix recovered;
        a log of an episode committed since (stale) is dropped."""
        if LOG_NAME not in self.storage.log_names():
            return
        # read in pieces, each record's size checked before it is read and at most
        # max_timesteps steps kept: a log of absurd size (damaged, planted) costs no more
        # memory than a valid one. An object store's segment is refused over what one append
        # of a writer holds without rewinds (the log then ends before it, as damage)
        limit = self.step_log.segment_bound(self.max_episodes, self.max_timesteps)
        log = self.step_log.parse(self.storage.log_pieces(LOG_NAME, limit), self.max_timesteps, self.max_episodes)
        try:
            slots, meta = self._check_log_header(log) if log.header is not None else (None, {})
        except (ValueError, TypeError, KeyError) as e:
            log.damage, log.steps, slots = f"header: {e}", [], None
        if log.damage is not None:
            # the copy keeps the valid prefix and the most a valid record past it could hold,
            # no more than a valid log holds without rewinds (its memory is bounded too)
            keep = min(log.end + self.step_log.record_bound(log.header, self.max_timesteps), limit)
            aside, dropped = self.storage.copy_log_aside(LOG_NAME, keep, limit)
            left_out = (
                f" (its last {dropped:,} bytes, past what a valid log could hold, left out)"
                if dropped
                else " (what may follow that, past what a valid log could hold, left out)"
                if dropped is None
                else ""
            )
            warnings.warn(
                f"the step log of an unfinished episode in {self.storage.location!r} is damaged ({log.damage}); "
                f"it was copied to {aside!r}{left_out} and {len(log.steps)} valid step(s) before the damage are "
                "recovered",
                stacklevel=4,
            )
        if (
            slots is not None
            and log.header is not None
            and log.steps
            and log.header["generation_base"] >= int(self.state["total_episodes"])
        ):
            self.state["episode_index"] = int(slots[0])
            group = self.new_group(len(slots), meta)
            self.log_pending, self.log_written = [], True
            for step in log.steps[: self.max_timesteps]:
                self.write_slabs(group, group.append(step))
            self.commit(group)
            return
        self.storage.clear_log(LOG_NAME)

    def _check_log_header(self, log: ParsedLog) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The slots and checked meta values a step log's header and meta records name."""
        header = log.header
        assert header is not None, "called for a log with a header"
        slots = np.asarray(header["slots"])
        if (
            slots.ndim != 1
            or not 0 < len(slots) <= self.max_episodes
            or slots.dtype.kind not in "iu"
            or len(np.unique(slots)) != len(slots)
            or slots.min() < 0
            or slots.max() >= self.max_episodes
        ):
            raise ValueError(f"slots {header['slots']!r} are not distinct slots in [0, {self.max_episodes})")
        base = header["generation_base"]
        if isinstance(base, bool) or not isinstance(base, int) or base < 0:
            raise ValueError(f"generation_base {base!r} is not an int >= 0")
        if header["fields"] != list(self.schema.fields):
            raise ValueError(f"the log holds fields {header['fields']}, the buffer {list(self.schema.fields)}")
        return slots, log.meta


def catch_up(state: dict[str, Any], lens: np.ndarray, generations: np.ndarray, max_episodes: int) -> dict[str, Any]:
    """The counters ``state`` caught up with the episodes published after it was written: a
    live writer's batched step 4 (``COUNTERS_INTERVAL``), or a killed one's. Lists the slots up
    to the highest holding an episode (``listed_count``), as the writer does."""
    newest = int(generations.max()) if len(generations) else 0
    if newest <= int(state["total_episodes"]):
        return state
    return {
        **state,
        "num_episodes": max(int(state["num_episodes"]), listed_count(state, lens, max_episodes)),
        "episode_index": int((np.argmax(generations) + 1) % max_episodes),
        "total_episodes": newest,
    }


def listed_count(state: dict[str, Any], lens: np.ndarray, max_episodes: int) -> int:
    """The episodes the published lengths show (``count_episodes``), and at least up to the
    highest slot holding one: an emptied slot before it (dropped, or unpublished by a killed
    commit) lists as a row of padding, never hiding a committed episode from ``get_all_data``."""
    held = np.concatenate([np.flatnonzero(lens > 0), empty_episodes(state, lens)])
    return min(max(count_episodes(state, lens, max_episodes), int(held.max(initial=-1)) + 1), max_episodes)


def empty_episodes(state: dict[str, Any], lens: np.ndarray) -> np.ndarray:
    """Slots of the committed length-0 episodes the counters ``state`` list and no published
    length shows."""
    return np.asarray([s for s in state.get(EMPTY_EPISODES, ()) if lens[s] == 0], np.int64)


def count_episodes(state: dict[str, Any], lens: np.ndarray, max_episodes: int) -> int:
    """The episodes the published lengths show: the slots holding an episode, plus the
    committed length-0 episodes (the seed counts ``advance_episode(batch_size=n)`` before any
    step), which hold no data and are listed in the counters object as ``empty_episodes``."""
    return min(int((lens > 0).sum()) + len(empty_episodes(state, lens)), max_episodes)
