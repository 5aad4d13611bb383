"""Whole-buffer tools: ``convert`` between backends and locations, ``upgrade`` to the newest
on-disk format, ``info`` and ``verify``.

They work on the Storage protocol, so any backend (including memmap-replay-buffer folders,
read through the memmap backend) can be a source, and any backend a destination. The
``replaybuf`` command line gets them as ``convert``, ``upgrade``, ``info``, ``verify`` and
``unlock`` subcommands (``CLI_COMMANDS``, registered by ``replaybuf.cli``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import glob
import json
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import editlog, metasums, snapshots
from .attrs import encode_attrs, load_attrs
from .commit import catch_up
from .inputs import check_flag
from .metasums import META_SUM
from .schema import Field, Schema, parse_compressor
from .storage import detect_backend, missing_folder_hint, new_uuid, object_store_endpoint, seed_h5_hint
from .storage.base import (
    ATTRS_KEY,
    LOG_PREFIX,
    STATE_KEY,
    UPGRADE_MARKER,
    BufferDamagedError,
    ChecksumEntryError,
    ChunkChecksumError,
    CorruptChunkError,
    EpisodeLengthError,
    GenerationMismatchError,
    LostLengthError,
    NewerFormatError,
    Storage,
    StorageError,
    UnfinishedEditError,
    backend_class,
    bookkeeping_fields,
    check_bookkeeping,
    check_lost_lengths,
    check_state,
    committed_without_length,
    make_storage,
    refuse_empty_location,
    unpublished_slots,
)
from .storage.lease import BufferLockedError, describe_holder

# episodes copied per slab: about this many bytes of one field in RAM at a time
CONVERT_SLAB_BYTES = 64 << 20
# inside a destination while ``convert`` copies into it, deleted once the copy is complete: a
# killed convert leaves it, so ``info`` and ``verify`` say the buffer is an unfinished copy
CONVERT_MARKER = "replaybuf/converting/record.json"


class WriterOutpacedError(RuntimeError):
    """A live writer changed the buffer faster than a command could read it, through every
    bounded retry; nothing was written. Retry, or stop the writer (the command line exits 1)."""


__all__ = [
    "CLI_COMMANDS",
    "UnfinishedEditError",
    "WriterOutpacedError",
    "convert",
    "format_info",
    "info",
    "unlock",
    "upgrade",
    "verify",
]


# ---- opening ----------------------------------------------------------------------------------


def _open_read_only(
    location: str | os.PathLike | Storage, storage_options: dict | None = None
) -> tuple[Storage, Schema]:
    """A storage opened read-only (nothing written, whatever the backend) and its schema."""
    storage = make_storage(location, None, storage_options)
    if not storage.exists():
        raise FileNotFoundError(
            f"no replaybuf or memmap-replay-buffer buffer at {storage.location!r}" + _not_found_hint(storage)
        )
    return storage, storage.open(read_only=True)


def _not_found_hint(storage: Storage) -> str:
    """What a location holding no buffer may hold instead, as the end of a message: the
    original of a buffer an upgrade left, or a folder of the seed's ReplayBufferH5PY."""
    from .actors import shards_hint  # actors imports the buffer, which imports this module

    return (
        missing_folder_hint(storage.location)
        + _stranded_hint(storage)
        + seed_h5_hint(storage.location)
        + shards_hint(storage.location)
    )


def _stranded_hint(storage: Storage) -> str:
    """Where an upgrade killed between its two renames left the original of the missing local
    buffer ``storage`` (``.<name>.format<N>-<pid>`` beside it), as the end of a message."""
    if not storage.is_local:
        return ""
    folder = os.path.realpath(storage.location.removeprefix("file://"))
    left = upgrade_backups(folder)
    if not left:
        return ""
    return (
        f"; an upgrade (or convert --overwrite) stopped between its renames left the original at {left[-1]!r}: "
        f"rename it back to {folder!r} (and run the upgrade again)"
    )


def _unfinished_copy(storage: Storage) -> str | None:
    """The problem of a buffer a killed ``convert`` left unfinished (``CONVERT_MARKER``), else None."""
    if not storage.list_blobs(os.path.dirname(CONVERT_MARKER) + "/"):
        return None
    try:
        record = json.loads(storage.read_blob(CONVERT_MARKER) or b"{}")
    except (ValueError, RecursionError, BufferDamagedError):  # RecursionError: nested too deep
        record = {}
    source = record.get("from") if isinstance(record, dict) else None
    return (
        f"{storage.location!r} is an unfinished copy: a `replaybuf convert`"
        + (f" from {source!r}" if source else "")
        + " stopped before it published every episode; run that convert again with --overwrite"
    )


def _lens(storage: Storage) -> np.ndarray:
    return storage.read_meta("episode_lens").astype(np.int64)


def _checked_lens_and_state(storage: Storage, schema: Schema) -> tuple[np.ndarray, dict]:
    """The lengths and counters of an opened buffer, checked as an open checks them
    (BufferDamagedError naming what is wrong): what ``info`` reports and ``convert`` copies."""
    for _ in range(_BOOKKEEPING_READS):  # a live writer commits between the two reads: again
        lens, generations = _lens(storage), storage.read_meta("_generation")
        if not _midway(lens, generations) and np.array_equal(_lens(storage), lens):
            break
        time.sleep(0.01)
    else:
        if storage.writer_lease().live_holder() is not None:  # caught midway every time: not damage
            raise WriterOutpacedError(
                f"a writer committed to {storage.location!r} faster than its lengths could be read "
                f"({_BOOKKEEPING_READS} reads); nothing was written: retry"
            )
    check_bookkeeping(lens, generations, schema, storage.location)
    state = check_state(storage.load_state(), schema, storage.describe_key(STATE_KEY))
    check_lost_lengths(storage, lens, generations, state)
    return lens, state


# ---- convert ---------------------------------------------------------------------------------------


def _parse_chunks(chunks: dict[str, int] | Iterable[str] | None, schema: Schema) -> dict[str, int]:
    """``{'field': T}`` or ``['field=T', ...]`` into a checked dict of time chunks per data field."""
    if chunks is None:
        return {}
    if not isinstance(chunks, dict):
        parsed = {}
        for item in chunks:
            name, sep, value = str(item).partition("=")
            if not sep or not value.strip().isdigit():
                raise ValueError(f"chunks: expected 'field=TIMESTEPS' such as 'state=10', got {item!r}")
            parsed[name.strip()] = int(value)
        chunks = parsed
    unknown = sorted(set(chunks) - set(schema.fields))
    if unknown:
        raise ValueError(f"chunks: unknown data fields {unknown}; data fields are {sorted(schema.fields)}")
    for name, steps in chunks.items():
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"chunks: field {name!r} needs a positive number of timesteps, got {steps!r}")
    return dict(chunks)


def _destination_schema(
    schema: Schema, backend: str, chunks: dict[str, int], compressor: str | dict[str, str] | None
) -> Schema:
    """The source schema with the requested chunking and compression."""
    codecs = getattr(backend_class(backend), "supports_field_codecs", False)
    all_fields = {**schema.fields, **schema.meta_fields}
    if isinstance(compressor, dict):
        unknown = sorted(set(compressor) - set(all_fields))
        if unknown:
            raise ValueError(f"compressor: unknown fields {unknown}; fields are {sorted(all_fields)}")
    if compressor is not None and not codecs:
        raise ValueError(
            f"compressor={compressor!r}: the {backend!r} backend does not take per-field compressors; "
            "pass its own options through dst_storage_options (hdf5: {'compression': 'gzip'})"
        )

    def adjust(field: Field) -> Field:
        wanted = compressor.get(field.name) if isinstance(compressor, dict) else compressor
        if wanted is not None:
            parse_compressor(wanted, field.name)
        return dataclasses.replace(
            field,
            chunks=chunks.get(field.name, field.chunks) if field.name in schema.fields else field.chunks,
            compressor=(wanted or field.compressor) if codecs else None,
        )

    return dataclasses.replace(
        schema,
        fields={n: adjust(f) for n, f in schema.fields.items()},
        meta_fields={n: adjust(f) for n, f in schema.meta_fields.items()},
    )


def _slabs(slots: np.ndarray, lens: np.ndarray, schema: Schema) -> Iterable[np.ndarray]:
    """Groups of slots whose rows of the widest field fit in about CONVERT_SLAB_BYTES."""
    widest = max(f.step_nbytes for f in schema.fields.values())
    per_slab = max(1, CONVERT_SLAB_BYTES // max(widest * max(int(lens.max(initial=1)), 1), 1))
    for start in range(0, len(slots), per_slab):
        yield slots[start : start + per_slab]


# URL schemes that name the same kind of store
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "file": ""}


def _resolved(location: str | os.PathLike, options: dict | None) -> str:
    """One spelling of a location, so that two spellings of one place compare equal: a local
    path (``file://`` or not) as its real path, links and ``..`` resolved; a URL with its
    scheme's usual name (``s3a`` is ``s3``), no empty path parts (trailing or doubled ``/``),
    led by its endpoint when one is given (spelled one way: ``object_store_endpoint``)."""
    if not isinstance(location, str | bytes | os.PathLike):  # os.fspath names neither the argument nor a path
        raise TypeError(
            f"expected a folder path or URL (a str or os.PathLike) for source and destination, got "
            f"{type(location).__name__} {location!r}"
        )
    text = os.fspath(location)
    refuse_empty_location(text)
    scheme, sep, rest = text.partition("://")
    scheme = _SCHEME_ALIASES.get(scheme.lower(), scheme.lower()) if sep else ""
    if not scheme:
        return os.path.realpath(rest if sep else text)
    endpoint = object_store_endpoint(text, options)  # endpoint_url or client_kwargs' or the environment's
    parts = [f"[{endpoint}]"] if endpoint else []
    return f"{scheme}://" + "/".join(parts + [part for part in rest.split("/") if part])


