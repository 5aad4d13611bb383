"""The hot write tier of a zarr writer on local disk: recent episodes of image fields stored raw,
compacted later.

Encoding a frame with blosc-lz4:9 costs ~55-73 us of CPU (84x84x3) on the writer's path, more
than the rest of ``store_episode``. A writer therefore stores the shards of sharded blosc fields
*hot*: the same shard layout and the same codec chain in ``zarr.json``, each inner chunk encoded
at blosc clevel 0 (the payload copied behind blosc's 16-byte header, flag MEMCPYED; any blosc
reader decodes it whatever clevel the metadata names), ~3 us a frame plus its crc32c.

A background thread of the writing process *compacts* committed hot episodes, oldest first,
once their bytes exceed ``hot_bytes``: each shard is read, every inner chunk checked and
decoded, re-encoded at the configured level and put in place of the hot one atomically (a temp
file and a rename), only if the slot still holds the same committed generation and nothing
wrote its shard meanwhile. That check and the rename happen under ``HotTier.lock``, which every
shard write of the writer takes (``ShardedArray.write_box``), so a compaction never replaces a
newer episode's shard; the encoding runs outside it. A slot overwritten before its compaction is
never encoded at all (a circular buffer's common case). A shard failing its checks is left as
it is, with a warning: damage is never re-encoded into a valid-looking shard.

A kill at any point leaves each shard hot or compacted, both of which read back the same; the
temp file of an interrupted rename is deleted by the next writable open (``LocalKV.prepare_writes``),
whose compactor then finds the committed shards left hot (the flag of their first stored chunk)
and compacts them. Readers elsewhere that cached a shard's index retry once with a fresh one
(``ShardedArray._fresh_on_damage``).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from ._kv import KeyValue
from ._shards import ShardedArray
from .base import CompactionSummary, CorruptChunkError


def find_hot(arrays: Iterable[ShardedArray], slots: list[int]) -> dict[tuple[int, str], int]:
    """(slot, array path) -> bytes of each shard of ``slots`` stored hot, in the arrays that
    write hot: the flag of the shard's first stored chunk (``ShardedArray.hot_sizes``)."""
    found = {}
    for array in arrays:
        if array.codec.writes_hot:
            found.update({(slot, array.path): size for slot, size in zip(slots, array.hot_sizes(slots)) if size})
    return found


