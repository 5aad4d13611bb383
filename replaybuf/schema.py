"""Field specs, the stored config, and comparing a stored config with a requested one.

A field spec is what users pass to ``ReplayBuffer(fields=...)``: ``'float'``, ``('int', 2)``,
``('float', (3, 16, 16), 0.)`` or, as an extension, a dict with ``dtype``, ``shape``,
``default``, ``chunks`` (time steps per chunk) and ``compressor`` (``'zstd:5'``, ``'none'``).
The whole config serialises to plain JSON: a buffer never stores pickles.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT_NAME = "replaybuf"
# 2: zarr data chunks end with a crc32c and are stored even when all zero; memmap and hdf5
# keep a crc32c per committed (field, episode) in replaybuf/checksums.npy. 3: zarr packs small
# fields; memmap and hdf5 checksum entries check themselves (a tag in bits 33-63). 4: every
# backend keeps a checksum of each committed slot's meta values (meta/_meta_sum) and a crc32c
# in its counters. 5: each zarr shard (image fields) holds a binding to its field and slot
# (storage/_shards.py, ShardBinding), and each slot's meta checksum covers its length too
# (metasums.py). 6, zarr only (storage/_zarr.py, ZARR_FORMAT_VERSION): each shard's binding
# and each slot's meta checksum name its buffer (uuid) too; memmap and hdf5 keep their checksums apart from the data, so they
# stay format 5, which an earlier release reads. 7, zarr only: each shard's binding names its
# episode's generation too. Earlier formats open, read and write as they were.
# The newest format memmap and hdf5 write:
FORMAT_VERSION = 5

# the seed's short names, kept exactly: 'int' is int32, 'float' float32
SHORT_DTYPES = {"int": "int32", "float": "float32", "bool": "bool", "uint8": "uint8"}

RESERVED_META_FIELDS = ("episode_lens", "_generation", "_revision", "_meta_sum")
MAX_TIMESTEPS = 2**31 - 1
MAX_EPISODE_BYTES = 16 * 2**30
# Every open reads the per-episode arrays (meta fields, episode_lens, _generation, _revision) whole into
# RAM; a config whose arrays exceed this is refused before anything is allocated (a damaged
# max_episodes of 10**9 would otherwise take 12 GB before failing). 4 GiB is 214 million
# episodes with no meta fields.
MAX_META_BYTES = 4 * 2**30
# the longest field name a new buffer takes, in bytes of UTF-8: the backends name files and
# folders after the fields (memmap ``<name>.data.meta.npy``, zarr ``data/<name>/``), and most
# file systems take names of at most 255 bytes
MAX_NAME_BYTES = 200
# bytes per episode of the bookkeeping arrays (episode_lens int32, _generation and _revision
# int64, _meta_sum uint64)
_BOOKKEEPING_BYTES = 28


def parse_dtype(name: str, spec: Any) -> np.dtype:
    """The numpy dtype for a dtype string of a field spec, or a TypeError naming the field."""
    if not isinstance(spec, str):
        raise TypeError(f"field {name!r}: dtype must be a string such as 'float' or 'uint8', got {spec!r}")
    resolved = SHORT_DTYPES.get(spec, spec)
    try:
        dtype = np.dtype(resolved)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf" or dtype.names is not None:
        raise TypeError(
            f"field {name!r}: unknown dtype {spec!r}; expected one of {tuple(SHORT_DTYPES)} "
            "or a numeric numpy dtype name such as 'float16' or 'int64'"
        )
    if dtype.byteorder not in "=|":  # every backend stores native order: the buffer would not reopen
        raise TypeError(
            f"field {name!r}: dtype {spec!r} is not in this machine's byte order; "
            f"use {dtype.newbyteorder('=').name!r} (values are converted when stored)"
        )
    # the canonical dtype of its name: 'longlong' ('q') is int64 of another numpy type, which zarr
    # has no data type for, so its create failed after an overwrite had erased the old buffer
    return np.dtype(dtype.name)


class UnknownFieldError(ValueError, KeyError):
    """A field name the buffer (or a collector, or a batch) does not have.

    A ValueError as every bad input in replaybuf, and a KeyError as memmap-replay-buffer raises
    when it looks the name up (``get_all_data(fields=...)``, a dataset's ``fields``, ``filter_meta``,
    ``filter_fields``, a loader's ``return_mask`` without ``_lens``), so either ``except`` catches it.
    """

    __str__ = ValueError.__str__


class ShapeValueError(TypeError, ValueError):
    """A field shape of ints not all positive: a malformed spec (``TypeError``, as every other
    one here) and a bad value (``ValueError``, what the seed's numpy raises for a negative one)."""


def _parse_shape(name: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    ints = isinstance(shape, (tuple, list)) and all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape
    )
    if not ints or not all(d > 0 for d in shape):
        error = ShapeValueError if ints else TypeError
        raise error(f"field {name!r}: shape must be a positive int or a tuple of positive ints, got {shape!r}")
    return tuple(int(d) for d in shape)


@dataclass(frozen=True)
class Field:
    """One stored field: per timestep (``data/<name>``) or per episode (``meta/<name>``)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    default: Any = None
    chunks: int | None = None
    compressor: str | None = None
    spec: Any = field(default=None, compare=False)

    @property
    def fill(self) -> Any:
        """The value stored where the user gave none: the declared default, else zero."""
        return 0 if self.default is None else self.default

    @property
    def step_nbytes(self) -> int:
        # math.prod: np.prod costs ~7 us a call, and cache reads ask this for every map they open
        return math.prod(self.shape) * self.dtype.itemsize

    def dimension_names(self, per_episode: bool = False) -> tuple[str, ...]:
        """Axis names of the stored array: ``episode``, ``time`` (data fields only), then the
        feature axes, ``<name>_height``, ``<name>_width``, ``<name>_channel`` for frames and
        ``<name>_dim0``, ``<name>_dim1``, ... otherwise. Feature axes carry the field's name
        because xarray, which reads these names, needs one size per name across a Dataset."""
        from .video import CHANNEL_COUNTS, is_image_field

        if not per_episode and is_image_field(self.shape, self.dtype):
            axes = ["height", "width"]
            if len(self.shape) == 3:
                channel_last = self.shape[-1] in CHANNEL_COUNTS
                axes = [*axes, "channel"] if channel_last else ["channel", *axes]
        else:
            axes = [f"dim{i}" for i in range(len(self.shape))]
        return ("episode", *(() if per_episode else ("time",)), *(f"{self.name}_{a}" for a in axes))

    def to_json(self) -> dict:
        out = {"dtype": self.dtype.name, "shape": list(self.shape), "default": self.default}
        if self.chunks is not None:
            out["chunks"] = self.chunks
        if self.compressor is not None:
            out["compressor"] = self.compressor
        return out

    @classmethod
    def from_json(cls, name: str, data: dict) -> Field:
        return parse_field(name, data)


# what a meta field name may hold besides what an identifier holds: memmap-replay-buffer takes
# any string as a meta field name, and its folders hold names such as 'task-id', 'env.id' or
# 'success rate'; these characters are safe in every backend's file, array and object names
META_NAME_EXTRA_CHARACTERS = " -."


def check_field_name(name: Any, meta: bool = False) -> None:
    """Refuse a field name that cannot name the field's files and arrays: a data field's must be
    an identifier (``store()`` returns a namedtuple of them); a meta field's may also hold
    ``META_NAME_EXTRA_CHARACTERS``, but not start with ``.`` (a hidden file, ``..``)."""
    if isinstance(name, str) and name.isidentifier():
        return
    if not meta:
        raise ValueError(f"field name {name!r} is not a valid identifier")
    if not (
        isinstance(name, str)
        and name
        and not name.startswith(".")
        and all(c.isalnum() or c == "_" or c in META_NAME_EXTRA_CHARACTERS for c in name)
    ):
        raise ValueError(
            f"meta field name {name!r} is refused: it names files and arrays, so it holds only letters, "
            f"digits, '_', '-', '.' and spaces, and does not start with '.'"
        )


def parse_field(name: str, spec: Any, meta: bool = False) -> Field:
    """Turn one user field spec into a Field, raising TypeError/ValueError that name the field."""
    check_field_name(name, meta)
    chunks = compressor = None
    if isinstance(spec, dict):
        unknown = set(spec) - {"dtype", "shape", "default", "chunks", "compressor"}
        if unknown:
            raise ValueError(
                f"field {name!r}: unknown spec keys {sorted(unknown)}; "
                "expected dtype, shape, default, chunks, compressor"
            )
        if "dtype" not in spec:
            raise ValueError(f"field {name!r}: a dict spec needs a 'dtype' key")
        dtype_spec, shape, default = spec["dtype"], spec.get("shape", ()), spec.get("default")
        chunks, compressor = spec.get("chunks"), spec.get("compressor")
    elif isinstance(spec, str):
        dtype_spec, shape, default = spec, (), None
    elif isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        dtype_spec, shape = spec[0], spec[1]
        default = spec[2] if len(spec) == 3 else None
    else:
        loose_shape = isinstance(spec, (tuple, list)) and len(spec) > 3 and all(type(n) is int for n in spec[1:])
        raise TypeError(
            f"field {name!r}: spec must be 'dtype', (dtype, shape) or (dtype, shape, default), got {spec!r}"
            + (f"; the shape is one tuple: ({spec[0]!r}, {tuple(spec[1:])!r})" if loose_shape else "")
        )
    dtype = parse_dtype(name, dtype_spec)
    shape = _parse_shape(name, shape)
    if default is not None:
        default = _parse_default(name, default)
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"field {name!r}: chunks must be a positive number of timesteps, got {chunks!r}")
    if compressor is not None:
        parse_compressor(compressor, name)
    return Field(name, dtype, shape, default, chunks, compressor, spec)


def _parse_default(name: str, default: Any) -> bool | int | float:
    """A field default as the Python bool, int or float the JSON config holds. NumPy's other
    scalars (``np.complex128``, ``np.str_``, ``np.datetime64``, ...) are refused as their Python
    types are: they were taken, then failed writing the config after an overwrite had erased the
    buffer it replaced, or made a config that no longer opened."""
    if isinstance(default, (np.bool_, np.integer, np.floating)):
        number = default.item()
        if not isinstance(number, (bool, int, float)):  # a long double stays a NumPy scalar
            with np.errstate(over="ignore"):
                number = float(default)
            if math.isinf(number) and np.isfinite(default):
                raise ValueError(f"field {name!r}: default {default!r} does not fit a 64-bit float")
        return number
    if isinstance(default, (bool, int, float)):
        return default
    raise TypeError(f"field {name!r}: default must be a number or bool, got {default!r} ({type(default).__name__})")


COMPRESSORS = ("zstd", "blosc-lz4", "blosc-zstd", "gzip", "none")
# the levels each compressor takes (zstd's negative ones are its fast levels): a level outside
# them failed in the codec, at the create after an overwrite had erased the buffer it replaced
# (zstd, gzip), or at every write (blosc)
COMPRESSOR_LEVELS = {"zstd": (-131072, 22), "blosc-lz4": (0, 9), "blosc-zstd": (0, 9), "gzip": (0, 9)}


def parse_compressor(text: str, name: str = "") -> tuple[str, int | None]:
    """``'zstd:5'`` -> ('zstd', 5); ``'blosc-lz4'`` -> ('blosc-lz4', None); ``'none'`` -> ('none', None)."""
    where = f"field {name!r}: " if name else ""
    if not isinstance(text, str):
        raise TypeError(f"{where}compressor must be a string such as 'zstd:3' or 'none', got {text!r}")
    kind, _, level = text.partition(":")
    if kind not in COMPRESSORS or (level and not level.lstrip("-").isdigit()) or (kind == "none" and level):
        raise ValueError(
            f"{where}unknown compressor {text!r}; expected one of {COMPRESSORS}, "
            "optionally with ':LEVEL' (e.g. 'zstd:5')"
        )
    if not level:
        return kind, None
    low, high = COMPRESSOR_LEVELS[kind]
    if not low <= int(level) <= high:
        raise ValueError(f"{where}compressor {text!r}: {kind} takes levels {low} to {high}, got {int(level)}")
    return kind, int(level)


@dataclass(frozen=True)
class Schema:
    """Everything that defines a buffer's layout; stored as JSON in the buffer."""

    fields: dict[str, Field]
    meta_fields: dict[str, Field]
    max_episodes: int
    max_timesteps: int
    circular: bool = False
    #: the buffer's identity, set at create (an optional config key: buffers written before it
    #: existed have none); never a config difference, so a reopen need not pass it
    uuid: str | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls, fields: dict, meta_fields: dict | None, max_episodes: int, max_timesteps: int, circular: bool = False
    ) -> Schema:
        """Validate user arguments into a Schema."""
        for arg, value in (("max_episodes", max_episodes), ("max_timesteps", max_timesteps)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if not isinstance(fields, dict) or not fields:
            raise ValueError(f"fields must be a non-empty dict of name -> spec, got {fields!r}")
        meta_fields = {} if meta_fields is None else meta_fields
        if not isinstance(meta_fields, dict):
            raise TypeError(f"meta_fields must be a dict of name -> spec, got {meta_fields!r}")
        shared = sorted(set(fields) & set(meta_fields))
        if shared:
            raise ValueError(f"fields and meta_fields must not share names; both define {shared}")
        reserved = sorted((set(fields) | set(meta_fields)) & set(RESERVED_META_FIELDS))
        if reserved:
            raise ValueError(
                f"field names {reserved} are reserved for the buffer's own bookkeeping "
                f"(the names {list(RESERVED_META_FIELDS)}); name the field otherwise"
            )
        schema = cls(
            {n: parse_field(n, s) for n, s in fields.items()},
            {n: parse_field(n, s, meta=True) for n, s in meta_fields.items()},
            int(max_episodes),
            int(max_timesteps),
            bool(circular),
        )
        schema._check_episode_size()
        return schema

    def check_defaults(self) -> None:
        """Refuse, for a new buffer, a default its field's dtype cannot hold, by the rule for
        written values (the value stored for every step not given); a stored config is not
        checked again, so a buffer opens as it was created."""
        from .inputs import cast_values  # inputs imports this module

        for f in (*self.fields.values(), *self.meta_fields.values()):
            if f.default is None:
                continue
            try:
                cast_values(np.asarray(f.default), f)
            except ValueError as e:
                reason = str(e).removeprefix(f"field {f.name!r}: ")
                raise ValueError(f"field {f.name!r}: default {f.default!r} is refused: {reason}") from None

    def check_names(self) -> None:
        """Refuse, for a new buffer, a field name too long to name its files (``MAX_NAME_BYTES``):
        the create failed on it only after an overwrite had erased the buffer it replaced; and a
        data field name ``store()``'s namedtuple cannot hold (a Python keyword, a leading
        underscore), refused at creation as memmap-replay-buffer does. A stored config is not
        checked again, so a buffer opens as it was created."""
        for name in self.fields:
            if keyword.iskeyword(name) or name.startswith("_"):
                what = "is a Python keyword" if keyword.iskeyword(name) else "starts with an underscore"
                raise ValueError(
                    f"field name {name!r} {what}: store() returns a namedtuple of the data fields, which "
                    "cannot hold it (memmap-replay-buffer refuses it too); rename the field"
                )
        for name in (*self.fields, *self.meta_fields):
            size = len(name.encode())
            if size > MAX_NAME_BYTES:
                raise ValueError(
                    f"field name {name[:32]!r}... is {size} bytes long (UTF-8): a new buffer takes names of at most "
                    f"{MAX_NAME_BYTES} bytes, as its files are named after its fields"
                )

    def _check_episode_size(self) -> None:
        """Refuse sizes no storage can hold, before anything is created or loaded."""
        meta_bytes = self.max_episodes * (_BOOKKEEPING_BYTES + sum(f.step_nbytes for f in self.meta_fields.values()))
        if meta_bytes > MAX_META_BYTES:
            raise ValueError(
                f"max_episodes {self.max_episodes} needs {meta_bytes / 2**30:,.1f} GiB of per-episode arrays "
                f"(lengths, order, meta fields) held in RAM, over the {MAX_META_BYTES // 2**30} GiB limit "
                "(replaybuf.schema.MAX_META_BYTES)"
            )
        if self.max_timesteps > MAX_TIMESTEPS:
            raise ValueError(f"max_timesteps {self.max_timesteps} exceeds {MAX_TIMESTEPS} (episode lengths are int32)")
        for f in self.fields.values():
            episode_bytes = f.step_nbytes * self.max_timesteps
            if episode_bytes > MAX_EPISODE_BYTES:
                raise ValueError(
                    f"field {f.name!r}: max_timesteps {self.max_timesteps} x {f.step_nbytes} bytes per step is "
                    f"{episode_bytes / 2**30:,.0f} GiB per episode, over the {MAX_EPISODE_BYTES // 2**30} GiB an "
                    "episode in progress may stage in RAM; lower max_timesteps"
                )

    def to_json(self) -> dict:
        return {
            "max_episodes": self.max_episodes,
            "max_timesteps": self.max_timesteps,
            "circular": self.circular,
            "fields": {n: f.to_json() for n, f in self.fields.items()},
            "meta_fields": {n: f.to_json() for n, f in self.meta_fields.items()},
            **({"uuid": self.uuid} if self.uuid is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> Schema:
        """A stored config, checked as ``build`` checks user arguments (types, names, sizes)."""
        if not isinstance(data["circular"], bool):
            raise TypeError(f"circular must be true or false, got {data['circular']!r}")
        uuid = data.get("uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise TypeError(f"uuid must be a string, got {uuid!r}")
        schema = cls.build(
            data["fields"], data["meta_fields"], data["max_episodes"], data["max_timesteps"], data["circular"]
        )
        return dataclasses.replace(schema, uuid=uuid)

    def differences(self, passed: Schema) -> list[str]:
        """One line per config key where ``self`` (stored) and ``passed`` differ."""
        stored, wanted = self.to_json(), passed.to_json()
        lines = []
        for key in ("max_episodes", "max_timesteps", "circular"):
            if stored[key] != wanted[key]:
                lines.append(f"  {key}: stored {stored[key]!r} vs passed {wanted[key]!r}")
        for group in ("fields", "meta_fields"):
            for name in sorted(set(stored[group]) | set(wanted[group])):
                a, b = stored[group].get(name), wanted[group].get(name)
                if a != b:
                    lines.append(f"  {group}.{name}: stored {_describe(a)} vs passed {_describe(b)}")
        return lines

    def check_matches(self, passed: Schema, location: str) -> None:
        """Raise ValueError listing every differing key if the stored config is not ``passed``."""
        lines = self.differences(passed)
        if lines:
            raise ValueError(
                f"buffer at {location!r} was created with a different config:\n"
                + "\n".join(lines)
                + f"\nOpen it with ReplayBuffer.from_folder({location!r}) and no settings to use the stored config, "
                "or create it anew with ReplayBuffer(folder, ..., overwrite=True) (erasing its episodes)."
            )

    def field(self, name: str) -> Field:
        """The Field called ``name``, data or meta."""
        if name in self.fields:
            return self.fields[name]
        if name in self.meta_fields:
            return self.meta_fields[name]
        raise ValueError(
            f"unknown field {name!r}; fields are {sorted(self.fields)}, meta fields are {sorted(self.meta_fields)}"
        )


def _describe(spec: dict | None) -> str:
    return "(absent)" if spec is None else json.dumps(spec, sort_keys=True)