def check_apart(
    src: str | os.PathLike,
    src_options: dict | None,
    dst: str | os.PathLike,
    dst_options: dict | None,
    command: str = "convert",
) -> None:
    """Refuse a destination that is the source, or inside it, or that holds it: creating the
    destination would erase or overwrite the source (checked before anything is written).
    ``command`` leads the message (``convert``, ``import``)."""
    source, target = _resolved(src, src_options), _resolved(dst, dst_options)
    spelled = f"({os.fspath(src)!r} -> {os.fspath(dst)!r})"
    if source == target:
        raise ValueError(
            f"{command}: source and destination are the same location {source!r} {spelled}; choose another destination"
        )
    if target.startswith(source.rstrip("/") + "/"):
        raise ValueError(
            f"{command}: the destination {target!r} is inside the source {source!r} {spelled}; choose a destination outside it"
        )
    if source.startswith(target.rstrip("/") + "/"):
        raise ValueError(
            f"{command}: the source {source!r} is inside the destination {target!r} {spelled}, which creating the "
            "copy would erase; choose a destination outside it"
        )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    backend: str = "zarr",
    chunks: dict[str, int] | Sequence[str] | None = None,
    compressor: str | dict[str, str] | None = None,
    storage_options: dict | None = None,
    dst_storage_options: dict | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
) -> dict:
    """Copy the buffer at ``src`` (any backend, or a memmap-replay-buffer folder) to ``dst``.

    Every committed episode keeps its slot, meta values and chronological order, and the
    counters are carried over, so the copy continues exactly where the source stood; the copy
    is a buffer of its own (a new uuid, which zarr binds its shards to). Episodes
    stream in slabs of about 64 MB; the copy is checked (episodes, lengths, order) at the end.
    A buffer holding an in-place edit a stopped writer left unfinished is refused
    (``UnfinishedEditError``, ``check_no_unfinished_edit``): the next writable open finishes it.

    Parameters
    ----------
    backend
        The destination backend: 'zarr' (local path or URL), 'memmap' or 'hdf5'.
    chunks
        Time steps per chunk for data fields, ``{'state': 10}`` or ``['state=10']``.
    compressor
        ``'zstd:5'`` / ``'none'`` for every field, or a dict per field (zarr only).
    storage_options, dst_storage_options
        Options of the source and destination stores (endpoints, credentials, hdf5 compression).
    overwrite
        Replace a buffer already at ``dst``; otherwise an existing destination is an error. A
        local folder's buffer is replaced only once the copy is complete (built beside it and
        swapped in, ``_convert_beside``): a copy that fails leaves it as it was. On an object
        store (no atomic swap) it is erased when the copy is created, after every check that
        can be made before.
    progress
        A tqdm bar over the episodes copied: ``None`` shows it on a terminal for copies longer
        than two seconds, ``True`` always, ``False`` never (``replaybuf.progress``).

    Returns a summary: destination, backend, episodes and timesteps copied, snapshots carried.
    """
    from .progress import check_progress

    check_progress(progress)
    check_flag("overwrite", overwrite)
    check_apart(src, storage_options, dst, dst_storage_options)
    source, schema = _open_read_only(src, storage_options)
    target_schema = _destination_schema(schema, backend, _parse_chunks(chunks, schema), compressor)
    # the copy is a buffer of its own, as any new one: zarr binds its shards to this uuid, so
    # neither the source's shards nor those of another copy of it read as the copy's
    target_schema = dataclasses.replace(target_schema, uuid=new_uuid())
    target = make_storage(dst, backend, dst_storage_options)
    other = detect_backend(target.location, dst_storage_options)
    if other is not None and other != target.backend_name:  # "open it with backend=...", said below
        raise FileExistsError(
            f"convert: {target.location!r} holds a {other!r} buffer, and a copy of backend {backend!r} replaces "
            f"only a buffer of its own backend; delete that buffer first, or convert to backend {other!r} "
            f"(--backend {other})"
        )
    if not overwrite and target.exists():
        raise FileExistsError(
            f"convert: a buffer already exists at {target.location!r}; pass overwrite=True (--overwrite) to replace it"
        )
    # what creating the copy there would erase, refused (another backend's buffer, foreign
    # entries, a buffer around it) before the lease and before anything is erased or written
    target.check_creatable()
    folder = _swappable_folder(target.location) if overwrite else None
    staging = None if folder is None else _staging_folder(folder)
    writer = target if staging is None else make_storage(staging, backend, dst_storage_options)
    try:
        # before the lease: a copy the backend cannot create writes nothing (a copy built beside
        # the destination needs room beside the buffer it replaces, which it deletes only after)
        writer.check_schema(target_schema)
    except StorageError as e:
        if staging is None:
            raise
        raise StorageError(
            f"{e} (convert --overwrite builds the copy beside {folder!r} and deletes the buffer there only once "
            "the copy is complete, so the two must fit at once; or delete that buffer first and convert without "
            "--overwrite)"
        ) from e
    lens, state = _checked_lens_and_state(source, schema)
    # slots and generations are kept, so snapshots stay true as they are; damaged ones, and
    # per-episode values that fail their checksums, are refused here, before anything is written
    held = {name: snapshots.load(source, name, schema) for name in snapshots.names(source)}
    attrs = load_attrs(source)  # damaged ones are refused here too
    bookkeeping, found, _ = _read_bookkeeping(source, schema)
    if found:
        raise BufferDamagedError(f"convert: {source.location!r}: " + "; ".join(found) + "; nothing was written")
    check_no_unfinished_edit(source, schema, bookkeeping, lens, "convert", os.fspath(src))
    copy = functools.partial(
        _write_copy, source, schema=schema, target_schema=target_schema, held=held, attrs=attrs, src=src
    )
    if folder is not None and staging is not None:
        plan, lens, state, copied = _convert_beside(
            copy, target, writer, folder, staging, dst_storage_options, lens, state, progress
        )
    else:
        plan, lens, state, copied = _convert_in_place(copy, target, dst, dst_storage_options, lens, state, progress)
    slots = np.flatnonzero(lens > 0)
    source.close()
    return {
        "destination": target.location,
        "backend": backend,
        "episodes": int(len(slots)),
        "timesteps": int(lens[slots].sum()),
        "snapshots": sorted(held),
        **copied,
    }


def _write_copy(
    source: Storage,
    target: Storage,
    lens: np.ndarray,
    state: dict,
    progress: bool | None,
    *,
    schema: Schema,
    target_schema: Schema,
    held: dict,
    attrs: dict,
    src: str | os.PathLike,
) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """Create the copy in ``target`` (whose writer lease the caller holds) and write every
    committed episode of ``source``, its meta values, attributes, snapshots and counters, the
    lengths (which publish the episodes) last; ``_copy_episodes``'s plan, lengths and counters."""
    target.create(target_schema, overwrite=True)
    record = {"from": os.fspath(src), "host": socket.gethostname(), "pid": os.getpid()}
    target.write_blob(CONVERT_MARKER, json.dumps(record).encode())
    plan, lens, state = _copy_episodes(source, target, schema, lens, state, progress)
    # the checksums of the values as copied (checked in the source, where it keeps them)
    # (the copy's own: its uuid, which zarr binds them to, is new)
    summed = metasums.summed(target_schema, target)
    plan[META_SUM] = metasums.entries(
        np.arange(schema.max_episodes), plan["_generation"], {**plan, "episode_lens": lens}, summed
    )
    meta_names = list(schema.meta_fields) + [n for n in bookkeeping_fields(schema) if n != "episode_lens"]
    every_slot = np.arange(schema.max_episodes)
    for name in [*meta_names, "episode_lens"]:  # the lengths last: the episodes are published
        target.write_meta(name, every_slot, plan[name] if name in plan else source.read_meta(name))
    if attrs:
        target.write_blob(ATTRS_KEY, encode_attrs(attrs))
    for name, snapshot in held.items():
        target.write_blob(snapshots.key(name), snapshots.encode(snapshot))
    target.commit_state(state)
    target.flush()
    target.delete_blobs(os.path.dirname(CONVERT_MARKER) + "/")  # complete
    target.close()
    return plan, lens, state


def _convert_in_place(
    copy: Any,
    target: Storage,
    dst: str | os.PathLike,
    options: dict | None,
    lens: np.ndarray,
    state: dict,
    progress: bool | None,
) -> tuple[dict[str, np.ndarray], np.ndarray, dict, dict]:
    """Write the copy straight into ``target``, erasing the buffer there first: a new
    destination, a remote one (an object store has no atomic swap) or a local folder that
    cannot be swapped (``_swappable_folder``). Returns ``copy``'s results and ``_check_copy``'s."""
    made = _new_local_folders(target.location)
    # outside the try: a refusal (another process writes there) deletes nothing of its
    try:
        target.acquire_writer(erase=True)
    except BaseException:
        remove_empty(made)  # still empty: the other process did not take them
        raise
    try:
        plan, lens, state = copy(target, lens, state, progress)
    except BaseException:
        # a copy cut short (a full disk, an interrupt) leaves no half buffer in a folder it made
        with contextlib.suppress(Exception):
            target.close()
        if made:
            shutil.rmtree(made[0], ignore_errors=True)
            remove_empty(made[1:])
        raise
    finally:
        target.release_writer()
    checked = _check_copy(dst, target.backend_name, options, lens, plan["_generation"], state)
    return plan, lens, state, checked


def _swappable_folder(location: str) -> str | None:
    """The real path of the existing local folder ``location``, where ``convert --overwrite``
    builds its copy in a folder beside it and swaps the two (``_convert_beside``), else None: a
    remote location, a new folder (nothing to keep), a mount point (a folder beside it is on
    another file system) or one in a folder this process may not write in."""
    if "://" in location and not location.startswith("file://"):
        return None
    folder = os.path.realpath(location.removeprefix("file://"))
    parent = os.path.dirname(folder)
    try:
        if parent == folder or not os.path.isdir(folder) or os.stat(folder).st_dev != os.stat(parent).st_dev:
            return None
    except OSError:
        return None
    return folder if os.access(parent, os.W_OK | os.X_OK) else None


def _staging_folder(folder: str) -> str:
    """Where ``convert --overwrite`` builds the copy that replaces ``folder``: an upgrade's copy
    (``.<name>.upgrading-<pid>`` beside it, marked), so ``info`` reports the copy a killed
    convert leaves and the next convert or upgrade of ``folder`` deletes it."""
    parent, name = os.path.split(folder)
    return os.path.join(parent, f".{name}.upgrading-{os.getpid()}")


def _convert_beside(
    copy: Any,
    target: Storage,
    writer: Storage,
    folder: str,
    staging: str,
    options: dict | None,
    lens: np.ndarray,
    state: dict,
    progress: bool | None,
) -> tuple[dict[str, np.ndarray], np.ndarray, dict, dict]:
    """Replace the local ``folder`` (``target``) by its copy without erasing it first: the copy
    is built in ``staging`` beside it (through ``writer``), checked, swapped in by one atomic
    exchange of the two folders (``_exchange``; two renames where the system has none) and the
    old buffer deleted after (``_discard_original``), all under ``target``'s writer lease, as
    ``upgrade`` does. A copy that fails at any point (a damaged source episode, a full disk, an
    interrupt) leaves ``folder`` as it was and deletes ``staging`` (a killed one leaves it
    marked, for the next convert or upgrade of ``folder`` to delete)."""
    parent, name = os.path.split(folder)
    backup = os.path.join(parent, f".{name}.replaced-{os.getpid()}")
    marker = os.path.join(staging, *UPGRADE_MARKER.split("/"))
    target.acquire_writer(erase=True)  # a live writer refuses the convert, and none starts meanwhile
    made = False  # the copy's folder is this convert's: only then is it deleted on failure
    try:
        _remove_dead_upgrades(folder)
        for path in (staging, backup):
            if os.path.lexists(path):
                raise FileExistsError(
                    f"convert: {path!r}, where this convert would build or move aside the buffer at {folder!r}, "
                    "already exists; nothing was changed: remove it if no convert or upgrade is running"
                )
        os.makedirs(os.path.dirname(marker))
        made = True
        with contextlib.suppress(OSError):  # the copy keeps the folder's permissions
            os.chmod(staging, stat.S_IMODE(os.stat(folder).st_mode))
        with open(marker, "w") as f:
            json.dump(_upgrade_record(folder), f)
        writer.acquire_writer(erase=True)
        try:
            plan, lens, state = copy(writer, lens, state, progress)
        except BaseException:
            with contextlib.suppress(Exception):
                writer.close()
            raise
        finally:
            writer.release_writer()  # before the swap: its lock file is not left in the new buffer
        checked = _check_copy(staging, writer.backend_name, options, lens, plan["_generation"], state)
        os.unlink(marker)  # the copy becomes the buffer: nothing of the convert stays in it
        moved = _swap_in(staging, folder, backup, "convert", ("the buffer it replaced", "the copy"))
        made = False  # from here the copy is kept whatever happens: the original has moved
    except BaseException as error:
        if made and not isinstance(error, _CopyKept) and os.path.isdir(staging) and os.path.isdir(folder):
            with contextlib.suppress(OSError):
                _remove_marked(staging)
        raise
    finally:
        target.release_writer()  # its lock file moved with the replaced buffer
    # (the destination as spelled too: a link to ``folder`` keys its files under the link)
    from .storage import forget_files_under  # (imports the hot tier's maps only here)

    forget_files_under(folder, staging, os.path.abspath(target.location.removeprefix("file://")))
    _discard_original(folder, moved, staging)
    return plan, lens, state, checked