class HotTier:
    """Which episodes of a writer's sharded blosc arrays are stored hot, and their compaction.

    ``generations``: the published generation of every slot when the writer opened (0: none);
    the storage reports later ones (``published``), and the arrays report every shard write
    (``written``) with ``lock`` held. ``hot_bytes`` 0 writes every shard compressed (the tier
    then only compacts what a killed writer left hot).
    """

    def __init__(self, kv: KeyValue, arrays: Sequence[ShardedArray], generations: np.ndarray, hot_bytes: int):
        self.kv = kv
        self.arrays = {array.path: array for array in arrays}
        self.hot_bytes = int(hot_bytes)
        self.writes_hot = self.hot_bytes > 0
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self.generations = np.array(generations, dtype=np.int64)
        self.versions = np.zeros(len(self.generations), np.int64)  # shard writes per slot
        self.hot: dict[int, dict[str, int]] = {}  # slot -> array path -> bytes of its hot shard
        self.busy: dict[int, int] = {}  # slots being compacted -> the thread compacting it (ident)
        self.skipped: set[tuple[int, int]] = set()  # (slot, version) left hot as damaged
        self.scanned = not self.generations.any()  # nothing committed: nothing left hot
        self.done = CompactionSummary()  # what the background thread compacted
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        for array in arrays:
            array.hot = self
        if not self.scanned:
            self._wake()

    # ---- what the writer reports -----------------------------------------------------------

    def written(self, path: str, slots: Sequence[int], sizes: Sequence[int]) -> None:
        """Shards of array ``path`` in ``slots`` were written (``lock`` held): hot ones of
        ``sizes`` bytes, cold ones 0. A committed episode rewritten hot (an in-place edit)
        wakes the background thread when the hot bytes exceed ``hot_bytes``, as a commit does:
        a pass editing every episode would otherwise leave them all raw until ``close()``."""
        edited = False
        for slot, size in zip(slots, sizes):
            self.versions[slot] += 1
            if size:
                self.hot.setdefault(slot, {})[path] = size
                edited = edited or self.generations[slot] > 0
            elif slot in self.hot:
                self.hot[slot].pop(path, None)
        if edited and self.committed_bytes() > self.hot_bytes:
            self._wake()

    def published(self, slots: np.ndarray, generations: np.ndarray) -> None:
        """The storage wrote ``_generation`` of ``slots`` (0: invalidated, before a reuse)."""
        with self.lock:
            self.generations[np.asarray(slots, np.int64)] = np.asarray(generations, np.int64)
            over = self.committed_bytes() > self.hot_bytes
        if over:
            self._wake()

    def committed_bytes(self) -> int:
        """Bytes of the hot shards of committed episodes (``lock`` held)."""
        return sum(sum(sizes.values()) for slot, sizes in self.hot.items() if self.generations[slot] > 0)

    # ---- compaction --------------------------------------------------------------------------

    def compact(self) -> CompactionSummary:
        """Compact every committed hot episode now (leftovers of a killed writer included) and
        return when none is hot, the background thread's work in progress included."""
        started = time.perf_counter()
        summary = CompactionSummary()
        self._scan()
        try:
            while True:
                while (slot := self._next(everything=True)) is not None:
                    self._compact_slot(slot, summary)
                with self._idle:
                    self._idle.wait_for(lambda: not self.busy)
                # the background thread gives up a slot a write overtook while it compacted it (a
                # repair's re-seal): compacted here once it is done, not left hot
                if (slot := self._next(everything=True)) is None:
                    break
                self._compact_slot(slot, summary)
        except BaseException:
            # interrupted (a KeyboardInterrupt) between marking a slot busy and compacting it:
            # left busy, it would have every later compact() (and close()) wait for it forever
            with self._idle:
                for slot in [s for s, owner in self.busy.items() if owner == threading.get_ident()]:
                    del self.busy[slot]
                self._idle.notify_all()
            raise
        summary.seconds = time.perf_counter() - started
        return summary

    def _next(self, everything: bool = False, leftovers: bool = False) -> int | None:
        """The oldest committed hot slot nobody compacts (marked busy), when ``everything`` or
        the hot bytes exceed ``hot_bytes``; with ``leftovers``, only among the slots not written
        since the open (a killed writer's, whatever the hot bytes); else None."""
        with self.lock:
            if not (everything or leftovers) and self.committed_bytes() <= self.hot_bytes:
                return None
            candidates = [
                slot
                for slot, sizes in self.hot.items()
                if sizes
                and self.generations[slot] > 0
                and not (leftovers and self.versions[slot])
                and slot not in self.busy
                and (slot, int(self.versions[slot])) not in self.skipped
            ]
            if not candidates:
                return None
            slot = min(candidates, key=lambda s: self.generations[s])
            self.busy[slot] = threading.get_ident()
            return slot

    def _compact_slot(self, slot: int, summary: CompactionSummary) -> None:
        """Compact the hot shards of ``slot`` (marked busy) unless a write overtakes it."""
        try:
            with self.lock:
                generation, version = int(self.generations[slot]), int(self.versions[slot])
                paths = list(self.hot.get(slot, {}))
            before = after = 0
            for path in paths:
                array = self.arrays[path]
                key = array.shard_key(slot)
                data = self.kv.get(key)
                try:
                    shard = None if data is None else array.compacted(slot, data)
                except CorruptChunkError as e:
                    if array.check_writable is not None:
                        # a writer whose buffer was created again here read the new buffer's
                        # shard (bound to another uuid): it is told so (BufferLockedError)
                        array.check_writable()
                    with self.lock:
                        if (int(self.generations[slot]), int(self.versions[slot])) == (generation, version):
                            self.skipped.add((slot, version))
                            warnings.warn(f"compaction left the shard of {path}, slot {slot} hot: {e}", stacklevel=2)
                    break  # the fields compacted before it still count
                with self.lock:
                    if (int(self.generations[slot]), int(self.versions[slot])) != (generation, version):
                        break  # rewritten or invalidated meanwhile: the new write decides
                    if shard is not None:
                        if array.check_writable is not None:
                            array.check_writable()
                        self.kv.set_many({key: shard}, atomic=True)
                        array._forget_indexes([slot])
                        before, after = before + len(data or b""), after + len(shard)
                    self.hot[slot].pop(path, None)
            if before:
                summary.episodes += 1
                summary.bytes_before += before
                summary.bytes_after += after
        finally:
            with self._idle:
                self.busy.pop(slot, None)
                if not self.hot.get(slot, True):
                    del self.hot[slot]
                self._idle.notify_all()

    def _scan(self) -> None:
        """Find the committed shards left hot by a writer killed before compacting them (once
        per open): the flag of their first stored chunk."""
        if self.scanned:
            return
        found = find_hot(self.arrays.values(), np.flatnonzero(self.generations > 0).tolist())
        with self.lock:
            for (slot, path), size in found.items():
                if self.versions[slot] == 0:  # not written since the open
                    self.hot.setdefault(slot, {})[path] = size
        self.scanned = True

    # ---- the background thread ----------------------------------------------------------------

    def _wake(self) -> None:
        """Have the background thread look for work, starting it if needed."""
        self._wakeup.set()
        if self._thread is None or not self._thread.is_alive():
            self._stopped = False
            # the thread holds the tier only while it compacts: a writer dropped without close()
            # (the tier's arrays refer to its storage) is then collected, its lease given back,
            # and the tier's death wakes the thread to end
            wakeup = self._wakeup
            tier = weakref.ref(self, lambda _: wakeup.set())
            self._thread = threading.Thread(
                target=_compact_in_background, args=(tier, wakeup), name="replaybuf-compactor", daemon=True
            )
            self._thread.start()

    def _compact_pending(self) -> bool:
        """Compact leftovers of a killed writer, then the oldest committed hot episodes while
        their bytes exceed ``hot_bytes``; False once the thread should end (stopped, or failed)."""
        if self._stopped:
            return False
        try:
            # a killed writer's leftovers go first, whatever the hot bytes; this writer's own
            # episodes stay hot until they exceed them (the thread may scan after it wrote some)
            if not self.scanned:
                self._scan()
                while not self._stopped and (slot := self._next(leftovers=True)) is not None:
                    self._compact_slot(slot, self.done)
            while not self._stopped and (slot := self._next()) is not None:
                self._compact_slot(slot, self.done)
        except Exception as e:  # noqa: BLE001 - a shard left hot reads back the same
            warnings.warn(f"background compaction of {self.kv.where('')!r} stopped: {e}", stacklevel=1)
            return False
        return True

    def stop(self) -> None:
        """Stop the background thread after the shard it is compacting (it restarts when work
        comes); the tier's bookkeeping stays."""
        self._stopped = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None


def _compact_in_background(tier: weakref.ref[HotTier], wakeup: threading.Event) -> None:
    """The background thread of a `HotTier`: compact when woken, until the tier stops or is gone."""
    while True:
        wakeup.wait()
        wakeup.clear()
        alive = tier()
        if alive is None or not alive._compact_pending():
            return
        del alive
