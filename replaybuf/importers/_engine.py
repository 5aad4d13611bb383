"""The import loop shared by every format: size the destination, skip what a previous run
committed, copy one source episode at a time, check it, and report progress.

A format implements ``Source``: what its fields are and how long its episodes are (read from
the source's index alone), and ``read(i)`` for one episode's arrays. Memory is bounded by one
episode whatever the source's size.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..attrs import encode_attrs
from ..buffer import ReplayBuffer
from ..consistency import read_episodes_consistent
from ..maintenance import check_apart, missing_parents, remove_empty
from ..progress import progress_bar
from ..schema import MAX_EPISODE_BYTES, Schema
from ..storage.base import ConcurrentWriteError, Storage, StorageError, make_storage, refuse_empty_location

__all__ = [
    "ImportResult",
    "ImportSourceError",
    "ImportVerifyError",
    "Source",
    "check_new_folder",
    "exported_episodes",
    "is_plain_json",
    "new_folder",
    "run_import",
]

# meta field holding the index of the source episode a slot came from (what resume skips on)
SOURCE_EPISODE = "source_episode"


class ImportSourceError(ValueError):
    """A source file is malformed or truncated; the message names the file and the episode."""


class ImportVerifyError(ValueError):
    """An imported episode reads back different from its source."""


class Source(ABC):
    """One dataset in another format, read episode by episode."""

    format: ClassVar[str]

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, str | os.PathLike):  # os.fspath would not say which argument
            raise TypeError(
                f"the import source must be a path (a str or os.PathLike), got {type(path).__name__} {path!r}"
            )
        self.path = os.fspath(path)
        if "://" in self.path:  # the storage options are the destination's: nothing here reads a store
            raise ValueError(
                f"the import source must be a local file or folder, got the URL {self.path!r}; copy the dataset "
                "here first (e.g. `aws s3 sync`, `gcloud storage cp -r`)"
            )

    @abstractmethod
    def fields(self) -> dict[str, dict[str, Any]]:
        """Field specs ``{name: {"dtype": ..., "shape": ...}}`` of the per-step arrays."""

    def meta_fields(self) -> dict[str, str]:
        """Per-episode meta fields beyond ``source_episode`` (name -> dtype)."""
        return {}

    def attrs(self) -> dict[str, Any]:
        """What the source says about the dataset as a whole, as JSON values, for the
        destination's ``buffer.attrs`` (merged into what it holds; ``imported_from`` is added)."""
        return {}

    @abstractmethod
    def episode_ids(self) -> list[int]:
        """The source's index of each episode, in reading order."""

    @abstractmethod
    def lengths(self) -> list[int]:
        """Steps of each episode, in reading order, from the source's index alone."""

    @abstractmethod
    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(per-step arrays, meta values) of the episode at ``position``."""

    def where(self, position: int) -> str:
        """The file holding the episode at ``position``, for error messages."""
        return self.path

    def location(self) -> str | None:
        """The local file or folder the source reads (None where it has none), which a
        destination may not be, be inside, or hold."""
        return self.path if os.path.exists(self.path) else None

    def close(self) -> None:
        """Release open files."""


def is_plain_json(value: Any) -> bool:
    """Whether ``buffer.attrs`` takes ``value`` as it is: sources keep the text of metadata that
    is not (a NaN in an environment's settings must not stop an import)."""
    try:
        encode_attrs({"value": value})
    except (TypeError, ValueError):
        return False
    return True


def destination_attrs(source: Source) -> dict[str, Any]:
    """What the import adds to ``buffer.attrs``: the source's attributes, each value that is not
    plain JSON (a NaN in a zarr's root attributes) kept as its JSON text, and ``imported_from``;
    ImportSourceError naming the source where they cannot be kept (too large), checked before
    the destination is created (an empty buffer was left, and every resume failed the same)."""
    attrs = {
        key: value if is_plain_json(value) else json.dumps(value, default=str) for key, value in source.attrs().items()
    }
    attrs["imported_from"] = {"format": source.format, "path": source.path}
    try:
        encode_attrs(attrs)
    except (TypeError, ValueError) as error:
        raise ImportSourceError(f"{source.path}: its metadata cannot be kept in buffer.attrs: {error}") from error
    return attrs


@dataclass(frozen=True)
class ImportResult:
    """What an import did: episodes copied, episodes found already committed, steps copied, and
    source episodes without steps (left out: a buffer episode holds at least one step)."""

    imported: int
    skipped: int
    frames: int
    empty: int = 0


def _check_episode(source: Source, data: dict[str, np.ndarray], length: int) -> None:
    fields = source.fields()
    missing = sorted(set(fields) - set(data))
    if missing:
        raise ValueError(f"fields {missing} are missing")
    for name, spec in fields.items():
        shape = (length, *spec["shape"])
        got = data[name].shape
        if got != shape:
            # more steps than the index gives: not a truncated file (robomimic's num_samples under its rows)
            if got[1:] != shape[1:]:
                why = "another shape per step than the source declares"
            elif got[:1] > shape[:1]:
                why = "more steps than the source's index gives the episode"
            else:
                why = "truncated?"
            raise ValueError(f"field {name!r} has shape {got}, expected {shape} ({why})")


def _verify(buffer: ReplayBuffer, slot: int, data: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    for name, source in data.items():
        stored = buffer.data[name][slot, : len(source)]
        if not np.array_equal(stored, source, equal_nan=stored.dtype.kind == "f"):
            raise ImportVerifyError(f"field {name!r} of slot {slot} reads back different from its source")
    for name, value in meta.items():
        if not np.array_equal(buffer.meta_data[name][slot], value):
            raise ImportVerifyError(f"meta field {name!r} of slot {slot} reads back different from its source")


def _read_episode(source: Source, position: int, episode: int, length: int) -> tuple[dict[str, np.ndarray], dict]:
    """The data and meta values of the source's episode at ``position``, checked against its
    fields; ImportSourceError naming the file and episode where they cannot be read."""
    try:
        data, meta = source.read(position)
        _check_episode(source, data, length)
    except Exception as error:  # whatever a damaged file makes its reader raise (blosc: RuntimeError)
        raise ImportSourceError(f"{source.where(position)}: episode {episode}: {error}") from error
    return data, meta


def _native(dtype: str) -> str:
    """A numeric ``dtype`` in this machine's byte order: a big-endian source array ('>f4', as
    HDF5 and zarr may hold) is stored as float32 (a buffer holds native order only)."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        return dtype
    return parsed.newbyteorder("=").name if parsed.kind in "biuf" and parsed.byteorder not in "=|" else dtype


def destination_config(source: Source) -> dict[str, Any]:
    """The ``ReplayBuffer`` arguments of a buffer sized for ``source``; ImportSourceError naming
    the source when it has no episodes, negative lengths, an episode index given twice, or fields
    or lengths no buffer can hold (checked before anything is read or created)."""
    lengths = source.lengths()
    if not lengths:
        raise ImportSourceError(f"{source.path}: no episodes to import")
    ids = source.episode_ids()
    negative = {episode: length for episode, length in zip(ids, lengths) if length < 0}
    if negative:
        raise ImportSourceError(f"{source.path}: episodes with a negative length {negative}")
    if max(lengths) == 0:
        raise ImportSourceError(f"{source.path}: none of its {len(lengths)} episodes has a step; nothing to import")
    twice = sorted(episode for episode, count in Counter(ids).items() if count > 1)
    if twice:  # source_episode would not tell them apart, and a resume would skip the second
        raise ImportSourceError(f"{source.path}: episode indices {twice} name more than one episode")
    config: dict[str, Any] = {
        # episodes without steps are left out: a slot each made 10**5 of them (an index of a few
        # hundred kB) reserve 5.8 GB on disk for one episode of 20 frames (memmap, hdf5)
        "max_episodes": sum(1 for length in lengths if length > 0),
        "max_timesteps": max(lengths),
        "fields": {
            name: dict(spec, dtype=_native(spec["dtype"]), shape=tuple(spec["shape"]))
            for name, spec in source.fields().items()
        },
        "meta_fields": {SOURCE_EPISODE: "int64", **source.meta_fields()},
    }
    _check_episode_bytes(source, config["fields"], ids, lengths)
    try:
        Schema.build(**config).check_names()  # a new buffer's names: a Python keyword, over MAX_NAME_BYTES
    except (ValueError, TypeError) as error:
        raise ImportSourceError(f"{source.path}: no buffer can hold this dataset: {error}") from error
    return config


def _check_episode_bytes(source: Source, fields: dict[str, dict], ids: list[int], lengths: list[int]) -> None:
    """ImportSourceError naming the longest episode where one of its fields is over the
    ``MAX_EPISODE_BYTES`` an episode may take in RAM: an import reads one episode whole, so no
    option of it helps (the buffer's own message said to lower max_timesteps, which an import
    has not); the episode has to be split in the source."""
    longest = int(np.argmax(lengths))
    for name, spec in fields.items():
        try:
            step_nbytes = np.dtype(spec["dtype"]).itemsize * int(np.prod(spec["shape"], dtype=np.int64))
        except TypeError:  # a dtype no buffer holds: Schema.build names it
            continue
        size = step_nbytes * lengths[longest]
        if size > MAX_EPISODE_BYTES:
            fits = MAX_EPISODE_BYTES // step_nbytes
            advice = (
                f"split it into episodes of at most {fits} steps in the source" if fits else "one step alone is over it"
            )
            raise ImportSourceError(
                f"{source.path}: no buffer can hold this dataset: episode {ids[longest]} has {lengths[longest]} "
                f"steps of field {name!r}, {step_nbytes} bytes each: {size / 2**30:,.0f} GiB per episode, over "
                f"the {MAX_EPISODE_BYTES // 2**30} GiB an import reads at once (one episode, "
                f"replaybuf.schema.MAX_EPISODE_BYTES); {advice}"
            )


def _sizing(config: dict[str, Any], ids: list[int], lengths: list[int]) -> str:
    """How a new destination was sized, for a failure to create it (a disk too small for what the
    memmap and hdf5 backends reserve: every slot as long as the longest episode)."""
    longest = int(np.argmax(lengths))
    return (
        f"the destination holds {config['max_episodes']} episodes of up to {config['max_timesteps']} steps "
        f"(one slot per source episode, each as long as the longest, episode {ids[longest]}; the source has "
        f"{sum(lengths)} steps in all): the memmap and hdf5 backends reserve all of it on disk, the zarr "
        "backend (the default) stores only the steps written"
    )


def check_config(source: Source, dst: Any, storage: Storage, config: dict[str, Any]) -> None:
    """Refuse to resume into the buffer at ``dst`` (``storage``, which exists) when it was made
    with another config than ``source`` needs, listing the differences: a source that gained an
    episode since, or a buffer not made by this import. The buffer's own message offered
    ``overwrite=True`` and ``from_folder``, which an import has not."""
    with ReplayBuffer(storage, overwrite=False, read_only=True) as held:
        lines = [line.replace(" vs passed ", " vs needed ") for line in held.schema.differences(Schema.build(**config))]
    if lines:
        raise ValueError(
            f"{os.fspath(dst)}: holds a buffer of another config than importing {source.path!r} needs:\n"
            + "\n".join(lines)
            + "\nan import resumes only into the buffer it made from the same dataset (not one that gained "
            "episodes since): import into a new destination"
        )


def open_destination(config: dict[str, Any], storage: Storage) -> tuple[ReplayBuffer, set[int]]:
    """The destination buffer of ``config`` (created, or reopened to resume) and the source
    episode indices it already holds."""
    buffer = ReplayBuffer(storage, **config, overwrite=False)
    done = {int(buffer.meta_data[SOURCE_EPISODE][slot]) for slot in buffer.valid_episodes()}
    return buffer, done


def check_resume(buffer: ReplayBuffer, source: Source, dst: Any) -> None:
    """Refuse to resume into ``dst`` when its episodes came from another source: another format
    (``imported_from``), committed episodes whose length the source now gives differently, or,
    when episodes are left to add, a newest committed episode whose values differ from the
    source's (another dataset, or the file changed since). Adding to them would mix two
    datasets in one buffer. The path is not compared: a source moved or copied since resumes."""
    origin = buffer.attrs.get("imported_from")
    if isinstance(origin, dict) and origin.get("format") != source.format:
        raise ValueError(
            f"{os.fspath(dst)}: holds episodes imported from {origin.get('format')} {origin.get('path')!r}, "
            f"not from {source.format} {source.path!r}; import into a new destination"
        )
    ids = source.episode_ids()
    claimed = dict(zip(ids, source.lengths()))
    slots = buffer.valid_episodes()
    episodes = np.asarray(buffer.meta_data[SOURCE_EPISODE][:], np.int64)[slots].tolist()
    lens = np.asarray(buffer.episode_lens, np.int64)[slots].tolist()
    changed = {
        episode: (length, claimed[episode])
        for episode, length in zip(episodes, lens)
        if episode in claimed and claimed[episode] != length
    }
    if changed:
        raise ValueError(
            f"{os.fspath(dst)}: source episodes {sorted(changed)} were imported with other lengths than "
            f"{source.path!r} now gives ((imported, now): {changed}); the source changed since: import "
            "into a new destination"
        )
    # the newest committed episode read again (a source rewritten with the same lengths), when
    # episodes with steps are left to add to it
    held = [(slot, episode) for slot, episode in zip(slots.tolist(), episodes) if episode in claimed]
    if held and len(held) < sum(1 for length in claimed.values() if length > 0):
        slot, episode = held[-1]
        position = ids.index(episode)
        data, meta = _read_episode(source, position, episode, claimed[episode])
        try:
            _verify(buffer, slot, data, {SOURCE_EPISODE: episode, **meta})
        except ImportVerifyError as error:
            raise ValueError(
                f"{os.fspath(dst)}: source episode {episode} was imported with other values than {source.path!r} "
                f"now holds ({error}); the source changed since: import into a new destination"
            ) from error


def run_import(
    source: Source,
    dst: Any,
    *,
    backend: str | None = None,
    storage_options: dict | None = None,
    verify: bool = False,
    progress: bool | None = None,
) -> ImportResult:
    """Copy every episode of ``source`` not yet in ``dst`` (see ``replaybuf.importers.load``)."""
    try:
        config, ids, lengths = destination_config(source), source.episode_ids(), source.lengths()
        attrs = destination_attrs(source)
        location = source.location()
        if location is not None:
            check_apart(location, None, dst, storage_options, command="import")
        storage = make_storage(dst, backend, storage_options)
        if storage.exists():
            check_config(source, dst, make_storage(dst, backend, storage_options), config)
        # a new destination is created once the first episode has read well, so that a source
        # refused at once (a missing column, a truncated file) leaves nothing behind
        first = None if storage.exists() else _read_episode(source, 0, ids[0], lengths[0])
        try:
            buffer, done = open_destination(config, storage)
        except StorageError as error:
            if first is None:  # an existing destination: not a matter of its size
                raise
            raise StorageError(f"{error}; {_sizing(config, ids, lengths)}") from error
        imported = frames = empty = 0
        started = time.monotonic()
        with buffer, progress_bar(progress, desc=f"import {source.format}", unit="episode", total=len(ids)) as bar:
            check_resume(buffer, source, dst)
            buffer.attrs.update(attrs)
            bar.update(sum(1 for episode in ids if episode in done))
            for position, (episode, length) in enumerate(zip(ids, lengths)):
                if episode in done:
                    continue
                if position == 0 and first is not None:
                    (data, meta), first = first, None
                else:
                    data, meta = _read_episode(source, position, episode, length)
                if length == 0:  # read, so checked empty; a buffer episode holds at least one step
                    empty += 1
                    bar.update()
                    continue
                meta = {SOURCE_EPISODE: episode, **meta}
                slot = buffer.episode_index
                buffer.store_episode(**data, **meta)
                if verify:
                    _verify(buffer, slot, data, meta)
                imported += 1
                frames += length
                bar.update()
                bar.set_postfix(frames_per_s=f"{frames / max(time.monotonic() - started, 1e-9):.0f}")
    finally:
        source.close()
    return ImportResult(imported=imported, skipped=len(done), frames=frames, empty=empty)


def check_new_folder(dst: str | os.PathLike, src: Any = None) -> None:
    """Refuse an export into a folder that holds anything (an export never overwrites), or
    inside the folder of the source buffer ``src`` (it would add files to the buffer)."""
    if not isinstance(dst, str | os.PathLike):  # an int is a file descriptor to os.path.exists
        raise TypeError(
            f"the export destination must be a folder path (a str or os.PathLike), got {type(dst).__name__} {dst!r}"
        )
    refuse_empty_location(os.fspath(dst))  # os.path reads "" as the current folder, which zarr's mode="w" empties
    if "://" in os.fspath(dst):  # the storage options are the source's; a folder named "s3:" is no export
        raise ValueError(
            f"the export destination must be a local folder, got the URL {os.fspath(dst)!r}; export here, then copy "
            "it (e.g. `aws s3 sync`)"
        )
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise FileExistsError(f"{os.fspath(dst)}: the export destination must be a new or empty folder, not a file")
    held = sorted(os.listdir(dst)) if os.path.isdir(dst) else []
    if held:  # what it holds, so that the leftovers of an export killed part way are recognised
        raise FileExistsError(
            f"{os.fspath(dst)}: the export destination must be a new or empty folder; it holds {held[:5]}"
            f"{' ...' if len(held) > 5 else ''} (an export interrupted there? remove the folder first)"
        )
    if isinstance(src, str | os.PathLike) and "://" not in os.fspath(src):
        source, target = os.path.realpath(src), os.path.realpath(dst)
        if target.startswith(source.rstrip(os.sep) + os.sep):
            raise ValueError(
                f"{os.fspath(dst)}: the export destination is inside the source buffer {os.fspath(src)!r}; "
                "choose a folder outside it"
            )


@contextmanager
def new_folder(dst: str | os.PathLike, src: Any = None) -> Iterator[None]:
    """``check_new_folder``, then, when the export fails, remove what it wrote: a half-written
    export must not pass for a dataset (a diffusion_policy zarr's unwritten chunks read as zeros)."""
    check_new_folder(dst, src)
    existed = os.path.isdir(dst)
    missing = missing_parents(dst)
    try:
        yield
    except BaseException as error:
        if not existed:
            shutil.rmtree(dst, ignore_errors=True)
        elif os.path.isdir(dst):  # it was empty: everything in it is the export's
            for entry in os.scandir(os.fspath(dst)):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        remove_empty(missing)  # the parents the export made (they were left), while still empty
        if isinstance(error, OSError) and error.errno is not None and error.filename is None:
            # a writer's error naming no file (zarr's, pyarrow's "No space left on device")
            raise OSError(
                error.errno, f"exporting into {os.fspath(dst)!r} failed: {error.strerror}; what it wrote was removed"
            ) from error
        raise


def exported_episodes(
    src: Any, storage_options: dict | None = None
) -> tuple[ReplayBuffer, np.ndarray, Iterator[tuple[int, dict[str, np.ndarray], dict[str, Any]]]]:
    """A buffer opened read-only, the lengths of its committed episodes (oldest first) as of
    opening, and an iterator of (slot, per-step arrays, meta values) over those episodes, one at
    a time, each read whole as it was planned: an episode a writer overwrote or dropped since
    raises ``ConcurrentWriteError`` (retryable) rather than exporting another episode's steps
    under the planned length (what exporters write)."""
    buffer = ReplayBuffer.from_folder(src, read_only=True, storage_options=storage_options)
    slots = buffer.valid_episodes()
    if not len(slots):  # a LeRobot folder of none had no episode columns: no reader opened it
        buffer.close()
        raise ValueError(f"{os.fspath(src)}: the buffer holds no committed episodes; nothing to export")
    lens = np.asarray(buffer.episode_lens, np.int64)[slots]
    generations = np.asarray(buffer.generations, np.int64)[slots]

    def episodes() -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
        for slot, length, generation in zip(slots.tolist(), lens.tolist(), generations.tolist()):
            read = read_episodes_consistent(buffer, [slot], generations=[generation])
            if len(read) == 0:
                raise ConcurrentWriteError(buffer.storage.location, [slot], 0)
            data = {name: values[0, :length] for name, values in read.data.items()}
            yield slot, data, {name: values[0] for name, values in read.meta.items()}

    return buffer, lens, episodes()