def _new_local_folders(location: str) -> list[str]:
    """Make the folder of a local ``location`` that does not exist yet, and its missing
    parents; return the folders made, the destination first and then its parents upwards (all
    of them convert's own: each made by one ``mkdir``, so a second convert racing to the same
    new destination does not count one as its own too). Empty when the destination exists or
    is remote, or a folder cannot be made here (taking the writer lease then says so, naming
    the folder)."""
    if "://" in location and not location.startswith("file://"):
        return []
    folder = os.path.abspath(location.removeprefix("file://"))
    made: list[str] = []
    try:
        for path in [*reversed(missing_parents(folder)), folder]:
            try:
                os.mkdir(path)
            except FileExistsError:  # made meanwhile by another process: not ours
                if path == folder:
                    raise
                continue
            made.insert(0, path)
    except OSError:  # the destination exists (a folder, a file, a link), or not writable here
        remove_empty(made)
        return []
    return made


def missing_parents(path: str | os.PathLike) -> list[str]:
    """The parent folders of ``path`` that do not exist yet, nearest first."""
    missing = []
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        missing.append(parent)
        parent = os.path.dirname(parent)
    return missing


def remove_empty(folders: Sequence[str]) -> None:
    """Remove each of ``folders`` (deepest first) that is still empty; keep the others."""
    for path in folders:
        with contextlib.suppress(OSError):
            os.rmdir(path)


# rounds of copying the episodes a live writer replaced meanwhile before ``convert`` gives up
CONVERT_ROUNDS = 4


