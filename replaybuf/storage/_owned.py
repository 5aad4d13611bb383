"""What a buffer owns at its location, so that creating one (``overwrite=True``) erases only that.

Each backend names the top-level entries of its own layout (``owns``); anything else found at
the location (a user's file or folder, another program's objects, a whole bucket's worth of
keys) is *foreign*, and creating a buffer there is refused before anything is deleted.
Everything under a buffer's own folders belongs to it. Under ``replaybuf/`` erasing deletes
the counters, the attributes, the step log, the statistics sketches and the named snapshots
(both name slots and generations of episodes erased with them) only: other objects
there (a writer's lease) belong to whoever holds them.
"""

from __future__ import annotations

from collections.abc import Callable

from ._kv import KeyValue
from .base import (
    ATTRS_KEY,
    EDIT_KEY,
    LOG_PREFIX,
    SKETCHES_PREFIX,
    SNAPSHOTS_PREFIX,
    STATE_KEY,
    UPGRADE_MARKER,
    WRITING_KEY,
)
from .lease import LEASE_KEY

BLOB_DIR = "replaybuf"
# blob folders of what a buffer derived from or recorded about its episodes, by slot and
# generation: erased first, so none outlives the episodes it names
EPISODE_BLOB_PREFIXES = (SNAPSHOTS_PREFIX, SKETCHES_PREFIX)
# foreign entries an error names; the rest are counted
NAMED_ENTRIES = 5


class ForeignEntriesError(FileExistsError):
    """The location holds files, folders or objects that are not part of a replaybuf buffer;
    creating a buffer there would erase them, so nothing was deleted or written."""


def is_temp_file(name: str) -> bool:
    """A temp file of an interrupted atomic write (``LocalKV``: ``.<random>.partial``)."""
    return name.startswith(".") and name.endswith(".partial")


# what replaybuf writes under ``replaybuf/`` before a create: the writer lease of the open (left
# by one killed there), and the record of the upgrade whose copy the create makes
BEFORE_CREATE = (LEASE_KEY, UPGRADE_MARKER)


def _blob_dir_is_a_leftover(kv: KeyValue) -> bool:
    """Whether ``replaybuf/`` at a location holding no buffer holds only what replaybuf writes
    there before a create (``BEFORE_CREATE``, and temp files)."""
    return all(key in BEFORE_CREATE or is_temp_file(key.rsplit("/", 1)[-1]) for key in kv.list_prefix(f"{BLOB_DIR}/"))


def check_owned(kv: KeyValue, location: str, owns: Callable[[str], bool], holds_buffer: bool) -> list[str]:
    """The top-level entries of ``kv`` (``KeyValue.list_top``), all owned by the buffer; raise
    ForeignEntriesError naming those ``owns`` (given a name without the trailing ``/`` of a
    folder) does not claim. Temp files of interrupted writes always belong to the buffer, and
    so does the blob folder ``replaybuf/`` where the location ``holds_buffer`` (a user's own
    ``replaybuf/`` folder elsewhere is not ours to erase, nor to write into) or where it holds
    only a killed open's writer lease; a file ``replaybuf`` there is the user's. PermissionError
    where they could not all be erased (``KeyValue.check_erasable``)."""
    entries = kv.list_top()

    def owned(entry: str) -> bool:
        name = entry.rstrip("/")
        if entry == BLOB_DIR and not holds_buffer:  # a file (or a link) named like our folder: the user's
            return False
        if name == BLOB_DIR:
            return holds_buffer or _blob_dir_is_a_leftover(kv)
        return is_temp_file(entry) or owns(name)

    foreign = [entry for entry in entries if not owned(entry)]
    if not foreign:
        kv.check_erasable(entries)
        return entries
    named = ", ".join(repr(entry) for entry in foreign[:NAMED_ENTRIES])
    if len(foreign) > NAMED_ENTRIES:
        named += f" and {len(foreign) - NAMED_ENTRIES} more"
    raise ForeignEntriesError(
        f"{location!r} holds entries that are not part of a replaybuf buffer: {named}. Creating a buffer "
        "there would erase them, so nothing was deleted; choose an empty or new folder (or prefix), "
        "or remove those entries first"
    )


def erase_owned(kv: KeyValue, entries: list[str], markers: tuple[str, ...], first: tuple[str, ...] = ()) -> None:
    """Delete the top-level ``entries`` ``check_owned`` returned, the ``first`` of them (the
    file whose identity a reader checks, ``LocalFolderStorage.identity_file``) first, so a
    reader of the buffer sees it replaced before anything else of it goes, and the ``markers``
    (the objects that make the location a buffer) last, so an erase cut short still reads as a
    buffer and the next overwrite finishes it. A link is removed, never what it points to
    (``LocalKV``)."""
    kv.delete_many([name for name in first if name in entries])
    if f"{BLOB_DIR}/" in entries:
        for prefix in EPISODE_BLOB_PREFIXES:
            kv.delete_prefix(prefix)
    for entry in entries:
        name = entry.rstrip("/")
        if name in markers or name in first:
            continue
        if entry == f"{BLOB_DIR}/":
            kv.delete_prefix(LOG_PREFIX)  # the counters, the attributes and the step log
            kv.delete_many([STATE_KEY, ATTRS_KEY, WRITING_KEY, EDIT_KEY])
        elif entry.endswith("/"):
            kv.delete_prefix(entry)
        else:
            kv.delete_many([name])
    kv.delete_many([m for m in markers if m in entries])