def _copy_episodes(
    source: Storage, target: Storage, schema: Schema, lens: np.ndarray, state: dict, progress: bool | None
) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """Copy the rows of every committed episode of ``source`` into ``target``, publishing none.

    A writer may commit to the source meanwhile: once the rows are copied, the source's
    bookkeeping is read again, and the episodes replaced or edited since their rows were read
    (or committed since) are copied again, until a read finds every committed episode copied as
    it stands. Returns that read (every per-episode array), its lengths and its counters
    (caught up with it), which the copy publishes; raises before anything is published when
    the writer outruns ``CONVERT_ROUNDS`` rounds."""
    from .progress import progress_bar

    time_chunks = {n: target.time_chunk(n) for n in schema.fields}
    copied: dict[int, tuple[int, ...]] = {}  # slot -> its bookkeeping when its rows were read
    widths = np.zeros(schema.max_episodes, np.int64)  # rows of each slot written in target so far
    plan: dict[str, np.ndarray] = {}
    with progress_bar(
        progress, total=int((lens > 0).sum()), unit="episode", desc=f"convert -> {target.backend_name}"
    ) as bar:
        for _ in range(CONVERT_ROUNDS):
            if plan:
                state = check_state(source.load_state(), schema, source.describe_key(STATE_KEY))
            plan, found, flux = _read_bookkeeping(source, schema)
            if found:
                raise BufferDamagedError(f"convert: {source.location!r}: " + "; ".join(found))
            lens = plan["episode_lens"].astype(np.int64)
            check_bookkeeping(lens, plan["_generation"], schema, source.location)
            keys = {int(s): _slot_key(plan, int(s)) for s in np.flatnonzero(lens > 0)}
            # a slot in the middle of an in-place edit (odd revision) is copied again until the
            # live writer's edit is done; a stopped writer's is refused (it would stay half applied)
            check_no_unfinished_edit(source, schema, plan, lens, "convert", source.location)
            editing = (
                set(np.flatnonzero((plan["_revision"] % 2 == 1) & (lens > 0)).tolist())
                if "_revision" in plan
                else set()
            )
            todo = np.array([s for s, key in keys.items() if copied.get(s) != key or s in editing], np.int64)
            if not len(todo) and not flux:  # every committed episode of this read is copied as it stands
                break
            for slab in _slabs(todo, lens[todo], schema):
                # rows a longer episode left in a slot copied before are overwritten too
                longest = int(np.maximum(lens[slab], widths[slab]).max())
                widths[slab] = np.maximum(widths[slab], longest)
                try:
                    target.plan_generations(slab, plan["_generation"][slab])  # the copies are of those episodes
                    for name in schema.fields:
                        chunk = time_chunks[name]
                        stop = min(-(-longest // chunk) * chunk, schema.max_timesteps)
                        target.write_rows(name, slab, 0, source.read_rows(name, slab, 0, stop))
                except (CorruptChunkError, GenerationMismatchError):
                    if not _changed_slots(source, plan) & set(slab.tolist()):
                        raise  # damage, not a writer replacing the episodes: refused
                    continue  # read while a writer replaced some: copied again next round
                copied.update((int(s), keys[int(s)]) for s in slab)
                bar.update(len(slab))
        else:
            edited = f" (slots {sorted(editing)} were in the middle of an in-place edit)" if editing else ""
            raise WriterOutpacedError(
                f"convert: a writer replaced episodes of {source.location!r} faster than they could be copied "
                f"({CONVERT_ROUNDS} rounds){edited}; nothing was published in {target.location!r}: stop the writer "
                "(or copy when it commits less often) and run convert again with overwrite=True"
            )
    return plan, lens, catch_up(state, lens, plan["_generation"], schema.max_episodes)


def _slot_key(meta: dict[str, np.ndarray], slot: int) -> tuple[int, ...]:
    """A slot's bookkeeping (``_SLOT_KEYS``): it changes whenever a writer replaces or edits it."""
    return tuple(int(meta[name][slot]) for name in _SLOT_KEYS if name in meta)


def _upgrade_record(folder: str) -> dict:
    """Who is upgrading ``folder``: the record of an upgrade's marker."""
    return {"of": folder, "host": socket.gethostname(), "pid": os.getpid()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def upgrade_leftovers(folder: str) -> tuple[list[str], list[str]]:
    """The copies upgrades of ``folder`` left beside it (``.<name>.upgrading-<pid>``): those
    provably of a dead upgrade (the name, a marker inside naming ``folder``, this host, a pid no
    process has), and the others (a running upgrade's, or not provably an upgrade's)."""
    parent, name = os.path.split(folder)
    dead: list[str] = []
    others: list[str] = []
    for path in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.upgrading-*"))):
        pid = path.rsplit("-", 1)[1]
        try:
            with open(os.path.join(path, *UPGRADE_MARKER.split("/")), "rb") as f:
                record = json.loads(f.read(1 << 16))  # a marker is ~100 bytes: more is not one
        except (OSError, ValueError, RecursionError):
            record = None
        ours = (
            not os.path.islink(path)
            and not os.path.islink(os.path.join(path, os.path.dirname(UPGRADE_MARKER)))
            and os.path.isdir(path)
            and isinstance(record, dict)
            and pid.isdigit()
            and record == {**_upgrade_record(folder), "pid": int(pid)}
        )
        (dead if ours and not _pid_alive(int(pid)) else others).append(path)
    return dead, others


def upgrade_backups(folder: str) -> list[str]:
    """The originals upgrades of ``folder`` moved aside beside it (``.<name>.format<N>-<pid>``
    folders; ``.<name>.replaced-<pid>`` for a ``convert --overwrite``): kept by ``keep_backup``,
    or left by an upgrade (or convert) killed after its first rename and before it marked the
    original for deletion (``_discard_original``)."""
    parent, name = os.path.split(folder)
    found = [
        path
        for pattern in (f".{glob.escape(name)}.format*-*", f".{glob.escape(name)}.replaced-*")
        for path in glob.glob(os.path.join(glob.escape(parent), pattern))
    ]
    return sorted(path for path in found if os.path.isdir(path) and not os.path.islink(path))


def _remove_marked(path: str) -> None:
    """Delete an upgrade's folder ``path`` with its marker last, so a kill part-way leaves it
    still provably an upgrade's (``upgrade_leftovers``) for the next upgrade to finish."""
    marker = os.path.join(path, *UPGRADE_MARKER.split("/"))
    for entry in os.scandir(path):
        if entry.name == os.path.dirname(UPGRADE_MARKER) and entry.is_dir(follow_symlinks=False):
            for inner in os.scandir(entry.path):
                if inner.path != marker:
                    _remove_entry(inner)
        else:
            _remove_entry(entry)
    shutil.rmtree(path)


def _remove_entry(entry: os.DirEntry) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path)
    else:
        os.unlink(entry.path)


def _remove_dead_upgrades(folder: str) -> list[str]:
    """Delete the copies of killed upgrades of ``folder`` (``upgrade_leftovers``: the process
    named in each one's marker is gone) and return them."""
    dead = upgrade_leftovers(folder)[0]
    for path in dead:
        _remove_marked(path)
    return dead


def _discard_original(folder: str, backup: str, marked: str) -> None:
    """Delete the original of an upgraded ``folder``, moved to ``backup``: first marked and
    renamed as an upgrade's copy (``marked``, free once the copy was swapped in), so that a kill
    while it is deleted leaves a folder ``info`` reports and the next upgrade removes, never a
    hidden full-size one."""
    marker = os.path.join(backup, *UPGRADE_MARKER.split("/"))
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            json.dump(_upgrade_record(folder), f)
        os.rename(backup, marked)
    except OSError:  # a full disk (the copy took the space): the upgrade is done, delete it as it is
        shutil.rmtree(backup)
        return
    _remove_marked(marked)


# renameat2's flag swapping two paths atomically (Linux 3.15+, glibc 2.28+; local file systems)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(one: str, other: str, command: str = "upgrade") -> bool:
    """Swap the folders ``one`` and ``other`` in one atomic step (``renameat2`` with
    ``RENAME_EXCHANGE``); False, with nothing changed, where the system or file system has no
    such call (then two renames swap them, leaving neither name for an instant)."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(one), _AT_FDCWD, os.fsencode(other), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):  # EPERM: a sandbox refusing the call
        return False
    raise OSError(code, f"{command}: swapping {one!r} and {other!r}: {os.strerror(code)}", one)


class _CopyKept(FileExistsError):
    """``_swap_in`` stopped after the original moved aside: the copy is kept, never deleted
    (its callers delete a copy they made only on other failures)."""


def _swap_in(staging: str, folder: str, backup: str, command: str, names: tuple[str, str]) -> str:
    """Put the finished copy ``staging`` at ``folder`` (``upgrade``, ``convert --overwrite``):
    one atomic swap where the system has it (``folder`` holds the original or the copy at every
    instant, the original at ``staging`` after it), else two renames through ``backup`` (a kill
    between them leaves no folder; the hints name the original there). Returns where the
    original is now. ``names``: the original's and the copy's, for the error when another process
    made ``folder`` between the renames (``_CopyKept``: both are kept)."""
    if _exchange(staging, folder, command):
        return staging
    os.rename(folder, backup)
    try:
        os.rename(staging, folder)
    except OSError as e:
        original, copy = names
        raise _CopyKept(
            f"{command}: {folder!r} was created by another process while the {command} swapped its copy in "
            f"({e.strerror}); nothing is lost: {original} is at {backup!r} and {copy} at "
            f"{staging!r}. Move the new {folder!r} away, then rename one of them to {folder!r}"
        ) from e
    return backup


def _check_upgrade_writable(folder: str) -> None:
    """PermissionError, before anything is written, where this process may not write in the
    folder holding ``folder`` or in any folder of the buffer: an upgrade writes its lease in the
    buffer, its copy beside it, renames both and deletes the original's files. Found by a
    failing write instead, the error named a lock file or the hidden copy; found by the
    deletion, the upgrade had swapped its copy in, and reported failure leaving the whole
    original behind as ``.<name>.upgrading-<pid>``."""
    folders = [os.path.dirname(folder), folder]
    for root, subfolders, _ in os.walk(folder):
        folders.extend(os.path.join(root, sub) for sub in subfolders)
    for where in folders:
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EACCES,
                f"upgrade: cannot write in {where!r}; an upgrade copies {folder!r} into a new folder beside it "
                "and swaps the two, so it needs write permission on the buffer's folder and on the folder "
                "holding it. Nothing was changed",
            )


def upgrade(path: str | os.PathLike, keep_backup: bool = False, progress: bool | None = None) -> dict:
    """Rewrite the local buffer at ``path``, written in an earlier on-disk format, in the newest
    format its backend writes (checksums, packed small fields, shards and meta checksums bound to
    the buffer), in place; the upgraded buffer has a new uuid (readers of the original see it
    replaced).

    Earlier formats open and write as they are; upgrading adds what they lack (a format 1
    buffer's reads are not checked against checksums). The buffer is copied with ``convert``
    (slots, order, meta values, counters, attributes and snapshots kept; codecs and chunking
    as stored) into a sibling folder, verified, and swapped in by one atomic exchange of the
    two folders (``renameat2``; two renames where the system has none), all under the
    buffer's writer lease: a writer holding it refuses the upgrade, and none can start
    meanwhile. Readers of the buffer must reopen it afterwards. A folder holding files that
    are not the buffer's is refused (they would be left behind in the backup). A buffer
    already in the newest format is left as it is.

    ``keep_backup``: keep the original folder as ``.<name>.format<N>-<pid>`` next to it (it is
    deleted otherwise). Swapped by two renames, a kill between them leaves both folders next
    to ``path`` under those names: rename the backup back to retry. A kill during the copy leaves the
    copy as ``.<name>.upgrading-<pid>`` (with a marker naming the buffer and process inside):
    the next upgrade deletes such copies once their process is gone, never another folder. The
    original, unless kept, is marked and renamed so before it is deleted: a kill then leaves
    the same kind of leftover (unmarked, if killed just after the swap), never a hidden copy
    nothing reports (``info`` lists them all).
    Returns what it did: location, backend, ``upgraded``, the format versions, episodes
    copied, the backup's path and the killed upgrades' copies it removed.
    """
    text = os.fspath(path)
    refuse_empty_location(text)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"upgrade: {text!r} is not a local folder; `replaybuf convert SRC DST` copies a remote buffer "
            "into the newest format at another location"
        )
    folder = os.path.realpath(text.removeprefix("file://"))
    parent, name = os.path.split(folder)
    storage, schema = _open_read_only(folder)
    backend, version, newest = storage.backend_name, storage.format_version, storage.newest_format_version
    if version is not None and version < newest:
        # before this upgrade takes the lease: under it, no writer reads as stopped (``_unfinished_edits``)
        check_no_unfinished_edit(
            storage, schema, _read_bookkeeping(storage, schema)[0], _lens(storage), "upgrade", text
        )
    storage.close()
    facts = {"location": folder, "backend": backend, "from_version": version, "to_version": newest}
    if version is None:
        raise ValueError(
            f"upgrade: {folder!r} is a memmap-replay-buffer folder, which replaybuf opens as it is; "
            f"`replaybuf convert {text} DST` copies it into a replaybuf buffer"
        )
    if version >= newest:
        removed = _remove_dead_upgrades(folder)
        return {**facts, "to_version": version, "upgraded": False, "episodes": 0, "backup": None, "removed": removed}
    owner = make_storage(folder, backend)
    holder = owner.writer_lease().holder()  # any writer, in this process too: its buffer would go
    if holder is not None:
        raise BufferLockedError(
            f"upgrade: {folder!r} is being written by {describe_holder(holder)}; close that writer first"
        )
    _check_upgrade_writable(folder)
    owner.acquire_writer()  # none starts meanwhile
    staging = os.path.join(parent, f".{name}.upgrading-{os.getpid()}")
    backup = os.path.join(parent, f".{name}.format{version}-{os.getpid()}")
    made = False  # the copy's folder is this upgrade's: only then is it deleted on failure
    try:
        owner.check_creatable()  # ForeignEntriesError: the user's files would stay in the backup
        if os.path.lexists(staging):
            raise FileExistsError(
                f"upgrade: {staging!r}, where this upgrade copies {folder!r}, already exists; it is left as "
                "it is: remove it if no upgrade is running"
            )
        if os.path.lexists(backup):  # an earlier --keep-backup by a process of the same pid
            raise FileExistsError(
                f"upgrade: {backup!r}, where this upgrade would move the original of {folder!r}, already exists "
                "(the backup of an earlier upgrade?); nothing was changed: move it away and run the upgrade again"
            )
        removed = _remove_dead_upgrades(folder)
        marker = os.path.join(staging, *UPGRADE_MARKER.split("/"))
        os.makedirs(os.path.dirname(marker))
        made = True
        with open(marker, "w") as f:
            json.dump(_upgrade_record(folder), f)
        copied = convert(folder, staging, backend=backend, progress=progress)
        problems = verify(staging, progress=False)
        if problems:
            raise BufferDamagedError(f"upgrade: the copy of {folder!r} failed its check: " + "; ".join(problems))
        os.unlink(marker)  # the copy becomes the buffer: nothing of the upgrade stays in it
        moved = _swap_in(staging, folder, backup, "upgrade", ("the original", "its upgraded copy"))
        made = False  # from here the copy is kept whatever happens: the original has moved
    except BaseException as error:
        if made and not isinstance(error, _CopyKept) and os.path.isdir(staging) and os.path.isdir(folder):
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        owner.release_writer()  # its lock file moved with the original folder
    if keep_backup and moved != backup:
        os.rename(moved, backup)
    elif not keep_backup:
        _discard_original(folder, moved, staging)
    return {
        **facts,
        "upgraded": True,
        "episodes": copied["episodes"],
        "backup": backup if keep_backup else None,
        "removed": removed,
    }


def _check_copy(
    dst: str | os.PathLike, backend: str, options: dict | None, lens: np.ndarray, generations: np.ndarray, state: dict
) -> dict:
    """Reopen the destination and compare counters, lengths and order with those of the source
    it copied."""
    copy = make_storage(dst, backend, options)
    copy.open(read_only=True)
    problems = []
    if not np.array_equal(_lens(copy), lens):
        problems.append("episode lengths differ")
    if not np.array_equal(copy.read_meta("_generation"), generations):
        problems.append("episode order (_generation) differs")
    copied_state = copy.load_state()
    if {k: copied_state.get(k) for k in state} != state:
        problems.append(f"counters differ: source {state}, copy {copied_state}")
    copy.close()
    if problems:
        raise RuntimeError(f"convert: the copy at {copy.location!r} does not match its source: " + "; ".join(problems))
    return {"verified": True}


# ---- info -------------------------------------------------------------------------------------------


def info(path: str | os.PathLike, storage_options: dict | None = None) -> dict:
    """What a buffer holds and how it is stored: schema, episodes, timesteps, per-field chunking,
    compressor, stored vs raw bytes and the compression ratio. Reads only."""
    storage, schema = _open_read_only(path, storage_options)
    described = storage.describe()
    lens, state = _checked_lens_and_state(storage, schema)
    valid = lens > 0
    arrays = described.get("arrays", {})
    fields, stored_total, data_total = {}, 0, 0
    for group, members, per_episode in (("data", schema.fields, False), ("meta", schema.meta_fields, True)):
        for name, field in members.items():
            facts = arrays.get(f"{group}/{name}", {})
            data_bytes = field.step_nbytes * int(valid.sum() if per_episode else lens[valid].sum())
            stored = facts.get("stored_bytes")
            fields[f"{group}/{name}"] = {
                "dtype": field.dtype.name,
                "shape": list(field.shape),
                "default": field.default,
                "chunks": None if facts.get("chunks") is None else list(facts["chunks"]),
                "shards": None if facts.get("shards") is None else list(facts["shards"]),
                "compressor": facts.get("compressor"),
                "stored_bytes": stored,
                "data_bytes": data_bytes,
                "allocated_bytes": facts.get("raw_bytes"),
            }
            stored_total += stored or 0
            data_total += data_bytes
    unfinished = _unfinished_copy(storage)
    hot = storage.hot_shards(np.flatnonzero(valid))
    attrs = load_attrs(storage)
    held_names = snapshots.names(storage)
    folder = os.path.realpath(storage.location.removeprefix("file://"))
    dead, others = upgrade_leftovers(folder) if storage.is_local else ([], [])
    backups = upgrade_backups(folder) if storage.is_local else []
    storage.close()
    return {
        "location": storage.location,
        "backend": storage.backend_name,
        "format": described.get("format"),
        "format_version": storage.format_version,
        "newest_format_version": storage.newest_format_version,
        "max_episodes": schema.max_episodes,
        "max_timesteps": schema.max_timesteps,
        "circular": schema.circular,
        "episodes": int(valid.sum()),
        "num_episodes": int(state["num_episodes"]),
        "timesteps": int(lens[valid].sum()),
        "fields": fields,
        "stored_bytes": stored_total,
        "data_bytes": data_total,
        "ratio": (data_total / stored_total) if stored_total else None,
        "hot_episodes": len(hot),
        "hot_bytes": sum(hot.values()),
        "attrs": attrs,
        "snapshots": held_names,
        "unfinished_copy": unfinished,
        "killed_upgrades": dead,
        "other_upgrade_copies": others,
        "upgrade_backups": backups,
    }


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_info(facts: dict) -> str:
    """``info()`` as the text ``replaybuf info`` prints."""
    ratio = "n/a" if facts["ratio"] is None else f"{facts['ratio']:.2f}x"
    lines = [
        f"buffer     {facts['location']}",
        f"backend    {facts['backend']}"
        + (f" ({facts['format']})" if facts["format"] else ""),  # a backend may name none
        *(
            [
                f"format     {facts['format_version']}, written by an earlier replaybuf: `replaybuf upgrade` "
                f"rewrites it in format {facts['newest_format_version']}"
            ]
            if facts.get("format_version") is not None
            and facts["format_version"] < facts.get("newest_format_version", facts["format_version"])
            else []
        ),
        f"episodes   {facts['episodes']} of {facts['max_episodes']} (max_timesteps {facts['max_timesteps']}, "
        f"circular {facts['circular']})",
        f"timesteps  {facts['timesteps']}",
        f"bytes      {_size(facts['data_bytes'])} of episode data stored in {_size(facts['stored_bytes'])} "
        f"(ratio {ratio})",
        *(
            [
                f"hot        {facts['hot_episodes']} episodes stored raw in {_size(facts['hot_bytes'])}, not yet compacted"
            ]
            if facts.get("hot_episodes")
            else []
        ),
        *([f"attrs      {', '.join(facts['attrs'])}"] if facts["attrs"] else []),
        *([f"snapshots  {', '.join(facts['snapshots'])}"] if facts.get("snapshots") else []),
        *([f"unfinished {facts['unfinished_copy']}"] if facts.get("unfinished_copy") else []),
        *(
            f"leftover   {path}: the copy of a killed upgrade or convert --overwrite; the next `replaybuf upgrade` "
            "or `convert --overwrite` of this buffer removes it"
            for path in facts.get("killed_upgrades", ())
        ),
        *(
            f"leftover   {path}: an upgrade's copy, of a running upgrade or not provably one's; "
            "remove it by hand if no upgrade is running"
            for path in facts.get("other_upgrade_copies", ())
        ),
        *(
            f"leftover   {path}: the original of an upgrade, moved aside (kept by --keep-backup, or left by an "
            "upgrade killed before deleting it); delete it once the upgraded buffer is checked"
            for path in facts.get("upgrade_backups", ())
        ),
        "",
        f"{'field':<24} {'dtype':<8} {'shape':<14} {'chunks (in shards)':<26} {'compressor':<10} {'data':>10} "
        f"{'stored':>10}",
    ]
    for name, f in facts["fields"].items():
        chunks = "contiguous" if f["chunks"] is None else "x".join(map(str, f["chunks"]))
        if f.get("shards"):
            chunks += " in " + "x".join(map(str, f["shards"][:2]))
        lines.append(
            f"{name:<24} {f['dtype']:<8} {str(tuple(f['shape'])):<14} {chunks:<26} "
            f"{str(f['compressor']):<10} {_size(f['data_bytes']):>10} {_size(f['stored_bytes']):>10}"
        )
    return "\n".join(lines)


# ---- verify ------------------------------------------------------------------------------------------


def _ranges(steps: np.ndarray) -> str:
    return f"{int(steps.min())}..{int(steps.max())}"


def verify(
    path: str | os.PathLike, storage_options: dict | None = None, repair: bool = False, progress: bool | None = None
) -> list[str]:
    """Problems found in the buffer at ``path`` (empty when consistent).

    Damaged metadata (unparseable config or counters, sizes or shapes the config does not
    allow) is reported as a problem, never raised; a buffer of a format newer than this
    replaybuf reads raises ``NewerFormatError`` (install a newer replaybuf), as every open does. Checks that every array is present with its
    configured shape and dtype, lengths are within
    ``max_timesteps``, the counters agree with the published lengths and the episode order,
    every committed episode reads back whole (checksums, codecs, no missing chunk: one line per
    damaged field and slot, naming its timesteps and file), committed episodes hold only zeros
    or their field's default beyond their length, no step log of an unfinished episode or
    in-place edit is left by a writer that stopped (a live writer's are its work in progress),
    and no symbolic link is inside the folder. On memmap and hdf5 (and zarr's packed
    small fields), a damaged checksum entry (``ChecksumEntryError``) or a damaged length
    (``EpisodeLengthError``: the data matches its checksum at another length) is reported as
    such, not as damaged data, and so
    is a zarr chunk whose own crc32c alone is damaged (``ChunkChecksumError``); a slot
    whose length is outside ``[0, max_timesteps]`` is reported and not read. Beside a live
    writer, a slot it replaces while it is checked is not reported. Changes nothing unless
    ``repair``: then the damaged episodes are dropped (``ReplayBuffer.drop_episodes``) so the
    rest stays usable, damaged checksum entries of the others are re-sealed from their data as
    stored (each line says whether that data could be verified), chunks whose own crc32c alone
    is damaged are rewritten with it recomputed (each line names them), damaged lengths are restored
    to the length every field's data matches, steps past an episode's length that hold data
    are reset to the field's default (through ``update``), and a last line says what was done;
    a buffer a writer holds is refused at once (BufferLockedError naming it), and slots a
    writer changed between the check and the repair are left as they are. ``progress``: tqdm
    bars over the episodes read, as in ``convert``.
    """
    from .progress import check_progress

    check_progress(progress)
    try:
        storage, schema = _open_read_only(path, storage_options)
    except NewerFormatError:
        raise  # not a finding about the buffer: this replaybuf cannot read it
    except (OSError, ValueError, KeyError) as e:
        return [f"cannot open the buffer: {e}"]
    holder = storage.writer_lease().live_holder() if repair else None
    if holder is not None:  # checked first: its repair would be refused after the whole check
        storage.close()
        raise BufferLockedError(
            f"verify --repair: {storage.location!r} is being written by {describe_holder(holder)}; close that "
            "writer first (verify without --repair checks the buffer beside it)",
            holder,
        )
    problems = [
        f"{link}: a symbolic link inside the buffer (a writable open refuses it; replace it by a copy)"
        for link in storage.links()
    ]
    problems += storage.writable_open_refusals()
    meta, found, _ = _read_bookkeeping(storage, schema)
    problems += found
    for name, field in schema.fields.items():
        try:  # an empty read: the array's step shape and dtype, no data
            steps = storage.read_rows(name, np.zeros(1, np.int64), 0, 0)
        except (OSError, KeyError, ValueError) as e:
            problems.append(f"data/{name}: missing or unreadable ({e})")
            continue
        if steps.shape[2:] != field.shape or steps.dtype != field.dtype:
            problems.append(
                f"data/{name}: steps of {steps.dtype}{list(steps.shape[2:])}, expected {field.dtype}{list(field.shape)}"
            )
    if "episode_lens" not in meta:
        storage.close()
        return problems
    lens = meta["episode_lens"].astype(np.int64)
    lost: list[int] = []
    try:
        state = check_state(storage.load_state(), schema, storage.describe_key(STATE_KEY))
        if "_generation" in meta:
            lost, found = _lost_lengths(storage, lens, meta["_generation"], state)
            problems += found
            # a live writer's counters lag its published episodes by design
            state = catch_up(state, lens, meta["_generation"], schema.max_episodes)
        problems += _check_counters(state, lens, meta.get("_generation"), schema)
    except BufferDamagedError as e:
        problems.append(str(e))
    try:
        load_attrs(storage)
    except BufferDamagedError as e:
        problems.append(str(e))
    bad = [f for f in schema.fields if any(p.startswith(f"data/{f}:") for p in problems)]
    # a slot whose length is outside [0, max_timesteps] (reported above) is not read: the
    # length would size the read (2**31 - 1 steps of a frame field: terabytes)
    readable = np.where((lens >= 0) & (lens <= schema.max_timesteps), lens, 0)
    damage, damaged, entries, chunks, restore, wholesale = _check_episodes(
        storage, schema, readable, skip=bad, progress=progress
    )
    # a length some fields' data blame is restored only where every field that tells a length
    # and the meta checksum (format 5) agree on it: a data file copied in from another buffer or
    # an older copy blames a sound length, which the others still match
    confirmed = _lengths_told(storage, schema, sorted(restore), meta)
    damaged = sorted({*damaged, *(slot for slot, length in restore.items() if confirmed.get(slot) != length)})
    restore = {slot: length for slot, length in restore.items() if confirmed.get(slot) == length}
    # lost lengths (reading 0): restored where the data's checksums tell one, else the episode is gone
    told = _lengths_told(storage, schema, lost, meta)
    restore.update(told)
    untold = [slot for slot in lost if slot not in told]
    # meta values failing their checksum (reported by _read_bookkeeping): a repair writes back
    # the value one flipped bit explains, else drops the episode, as one with damaged data is
    # (which value is wrong cannot be told)
    summed = metasums.summed(schema, storage)
    diagnosed = {
        int(s): metasums.diagnose(meta, summed, int(s), schema.max_timesteps)
        for s in _damaged_meta(meta, schema, set(), storage)
    }
    damaged = sorted({*damaged, *(slot for slot, found in diagnosed.items() if found is None)})
    if "_generation" in meta:  # a lost generation (read as 0): the episode's order is unknown
        damaged = sorted({*damaged, *unpublished_slots(lens, meta["_generation"]).tolist()})
    values = {slot: found for slot, found in diagnosed.items() if found is not None}
    # a length the meta checksum restores (format 5) is restored once, as that value
    restore = {slot: length for slot, length in restore.items() if values.get(slot, ("",))[0] != "episode_lens"}
    # slots with a damaged chunk crc32c do not read past their lengths either until re-sealed
    sealing = [slot for slots in chunks.values() for slot in slots]
    # nor do slots whose length is restored (from the data's checksums, or its meta checksum)
    lengths_back = [*restore, *(slot for slot, (name, _) in values.items() if name == "episode_lens")]
    # nor do the slots held back where a whole field fails the checksums kept apart from it
    whole = [slot for slots in wholesale.values() for slot in slots]
    unharmed = np.where(np.isin(np.arange(len(lens)), [*damaged, *lengths_back, *sealing, *whole]), 0, readable)
    beyond, stray = _check_beyond_length(storage, schema, unharmed, skip=bad, progress=progress)
    # a slot a live writer replaced (or edited) while it was read is not damaged: its reads
    # mixed two episodes; only the slots that stayed as planned are reported (and repaired)
    changed = _changed_slots(storage, meta)
    # slots a writer that stopped left mid-edit (an odd revision, no live writer): their rows are
    # as it left them, sealed by the next writable open, not damage (beside a live writer they
    # are its edit running, which ``changed`` takes out once it is done)
    unsealed = _unfinished_edits(storage, meta, lens)
    problems += [message for slot, message in damage + beyond if slot not in changed and slot not in unsealed]
    problems += [
        f"slot {slot}: an in-place edit a writer that stopped left unfinished (odd meta/_revision): its rows are as "
        "that writer left them and fail their checksums until the next writable open finishes the edit (verify "
        "--repair does)"
        for slot in unsealed
    ]
    damaged = [slot for slot in damaged if slot not in changed and slot not in unsealed]
    stray = {n: kept for n, slots in stray.items() if (kept := [s for s in slots if s not in changed])}
    entries = {
        n: held for n, slots in entries.items() if (held := {s: v for s, v in slots.items() if s not in changed})
    }
    chunks = {n: left for n, slots in chunks.items() if (left := {s: w for s, w in slots.items() if s not in changed})}
    restore = {slot: length for slot, length in restore.items() if slot not in changed}
    untold = [slot for slot in untold if slot not in changed]
    values = {slot: found for slot, found in values.items() if slot not in changed}
    for (name, checksums), slots in wholesale.items():
        problems.append(
            f"data/{name}: every episode ({len(slots)}) fails its crc32c kept in {checksums}: the data or that "
            "checksum file was replaced whole (copied in from another buffer or an older copy), and which one "
            "cannot be told; --repair drops none of them: put the right file back (or clear() the buffer)"
        )
    excess = storage.excess_bookkeeping()
    problems += excess
    unfinished = _unfinished_copy(storage)
    if unfinished is not None:
        problems.append(unfinished)
    # beside a live writer its edit log entry and its step log are its work in progress, not problems
    logged, _ = editlog.read(storage, schema)
    if (
        logged is not None
        and "_revision" in meta
        and logged.running(meta["_generation"], meta["_revision"])
        and storage.writer_lease().live_holder() is None
    ):
        problems.append(
            "an in-place edit is in the edit log (a writer was killed part way through it); "
            "opening the buffer for writing applies it again whole"
        )
    if _step_log_left(storage):
        problems.append(
            "an unfinished episode is in the step log (its writer stopped before committing it); "
            "opening the buffer for writing commits what it holds"
        )
    storage.close()
    if repair and (damaged or stray or entries or chunks or restore or values or excess or untold or unsealed):
        from .buffer import ReplayBuffer

        # the buffer opens with the meta values it is to repair (their slots left out of its
        # counters: Committer.suspect)
        with metasums.unchecked(), ReplayBuffer.from_folder(path, storage_options=storage_options) as buffer:
            # what was checked is repaired only as it was: a slot a writer replaced since is not
            # (one it filled or replaced that had nothing to repair is no finding)
            to_repair = {
                *damaged,
                *values,
                *restore,
                *untold,
                *(slot for held in (*stray.values(), *entries.values(), *chunks.values()) for slot in held),
            }
            moved = (_changed_slots(buffer.storage, meta) - set(unsealed)) & to_repair  # sealed by the open itself
            if unsealed:
                problems.append(
                    f"repaired: the writable open finished the unfinished edit of slots {unsealed} (applied again "
                    "whole from the edit log; one no log holds, an earlier release's, re-sealed as it was left)"
                )
            if moved:
                problems.append(
                    f"not repaired: slots {sorted(moved)} changed since they were checked; run verify again"
                )
            damaged = [slot for slot in damaged if slot not in moved]
            stray = {n: kept for n, slots in stray.items() if (kept := [s for s in slots if s not in moved])}
            entries = {
                n: held for n, slots in entries.items() if (held := {s: v for s, v in slots.items() if s not in moved})
            }
            chunks = {
                n: left for n, slots in chunks.items() if (left := {s: w for s, w in slots.items() if s not in moved})
            }
            restore = {slot: length for slot, length in restore.items() if slot not in moved}
            untold = [slot for slot in untold if slot not in moved]
            if excess:  # first: the rewrites below keep the file at its size
                problems += buffer.storage.excess_bookkeeping(trim=True)
            for slot in sorted(set(values) - moved):
                name, value = values[slot]
                buffer._commit.write_meta(name, np.array([slot]), np.asarray(value)[None])
                problems.append(
                    f"repaired: restored meta/{name} of slot {slot} to {np.asarray(value).tolist()!r}, which its "
                    "checksum matches"
                )
            if damaged:
                dropped = buffer.drop_episodes(damaged)
                problems.append(
                    f"repaired: dropped the damaged episodes in slots {dropped}; {len(buffer)} episodes remain"
                )
            problems += _reseal_entries(buffer, entries, damaged)
            problems += _reseal_chunks(buffer, chunks)
            if restore:
                slots = sorted(restore)
                buffer._commit.write_meta(
                    "episode_lens", np.array(slots), np.array([restore[s] for s in slots], np.int32)
                )
                problems.append(
                    f"repaired: restored the lengths of slots {slots} to {[restore[s] for s in slots]}, where every "
                    "field's data matches its checksum"
                )
            if untold:
                buffer._commit.write_meta("_generation", np.array(untold), np.zeros(len(untold), np.int64))
                problems.append(
                    f"repaired: slots {untold} lost their lengths and no checksum tells them: their generations "
                    "are cleared, so the slots read as empty (the episodes are dropped)"
                )
            if stray:
                _clear_beyond_length(buffer, stray)
                slots = sorted({slot for slots in stray.values() for slot in slots})
                problems.append(f"repaired: set the steps beyond the lengths of slots {slots} to their defaults")
    return problems


def _reseal_entries(buffer: Any, entries: dict[str, dict[int, bool]], dropped: list[int]) -> list[str]:
    """Re-seal the damaged checksum entries ``entries`` (field -> slot -> whether the data
    matched what the entry still held) of the episodes kept, from their data as stored; a line
    per field saying which slots' data was verified and which could not be."""
    lines = []
    for name, slots in entries.items():
        kept = sorted(slot for slot in slots if slot not in dropped)
        if not kept:
            continue
        buffer.storage.reseal(np.array(kept), buffer.episode_lens[kept], names=[name])
        verified = [slot for slot in kept if slots[slot]]
        unverified = [slot for slot in kept if not slots[slot]]
        lines.append(
            f"repaired: re-sealed the damaged checksum entries of data/{name} in slots {kept} from the data as "
            "stored; "
            + "; ".join(
                text
                for text in (
                    f"slots {verified}: the data matches the crc32c the damaged entry still held" if verified else "",
                    f"slots {unverified}: the data could not be verified (it is kept as stored)" if unverified else "",
                )
                if text
            )
        )
    return lines


def _reseal_chunks(buffer: Any, chunks: dict[str, dict[int, list[str]]]) -> list[str]:
    """Re-seal in place the chunks whose own crc32c alone is damaged (``chunks``: field -> slot
    -> where they lie), the episodes kept as they are; a line per slot saying what was done."""
    lines = []
    for name, slots in chunks.items():
        for slot in sorted(slots):
            try:
                done = buffer.storage.reseal_chunks(name, np.array([slot])).get(slot, [])
            except CorruptChunkError as e:  # damaged otherwise since the check
                lines.append(
                    f"not repaired: data/{name} of slot {slot} is damaged otherwise now ({e}); run verify again"
                )
                continue
            lines.append(
                f"repaired: re-sealed in place the damaged crc32c of data/{name}, slot {slot}: "
                f"{'; '.join(done) or 'none left'} (rewritten with the crc32c of its bytes as stored, which matched "
                "the damaged one but for one bit); the episode is kept"
            )
    return lines


# the bookkeeping a slot is checked under: a writer that replaces or edits it changes one
_SLOT_KEYS = ("episode_lens", "_generation", "_revision")
# reads of a buffer's bookkeeping retried while a live writer changes it in between
_BOOKKEEPING_READS = 20


def _read_bookkeeping(storage: Storage, schema: Schema) -> tuple[dict[str, np.ndarray], list[str], set[int]]:
    """Every per-episode array that reads with its configured shape, the problems of the
    others, and the slots a live writer changed while they were read.

    A writer commits between the reads of two arrays: they are read again until the slots'
    bookkeeping (``_SLOT_KEYS``) stays the same across two reads and no slot is caught between a
    commit's two writes (a state a killed writer leaves stays: it is returned as read). Slots
    still changing after ``_BOOKKEEPING_READS`` reads are returned as empty (length and
    generation 0): their episode is being replaced, and is no damage. Damaged values or a
    commit caught midway are read again only while a live writer holds the buffer: else they
    stay as they are."""
    # the slots' keys first, the values they guard after, then the keys again (``_changed_slots``):
    # a commit or an edit writing a slot's values or checksum meanwhile moves its keys
    stored = bookkeeping_fields(schema)
    fields = {**{name: stored[name] for name in _SLOT_KEYS}, **stored, **schema.meta_fields}
    for _ in range(_BOOKKEEPING_READS):
        meta, problems = {}, []
        for name, field in fields.items():
            if name == META_SUM and not storage.keeps_meta_sums:
                continue  # an earlier format keeps none
            try:
                values = storage.read_meta(name)
            except (OSError, KeyError, ValueError) as e:
                problems.append(f"meta/{name}: missing or unreadable ({e})")
                continue
            if values.shape != (schema.max_episodes, *field.shape):
                problems.append(f"meta/{name}: shape {values.shape}, expected {(schema.max_episodes, *field.shape)}")
                continue
            meta[name] = values
        flux = _changed_slots(storage, meta)
        lens, generations = meta.get("episode_lens"), meta.get("_generation")
        # values that fail their checksum are read again too: an edit of them may have landed
        # between the reads of the values and of their checksums
        damaged = _damaged_meta(meta, schema, flux, storage)
        if not flux and (
            not (len(damaged) or (lens is not None and generations is not None and _midway(lens, generations)))
            # no writer to finish what reads damaged; one that finished it and closed since the
            # read moved the slots' keys, and they are read again
            or (storage.writer_lease().live_holder() is None and not _changed_slots(storage, meta))
        ):
            break
        time.sleep(0.01)
    slots = sorted(flux)
    for name in ("episode_lens", "_generation"):
        if name in meta and slots:
            meta[name] = meta[name].copy()
            meta[name][slots] = 0
    summed = metasums.summed(schema, storage)
    problems += [str(metasums.error(storage, int(slot), summed, meta, schema.max_timesteps)) for slot in damaged]
    return meta, problems, flux


def _damaged_meta(meta: dict[str, np.ndarray], schema: Schema, flux: set[int], storage: Storage) -> np.ndarray:
    """The committed slots, not in ``flux`` nor being edited (an odd ``_revision``: a writer's
    edit, or one a killed writer left for the next writable open to close), whose meta values
    fail their ``_meta_sum`` entry (``metasums.damaged``); none when an array did not read."""
    if any(name not in meta for name in (*schema.meta_fields, "episode_lens", "_generation")):
        return np.zeros(0, np.int64)
    # a length outside [0, max_timesteps] is reported as such (``_check_counters``), not again here
    settled = (meta["episode_lens"] > 0) & (meta["episode_lens"] <= schema.max_timesteps)
    if "_revision" in meta:
        settled &= meta["_revision"] % 2 == 0
    slots = np.setdiff1d(np.flatnonzero(settled), np.fromiter(flux, np.int64, len(flux)))
    return metasums.settle(storage, schema, meta, slots)


def _step_log_left(storage: Storage) -> bool:
    """Whether the step log holds an unfinished episode no live writer is collecting (one
    that stopped left it). Listed again after asking who writes: a writer that committed its
    episode and closed in between removed its log."""
    return (
        bool(storage.list_blobs(LOG_PREFIX))
        and storage.writer_lease().live_holder() is None
        and bool(storage.list_blobs(LOG_PREFIX))
    )


def _midway(lens: np.ndarray, generations: np.ndarray) -> bool:
    """Whether a slot has a length without a generation or the reverse: read between a
    commit's two bookkeeping writes (a live writer's, or a killed one's)."""
    return bool(((lens == 0) != (generations == 0)).any())


def _unfinished_edits(storage: Storage, meta: dict[str, np.ndarray], lens: np.ndarray) -> list[int]:
    """The committed slots whose ``_revision`` is odd when no live writer holds the buffer: a
    writer killed inside an in-place edit left them (``Committer.finish_edits`` closes them)."""
    revisions = meta.get("_revision")
    if revisions is None:
        return []
    odd = np.flatnonzero((np.asarray(revisions) % 2 == 1) & (lens > 0)).tolist()
    if not odd or storage.writer_lease().live_holder() is not None:
        return []
    return odd


def check_no_unfinished_edit(
    storage: Storage, schema: Schema, meta: dict[str, np.ndarray], lens: np.ndarray, command: str, path: str
) -> None:
    """Refuse (``UnfinishedEditError``) to copy a buffer holding an in-place edit a stopped
    writer left part applied (``_unfinished_edits``): the copy would hold it as if whole, its
    edit log left behind, and the copy's first writable open would seal it so."""
    unfinished = _unfinished_edits(storage, meta, lens)
    if not unfinished:
        return
    logged, _ = editlog.read(storage, schema)
    where = (
        f"the edit log {storage.describe_key(editlog.KEY)} holds it"
        if logged is not None and logged.running(meta["_generation"], meta["_revision"])
        else "no edit log holds it: the open seals each step as it was left"
    )
    raise UnfinishedEditError(
        f"{command}: {storage.location!r}: slots {unfinished} hold an in-place edit that a writer stopped part way "
        f"through (odd meta/_revision; {where}); a copy would keep it half applied. Open the buffer for writing "
        f"once (ReplayBuffer.from_folder(...).close(), or `replaybuf verify --repair {path}`), which finishes it, "
        f"then run {command} again; nothing was written"
    )


def _changed_slots(storage: Storage, meta: dict[str, np.ndarray]) -> set[int]:
    """Slots whose bookkeeping (``_SLOT_KEYS``) in storage differs from ``meta`` now. The
    revision of a slot empty now is no change: a commit stamps the empty slots ahead of it
    with its revision (``Committer.stamp_revisions``)."""
    now: dict[str, np.ndarray] = {}
    for name in _SLOT_KEYS:
        if name in meta:
            try:
                values = storage.read_meta(name)
            except (OSError, KeyError, ValueError):
                continue
            if values.shape == meta[name].shape:
                now[name] = values
    empty = (
        (now["episode_lens"] == 0) & (now["_generation"] == 0)
        if {"episode_lens", "_generation"} <= now.keys()
        else None
    )
    changed: set[int] = set()
    for name, values in now.items():
        moved = values != meta[name]
        if name == "_revision" and empty is not None:
            moved &= ~empty
        changed.update(np.flatnonzero(moved).tolist())
    return changed


def _clear_beyond_length(buffer: Any, stray: dict[str, list[int]]) -> None:
    """Rewrite the steps past each episode's length in ``stray`` (field -> slots) with the
    field's default, through ``update`` (an edit of committed episodes: their steps are written
    back as read, checked, and their checksums resealed)."""
    for name, slots in stray.items():
        fill = buffer.schema.fields[name].fill
        for slot in slots:
            rows = buffer.storage.read_rows(name, np.array([slot]), 0, buffer.max_timesteps)
            rows[:, int(buffer.episode_lens[slot]) :] = fill
            buffer.update([slot], **{name: rows})


def _check_episodes(
    storage: Storage, schema: Schema, lens: np.ndarray, skip: Sequence[str], progress: bool | None = None
) -> tuple[
    list[tuple[int | None, str]],
    list,
    dict[str, dict[int, bool]],
    dict[str, dict[int, list[str]]],
    dict[int, int],
    dict[tuple[str, str], list[int]],
]:
    """Read every committed episode whole, field by field; a slab that fails is read again slot
    by slot so each damaged episode is reported. Returns ((slot, problem)s, damaged slots,
    damaged checksum entries: field -> slot -> whether the data matches what the entry still
    held, chunks whose own crc32c alone is damaged: field -> slot -> where they lie, damaged
    lengths: slot -> the length at which every field's data matches its checksum, and the
    fields whose every episode fails the checksum file kept apart: (field, that file) -> slots).
    A slot whose only failures are such fields' is held back: not among the damaged slots."""
    from .progress import progress_bar

    names = [n for n in schema.fields if n not in skip]
    found: dict[str, list[tuple[int | None, str]]] = {n: [] for n in names}
    # slot -> what failed: (field, the checksum file kept apart from its data it failed), or
    # None for any other damage
    failed: dict[int, set[tuple[str, str] | None]] = {}
    entries: dict[str, dict[int, bool]] = {}
    chunks: dict[str, dict[int, list[str]]] = {}
    matches: dict[int, set[int]] = {}
    slots = np.flatnonzero(lens > 0)
    with progress_bar(progress, total=len(slots), unit="episode", desc="verify episodes") as bar:
        for slab in _slabs(slots, lens[slots], schema):
            for name in names:
                field = schema.fields[name]
                try:
                    _read_episodes(storage, name, field, slab, lens[slab])
                    continue
                except Exception:  # noqa: BLE001 - any failure is found again and reported per slot below
                    pass
                for slot in slab.tolist():
                    try:
                        _read_episodes(storage, name, field, np.array([slot]), lens[[slot]])
                    except ChunkChecksumError as e:  # a chunk's own crc32c: the chunks re-sealed on repair
                        try:  # every chunk of the episode, for damage past the one the read stopped at
                            sealable = storage.reseal_chunks(name, np.array([slot]), write=False)
                        except CorruptChunkError as other:
                            found[name].append((slot, str(other)))
                            failed.setdefault(slot, set()).add(None)
                        else:
                            found[name].append((slot, str(e)))
                            chunks.setdefault(name, {})[slot] = sealable.get(slot, [])
                    except ChecksumEntryError as e:  # the data is not blamed: re-sealed on repair
                        found[name].append((slot, str(e)))
                        entries.setdefault(name, {})[slot] = e.data_verified
                    except EpisodeLengthError as e:  # the length is blamed: restored on repair
                        found[name].append((slot, str(e)))
                        matches.setdefault(slot, set()).add(e.matches)
                    except CorruptChunkError as e:
                        found[name].append((slot, str(e)))
                        failed.setdefault(slot, set()).add(None if e.checksums is None else (name, e.checksums))
                    except Exception as e:  # noqa: BLE001 - verify reports damage, whatever the error
                        found[name].append(
                            (
                                slot,
                                f"data/{name}: slot {slot} (length {int(lens[slot])}) is unreadable "
                                f"({type(e).__name__}: {e})",
                            )
                        )
                        failed.setdefault(slot, set()).add(None)
            bar.update(len(slab))
    # a length every field of the slot agrees on, the slot's data otherwise sound
    restore = {slot: min(agreed) for slot, agreed in matches.items() if slot not in failed and len(agreed) == 1}
    for slot in matches.keys() - restore.keys():
        failed.setdefault(slot, set()).add(None)
    chunks = {n: left for n, slots in chunks.items() if (left := {s: w for s, w in slots.items() if s not in failed})}
    # every episode (two or more) of a field failing the checksums kept apart from its data: one
    # of the two files was replaced whole (copied in from another buffer or an older copy), and
    # which one cannot be told, so a repair drops none of them (``verify``)
    against: dict[tuple[str, str], list[int]] = {}
    for slot, causes in sorted(failed.items()):
        kept_apart = [cause for cause in causes if cause is not None]
        for cause in sorted(kept_apart, key=lambda cause: (names.index(cause[0]), cause[1])):
            against.setdefault(cause, []).append(slot)
    wholesale = {cause: held for cause, held in against.items() if len(slots) >= 2 and len(held) == len(slots)}
    # only those fields' failures are held back: a slot with damage of its own (another field, a
    # length, a chunk) is damaged as ever
    damaged = sorted(slot for slot, causes in failed.items() if not causes <= wholesale.keys())
    return [p for n in names for p in found[n]], damaged, entries, chunks, restore, wholesale


def _read_episodes(storage: Storage, name: str, field: Field, slots: np.ndarray, lens: np.ndarray) -> None:
    """Steps ``0 .. lens[i]`` of each slot through ``read_spans``, the checked whole-episode path."""
    out = np.empty((len(slots), int(lens.max()), *field.shape), field.dtype)
    storage.read_spans(name, slots, np.zeros(len(slots), np.int64), lens, out, parallel=False)


def _lost_lengths(
    storage: Storage, lens: np.ndarray, generations: np.ndarray, state: dict
) -> tuple[list[int], list[str]]:
    """``check_lost_lengths`` (the stored counters ``state``): the slots whose lengths are lost
    and the problem found (lengths of 0 a live writer may be unpublishing are not)."""
    beside = len(committed_without_length(lens, generations, state)) and storage.writer_lease().live_holder()
    try:
        check_lost_lengths(storage, lens, generations, state, beside_writer=bool(beside))
    except LostLengthError as e:
        return e.slots, [str(e)]
    return [], []


def _lengths_told(storage: Storage, schema: Schema, slots: list[int], meta: dict[str, np.ndarray]) -> dict[int, int]:
    """Per slot of ``slots``, the one length at which its ``_meta_sum`` entry (where it covers
    lengths, ``meta``: the arrays as read) and every field whose checksums tell
    (``Storage.lengths_matching``) match; slots without one are left out."""
    told = {}
    summed = metasums.summed(schema, storage)
    for slot in slots:
        agreed: set[int] | None = None
        for lengths in (
            metasums.lengths_matching(meta, summed, slot, schema.max_timesteps) if META_SUM in meta else None,
            *(storage.lengths_matching(name, slot) for name in schema.fields),
        ):
            if lengths is not None:
                agreed = set(lengths) if agreed is None else agreed & set(lengths)
        if agreed is not None and len(agreed) == 1:
            told[slot] = agreed.pop()
    return told


def _check_counters(state: dict, lens: np.ndarray, generations: np.ndarray | None, schema: Schema) -> list[str]:
    """Problems of the counters and per-slot bookkeeping (``state`` caught up with the published
    episodes)."""
    problems = []
    out_of_range = np.flatnonzero((lens < 0) | (lens > schema.max_timesteps))
    if len(out_of_range):
        problems.append(
            f"episode_lens: slots {out_of_range[:10].tolist()} have lengths outside [0, {schema.max_timesteps}]"
        )
    valid = np.flatnonzero(lens > 0)
    # more counted than held is fine: length-0 episodes (advance_episode(batch_size=n) before any
    # step) count in num_episodes, as in the seed
    if int(state["num_episodes"]) < len(valid):
        problems.append(
            f"counters: num_episodes is {state['num_episodes']} but {len(valid)} slots hold an episode "
            "(a writer stopped between publishing lengths and counters?)"
        )
    if generations is None:
        return problems
    if len(valid) and (generations[valid] <= 0).any():
        problems.append(f"_generation: committed slots {valid[generations[valid] <= 0][:10].tolist()} have no ordinal")
    if len(np.unique(generations[valid])) != len(valid):
        problems.append("_generation: two committed slots share an ordinal")
    if len(valid):
        newest = int(valid[np.argmax(generations[valid])])
        if int(generations[newest]) > int(state.get("total_episodes", 0)):
            problems.append(
                f"counters: total_episodes is {state.get('total_episodes')} but slot {newest} carries "
                f"ordinal {int(generations[newest])}"
            )
        # the next slot (episode_index) is not checked against the newest commit: the user may
        # set it by hand, as the seed allows, and a writable open keeps it (reconcile_state)
    return problems


def _rows_past_lengths(storage: Storage, name: str, slots: np.ndarray, lens: np.ndarray, steps: int) -> np.ndarray:
    """Rows ``min(lens) .. steps`` of ``slots``, each slot's read from its own length on (zeros
    before it): the committed steps are checked on their own, and a read of them here would
    report their damage twice."""
    start = int(lens.min())
    field = storage.read_rows(name, slots[:1], start, start)  # the step shape and dtype, no data
    rows = np.zeros((len(slots), steps - start, *field.shape[2:]), field.dtype)
    for length in np.unique(lens).tolist():
        group = np.flatnonzero(lens == length)
        rows[group, length - start :] = storage.read_rows(name, slots[group], length, steps)
    return rows


def _check_beyond_length(
    storage: Storage, schema: Schema, lens: np.ndarray, skip: Sequence[str], progress: bool | None
) -> tuple[list[tuple[int, str]], dict[str, list[int]]]:
    """Committed slots whose timesteps past their length hold values other than 0 or the
    default, or cannot be read there: ((slot, problem)s, field -> the slots holding data)."""
    from .progress import progress_bar

    slots = np.flatnonzero(lens > 0)
    short = slots[lens[slots] < schema.max_timesteps]
    if not len(short):
        return [], {}
    names = [n for n in schema.fields if n not in skip]
    found: dict[str, list[tuple[int, str]]] = {n: [] for n in names}
    stray: dict[str, list[int]] = {}
    with progress_bar(progress, total=len(short), unit="episode", desc="verify") as bar:
        for slab in _slabs(short, np.full(len(short), schema.max_timesteps), schema):
            for name in names:
                for slot, message, holds_data in _stray_rows(storage, schema, name, slab, lens):
                    found[name].append((slot, message))
                    if holds_data:
                        stray.setdefault(name, []).append(slot)
            bar.update(len(slab))
    return [p for n in names for p in found[n]], stray


def _stray_rows(
    storage: Storage, schema: Schema, name: str, slab: np.ndarray, lens: np.ndarray
) -> list[tuple[int, str, bool]]:
    """``_check_beyond_length`` of one field over ``slab``: (slot, problem, whether it is data
    past the length)s. A read that fails is made again slot by slot, so each failure names its
    slot: beside a live writer, a slot it replaced during the read fails its checksum there,
    and only a slot it did not replace is damage."""
    start = int(lens[slab].min())
    try:
        rows = _rows_past_lengths(storage, name, slab, lens[slab], schema.max_timesteps)
    except Exception as e:  # noqa: BLE001 - verify reports damage, whatever the error
        if len(slab) > 1:
            return [
                found for k in range(len(slab)) for found in _stray_rows(storage, schema, name, slab[k : k + 1], lens)
            ]
        return [(int(slab[0]), f"data/{name}: slot {int(slab[0])} cannot be read past its length ({e})", False)]
    # compared as bytes: a flipped sign bit (-0.0) or a NaN default is no value match
    item = rows.dtype.itemsize
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(*rows.shape[:2], -1, item)
    fill = np.frombuffer(np.asarray(schema.fields[name].fill, dtype=rows.dtype).tobytes(), np.uint8)
    odd = (raw.any(axis=3) & ~(raw == fill).all(axis=3)).any(axis=2)
    odd &= np.arange(start, schema.max_timesteps)[None, :] >= lens[slab][:, None]
    problems = []
    for row in np.flatnonzero(odd.any(axis=1)):
        steps = start + np.flatnonzero(odd[row])
        slot = int(slab[row])
        problems.append(
            (
                slot,
                f"data/{name}: slot {slot} (length {int(lens[slot])}) holds data beyond its length at "
                f"timesteps {_ranges(steps)}",
                True,
            )
        )
    return problems


# ---- unlock ---------------------------------------------------------------------------------------------


def unlock(location: str | os.PathLike, storage_options: dict | None = None) -> dict | None:
    """Remove the writer lease of the buffer at ``location``: for an object-store writer that
    stopped without closing, when waiting for its lease to expire is too long.

    Returns the removed holder's record (host, pid, since, ...), None when no lease was held.
    A lease that has not expired may belong to a writer still renewing it, which then refuses
    every further write from its next renewal (``format_unlocked`` says so). A local lock is
    released by the kernel when its process exits, so a held one belongs to a running process:
    that raises BufferLockedError naming it (stop the process instead).
    FileNotFoundError when the location holds neither a buffer nor a lease (a mistyped path).
    """
    storage = make_storage(location, None, storage_options)
    holder = storage.writer_lease().unlock()
    if holder is None and not storage.exists():
        raise FileNotFoundError(
            f"no replaybuf buffer (nor writer lease) at {os.fspath(location)!r}" + _not_found_hint(storage)
        )
    return holder


# ---- command line ---------------------------------------------------------------------------------------


def add_store_arguments(parser: argparse.ArgumentParser, prefix: str = "", what: str = "the buffer's") -> None:
    """``replaybuf.cli.add_store_arguments`` (imported here when the parser is built: the
    command line imports this module first)."""
    from .cli import add_store_arguments as add

    add(parser, prefix, what)


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source buffer: folder or URL (any backend, or a memmap-replay-buffer folder)")
    parser.add_argument("dst", help="destination folder or URL")
    parser.add_argument(
        "--backend",
        default="zarr",
        help="destination backend: zarr (default), memmap, hdf5 or one an installed package names",
    )
    parser.add_argument(
        "--chunks",
        action="append",
        default=None,
        metavar="FIELD=T",
        help="timesteps per chunk of a data field (repeatable), e.g. --chunks state=10",
    )
    parser.add_argument("--compressor", default=None, help="compressor of every field (zarr), e.g. zstd:5 or none")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a buffer already at DST (a local one only once the copy is complete; on S3/GCS it is erased first)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal by default)")
    add_store_arguments(parser, what="the source's")
    add_store_arguments(parser, "dst-", what="the destination's")


def _run_convert(args: argparse.Namespace) -> int:
    from .cli import store_options

    summary = convert(
        args.src,
        args.dst,
        backend=args.backend,
        chunks=args.chunks,
        compressor=args.compressor,
        storage_options=store_options(args),
        dst_storage_options=store_options(args, "dst-"),
        progress=False if args.quiet else None,
        overwrite=args.overwrite,
    )
    print(
        f"copied {summary['episodes']} episodes ({summary['timesteps']} timesteps) to "
        f"{summary['destination']} [{summary['backend']}], verified"
    )
    return 0


def _add_upgrade_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="local buffer folder")
    parser.add_argument(
        "--keep-backup", action="store_true", help="keep the original folder next to it as .<name>.format<N>-<pid>"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal by default)")


def _run_upgrade(args: argparse.Namespace) -> int:
    done = upgrade(args.path, keep_backup=args.keep_backup, progress=False if args.quiet else None)
    removed = f"; removed the copies of killed upgrades: {', '.join(done['removed'])}" if done["removed"] else ""
    if not done["upgraded"]:
        print(
            f"{args.path}: already in format {done['from_version']}, the newest of the {done['backend']} backend"
            + removed
        )
        return 0
    kept = f"; the original is kept at {done['backup']}" if done["backup"] else ""
    print(
        f"{args.path}: upgraded from format {done['from_version']} to {done['to_version']} "
        f"({done['episodes']} episodes copied and verified){kept}{removed}"
    )
    return 0


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="buffer folder or URL")
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    add_store_arguments(parser)


def _run_info(args: argparse.Namespace) -> int:
    from .cli import store_options

    facts = info(args.path, store_options(args))
    print(json.dumps(facts, indent=1) if args.json else format_info(facts))
    return 0


def _add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="buffer folder or URL")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal by default)")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="drop the damaged episodes it finds (the others stay usable) and reset data found past an "
        "episode's length to the field's default; still exits 1 when it found any",
    )
    add_store_arguments(parser)


def _run_verify(args: argparse.Namespace) -> int:
    from .cli import store_options

    storage = make_storage(args.path, None, store_options(args))
    if not storage.exists():  # a mistyped path (or one a killed upgrade moved): a usage error
        raise FileNotFoundError(
            f"no replaybuf or memmap-replay-buffer buffer at {args.path!r}" + _not_found_hint(storage)
        )
    problems = verify(args.path, store_options(args), repair=args.repair, progress=False if args.quiet else None)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.path}: consistent")
    return 1 if problems else 0


def _add_unlock_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("location", help="buffer folder or URL")
    add_store_arguments(parser)


def _run_unlock(args: argparse.Namespace) -> int:
    from .cli import store_options

    try:
        holder = unlock(args.location, store_options(args))
    except BufferLockedError as error:
        print(error, file=sys.stderr)
        return 1
    if holder is None:
        print(f"{args.location}: no writer lease held")
    else:
        print(format_unlocked(args.location, holder))
    return 0


def format_unlocked(location: str, holder: dict) -> str:
    """What ``unlock`` removed, and what it means for a writer still running."""
    return (
        f"{location}: removed the writer lease of {describe_holder(holder)} (if that writer is still running, it "
        "refuses every further write from its next renewal)"
    )


# (name, help, add_arguments, run): the fields of replaybuf.cli.Command, in order
CLI_COMMANDS = (
    (
        "convert",
        "copy a buffer to another backend or location (e.g. a memmap-replay-buffer folder to zarr)",
        _add_convert_arguments,
        _run_convert,
    ),
    (
        "upgrade",
        "rewrite a local buffer written by an earlier replaybuf in the newest on-disk format, in place",
        _add_upgrade_arguments,
        _run_upgrade,
    ),
    ("info", "show a buffer's schema, episodes, chunking, compression and sizes", _add_info_arguments, _run_info),
    (
        "verify",
        "check a buffer's consistency and every committed episode's data (exit status 1 on problems); "
        "--repair drops damaged episodes",
        _add_verify_arguments,
        _run_verify,
    ),
    (
        "unlock",
        "remove a buffer's writer lease left by a writer that stopped without closing (object stores)",
        _add_unlock_arguments,
        _run_unlock,
    ),
)
