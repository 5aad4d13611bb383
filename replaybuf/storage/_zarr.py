"""The default backend: a zarr v3 group on local disk, in memory, or on any object store.

Layout: group attributes hold ``{"format": "replaybuf", "version": 4, <schema>}`` as JSON;
arrays ``data/<field>`` (episode, time, *shape) chunked (1, T_chunk, *shape) so no two episodes
share a chunk (packed small fields aside, see below), ``meta/<field>`` (episode, *shape) chunked by up to 16,384 episodes, with zarr
``dimension_names`` (``Field.dimension_names``) so xarray opens them; counters in the object
``replaybuf/state.json``; step logs under ``replaybuf/steplog/`` (``STATE_NODE_KEY``). Chunks are read
and written by the direct path in ``_chunks.py``; zarr-python creates the metadata and serves
any indexing the direct path does not cover.

Format 2 (format 1 buffers open and are written as they are): every data chunk, and every
inner chunk of a shard, ends with zarr v3's ``crc32c`` codec, and chunks of written spans are
stored even when all zero, so a flipped byte, a truncated, empty or missing chunk of a
committed episode reads as ``CorruptChunkError`` naming field, slot, timesteps and key. Meta
arrays carry no chunk checksum: they are rewritten in place a few bytes per commit (see
``META_CHUNK_EPISODES``), and a checksum would turn that into a whole-chunk rewrite (format 4
checksums each slot's values in ``meta/_meta_sum`` instead, ``replaybuf/metasums.py``).

Format 3 (formats 1 and 2 open and are written as they are): small data fields (vectors and
scalars with no ``chunks`` or ``compressor`` spec, see ``packed_episodes``) of buffers created
on local disk are *packed* (object stores and ``memory://`` keep a chunk per episode: they
cannot write in place): many
episodes share one uncompressed chunk of whole rows, (E, max_timesteps, *shape) with E chosen
by bytes (``PACKED_CHUNK_BYTES``), written in place like the meta arrays. Storing one short
episode is then one small write per field into an existing file (no new file, no encode), and
a reader loads a whole field in a few large reads instead of one file per episode. A chunk is
created whole the first time one of its slots is written. Packed chunks carry no crc32c (an
in-place row write would invalidate a whole-chunk checksum): instead each committed (packed
field, episode) has one, as the memmap backend keeps them, in ``replaybuf/checksums``
(``CHECKSUMS_KEY``), written before the length publishes the episode and checked on every
whole-episode read; a flipped byte, a truncated or missing chunk reads as ``CorruptChunkError``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..schema import FORMAT_NAME, Field, Schema
from ._chunks import ChunkedArray, nearby_spans
from ._codecs import ChunkCodec, compression_ratio, compressor_codec, crc32c, crc_bit_flipped
from ._hot import HotTier, find_hot
from ._hotmap import shard_maps
from ._kv import KeyValue, KVBlobs, LocalKV, StoreKV
from ._local import refuse_foreign_buffer
from ._owned import BLOB_DIR, check_owned, erase_owned
from ._owner import OwnerMethod
from ._shards import ShardBinding, ShardedArray
from .base import (
    META_SUM,
    OPTIONAL_META,
    STATE_KEY,
    BufferDamagedError,
    BufferNotFoundError,
    ChecksumEntryError,
    CompactionSummary,
    CorruptChunkError,
    EpisodeLengthError,
    Storage,
    StorageError,
    UnfinishedCreateError,
    bookkeeping_fields,
    check_layout,
    empty_state,
    is_url,
    last_occurrences,
    object_store_endpoint,
    object_store_url,
    parse_json,
    refuse_unencodable_names,
    warn_local_options,
)
from .lease import ObjectLease, ProcessLease, WriterLease
from .spans import Spans

if TYPE_CHECKING:
    from zarr.core.common import JSON

DEFAULT_COMPRESSOR = "zstd"
DEFAULT_ZSTD_LEVEL = 3
# Image-like fields default to blosc-lz4 (no shuffle, level 9): it decodes a frame ~3x and
# encodes it ~2x faster than zstd-3, which is what per-step sampling, whole-buffer reads and
# store_episode() pay, for ~40% more bytes on rendered frames and ~10% more on camera images
# (benchmarks/RESULTS.md, "Codec choice"). Small fields keep zstd-3: they are read once.
DEFAULT_IMAGE_COMPRESSOR = "blosc-lz4:9"
# Image-like steps get one frame per inner chunk so random timestep sampling decodes only what
# it uses, inside one shard per episode; small vectors get long chunks
# (benchmarks/RESULTS.md, "Codec choice").
IMAGE_STEP_BYTES = 4096
SMALL_CHUNK_BYTES = 1 << 16
# Image fields whose spec names no compressor are measured when their first rows are written:
# under this ratio (camera noise: blosc-lz4 gives ~1.01x) the codec costs time on every write
# and read for no space, and the field is stored raw (its crc32c kept). The choice is made
# before any chunk of the field exists, written into the array's metadata (which every reader,
# zarr's included, decodes by) and recorded in the root attributes under MEASURED_CODECS:
# field -> null while not yet measured, else {"compressor": ..., "ratio": ...}.
MIN_COMPRESSION_RATIO = 1.2
MEASURED_CODECS = "measured_codecs"
# Per-episode arrays are stored uncompressed so that publishing one episode's length or meta
# value is a single in-place write of a few bytes, as a memmap would do, not a chunk rewrite.
META_CHUNK_EPISODES = 16384
# zarr buffers are format 7 (3: packed small fields; 4: meta checksums, as memmap and hdf5;
# 5: each shard bound to its field and slot, lengths under the meta checksums; 6: each shard
# and each slot's meta checksum bound to its buffer too; 7: each shard bound to its episode's
# generation too)
ZARR_FORMAT_VERSION = 7
# the first format whose shards hold a binding to their field and slot (``_shards.ShardBinding``):
# an earlier release writes shards without one, so an earlier format neither writes nor checks it
SHARD_BINDING_FORMAT = 5
# the first format whose shards' bindings and meta checksums name their buffer too (its uuid): a
# format-5 buffer's name neither, and it keeps them so (an earlier release writes it)
BUFFER_BINDING_FORMAT = 6
# the first format whose shards' bindings name their episode's generation: an older shard of the
# same slot (a partial backup restore) is refused even at the same length
GENERATION_BINDING_FORMAT = 7
# the attribute of the documents of a sharded array and of ``meta/_meta_sum`` (format 6) holding
# the uuid their contents are bound to (each shard's binding, each slot's meta checksum): a
# second copy of the config's, so that a damaged config uuid (or another buffer's meta folder,
# copied in whole) is refused by name at the open, never every shard read as another buffer's
# or every slot's meta values as damaged (which ``verify --repair`` would drop)
BOUND_TO = "bound_to"
# the name the documents of sharded arrays gave ``BOUND_TO`` in main's first format-6 commits,
# whose ``meta/_meta_sum`` kept none and whose entries were hashed as format 5's, bound to no
# buffer (``ZarrStorage.early_hashing``)
EARLY_BOUND_TO = "shards_bound_to"
# the attribute (true) of a sharded array's document from format 7: its shards' bindings name their
# episodes' generations, so a config whose version says otherwise (edited down to 6, or up to 7
# over a format-6 buffer) is refused by name, never every shard read as damage
BINDS_GENERATIONS = "binds_generations"
# Raw bytes of one packed chunk: a 100,000 x 20-step f32[32] field is ~250 files, not 100,000,
# and creating a chunk (written whole, once) costs ~1 ms spread over the episodes it holds.
PACKED_CHUNK_BYTES = 1 << 20
# (max_episodes, packed fields) uint64 little-endian: 1 << 32 | crc32c of each committed row
# of a packed field (0: none kept), in the column order of the packed fields in the schema
CHECKSUMS_KEY = "replaybuf/checksums"
_SEALED = 1 << 32
# a crc32c mismatch is read again this many times before it is damage: a writer reusing the
# slot between the row read and the checksum read is not
_CHECK_READS = 3


# chunk keys "c.0.3" rather than "c/0/3": one file per chunk, not a directory tree of them
FLAT_KEYS: dict[str, JSON] = {"name": "default", "separator": "."}
# the root group's document: its attributes mark the location as a replaybuf buffer
ROOT_DOCUMENT = "zarr.json"
# a root attribute an overwrite sets before it erases anything: the buffer's readers see it
# replaced at once, and nothing opens it again (``ZarrStorage._retire``)
REPLACING = "replacing"

# The folder of the counters and step logs is declared to zarr as an empty array: zarr readers
# list it as a member and look no further into it, where a folder without zarr.json (or a group,
# whose every file is listed) makes zarr warn "Object at replaybuf is not recognized as a
# component of a Zarr hierarchy" for each object. Written at create and on writable opens of
# buffers made before it existed; replaybuf itself never reads it.
STATE_NODE_KEY = "replaybuf/zarr.json"
STATE_NODE = {
    "zarr_format": 3,
    "node_type": "array",
    "shape": [0],
    "data_type": "uint8",
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
    "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
    "fill_value": 0,
    "codecs": [{"name": "bytes"}],
    "attributes": {"replaybuf": "counters (state.json) and step logs (steplog/) of this buffer; no array data"},
    "dimension_names": ["replaybuf_state"],
}


def is_sharded(field: Field) -> bool:
    """Image-like fields store one shard per episode holding one inner chunk per frame."""
    return field.step_nbytes >= IMAGE_STEP_BYTES


def packed_episodes(field: Field, max_episodes: int, max_timesteps: int) -> int:
    """Episodes per chunk of a data field: more than 1 for a packed field (format 3: a small
    field with no ``chunks`` or ``compressor`` spec whose whole rows fit ``PACKED_CHUNK_BYTES``
    several times), 1 for every other field."""
    if is_sharded(field) or field.chunks is not None or field.compressor is not None:
        return 1
    return max(1, min(max_episodes, PACKED_CHUNK_BYTES // max(field.step_nbytes * max_timesteps, 1)))


def default_time_chunk(field: Field, max_timesteps: int) -> int:
    """Timesteps per chunk for a data field: explicit ``chunks``, else chosen by step size."""
    if field.chunks is not None:
        return min(field.chunks, max_timesteps)
    if field.step_nbytes >= IMAGE_STEP_BYTES:
        return 1
    return int(min(max_timesteps, max(1, SMALL_CHUNK_BYTES // max(field.step_nbytes, 1))))


def _create_meta_array(group: Any, field: Field, max_episodes: int, attributes: dict | None = None) -> None:
    """Create the per-episode array of ``field`` in zarr group ``group`` (uncompressed: a
    commit writes a few bytes of it in place), its document holding ``attributes``."""
    group.create_array(
        field.name,
        shape=(max_episodes, *field.shape),
        chunks=(min(max_episodes, META_CHUNK_EPISODES), *field.shape),
        dtype=field.dtype,
        compressors=_compressor(field, "none"),
        fill_value=0,
        chunk_key_encoding=FLAT_KEYS,
        dimension_names=field.dimension_names(per_episode=True),
        attributes=attributes,
    )


def _compressor(field: Field, default: str):
    return compressor_codec(field.compressor or default, field.dtype, DEFAULT_ZSTD_LEVEL)


def _data_codecs(field: Field) -> list:
    """A data field's bytes-to-bytes codecs: its compressor, then crc32c (format 2), so every
    stored chunk (the inner chunks of a shard) is checked by any zarr v3 reader."""
    from zarr.codecs import Crc32cCodec

    compressor = _compressor(field, default_compressor(field))
    return [*([] if compressor is None else [compressor]), Crc32cCodec()]


def measured_fields(schema: Schema) -> list[str]:
    """Data fields whose codec is chosen by measurement: image-like, no compressor named."""
    return [name for name, field in schema.fields.items() if field.compressor is None and is_sharded(field)]


def default_compressor(field: Field) -> str:
    """The compressor a data field gets when its spec names none."""
    return DEFAULT_IMAGE_COMPRESSOR if is_sharded(field) else DEFAULT_COMPRESSOR


def _local_root(location: str) -> str:
    return os.path.abspath(location[len("file://") :] if location.startswith("file://") else location)


class ZarrStorage(KVBlobs, Storage):
    """Zarr v3 storage for local paths, ``memory://`` and object-store URLs (``s3://``, ``gs://``)."""

    backend_name = "zarr"
    newest_format_version = ZARR_FORMAT_VERSION
    supports_remote = True
    supports_field_codecs = True  # honours per-field ``compressor`` specs

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        super().__init__(location, storage_options, fsync=fsync)
        if not is_url(self.location):
            warn_local_options(self.location, self.storage_options, self.backend_name)
        self.kv = self._make_kv(self.location, self.storage_options, fsync)
        self._arrays: dict[tuple[str, bool], ChunkedArray] = {}
        self._unmeasured: set[str] = set()  # fields whose codec is chosen at their first write
        self._packed: list[str] = []  # the packed fields: the columns of CHECKSUMS_KEY
        self._hot: HotTier | None = None  # a local writer's hot tier (``_hot.py``)
        # slot -> the generation its episode being written will publish (``plan_generations``)
        self._planned: dict[int, int] = {}
        # a reader's buffer: the uuid in the root attributes it opened (None: an earlier format's)
        self._reading: tuple[str | None] | None = None
        # a local reader's root document as it stat()ed it then (``replaced(cheap_only=True)``)
        self._root_stat: tuple[int, int, int] | None = None

    def __getstate__(self) -> dict:
        # docstring inherited: the hot tier (its lock and thread) stays with the writer
        return {**super().__getstate__(), "_hot": None}

    @staticmethod
    def _make_kv(location: str, storage_options: dict, fsync: bool, read_only: bool = False) -> KeyValue:
        if not is_url(location):
            return LocalKV(_local_root(location), fsync=fsync)
        return StoreKV(functools.partial(_open_zarr_store, location, storage_options, read_only), location)

    def writer_lease(self) -> WriterLease:
        # docstring inherited
        if self.location.startswith("memory://"):
            return ProcessLease(self.location)
        if not isinstance(self.kv, StoreKV):
            return super().writer_lease()
        # one buffer whatever its spelling (s3a://, a trailing /), and one per server: a URL on
        # two endpoints shared one lease in a process, so the second took none on its server
        url = object_store_url(self.location) or self.location
        identity = f"{url} [endpoint {object_store_endpoint(self.location, self.storage_options) or 'default'}]"
        return ObjectLease(self.kv, self.location, identity=identity)

    def _zarr_store(self, read_only: bool):
        if not is_url(self.location):
            import zarr

            return zarr.storage.LocalStore(_local_root(self.location), read_only=read_only)
        return _open_zarr_store(self.location, self.storage_options, read_only)

    # ---- discovery ------------------------------------------------------------------------

    def _root_document(self) -> dict | None:
        raw = self.kv.get_document(ROOT_DOCUMENT)
        return None if raw is None else parse_json(raw, self.describe_key(ROOT_DOCUMENT))

    def _root_attributes(self, document: dict | None = None) -> dict | None:
        """The replaybuf attributes of the root ``document`` (None: read it now)."""
        document = self._root_document() if document is None else document
        if document is None:
            return None
        attributes = document.get("attributes", {})
        return attributes if isinstance(attributes, dict) and attributes.get("format") == FORMAT_NAME else None

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        # docstring inherited
        if not is_url(location) and not os.path.isfile(os.path.join(_local_root(location), ROOT_DOCUMENT)):
            return False
        try:
            return cls(location, storage_options).exists()
        except BufferDamagedError:
            # a root document that cannot be parsed is this backend's damage to name (as the
            # local backends name a garbage config): read as "no buffer", a damaged shard was
            # left out of ConcatReplayBuffer(root) silently, with its committed episodes
            return True
        except Exception:
            return False

    def exists(self) -> bool:
        # docstring inherited
        return self._root_attributes() is not None

    # ---- create / open -------------------------------------------------------------------

    def check_creatable(self) -> list[str]:
        # docstring inherited
        if not is_url(self.location):
            refuse_foreign_buffer(self)
        attributes = self._root_attributes()  # what exists() reads: one request on object stores
        if is_url(self.location):  # after the URL is checked (``open_store``)
            self._refuse_enclosing_buffer()
        self._refuse_erasing_a_newer_format(attributes)
        owned = (ROOT_DOCUMENT, "data", "meta") if attributes is not None else ()  # a user's data/ is not ours
        return check_owned(self.kv, self.location, owned.__contains__, holds_buffer=attributes is not None)

    def _refuse_enclosing_buffer(self) -> None:
        """On an object store, raise before creating a buffer under another buffer's prefix
        (``s3://b/run/data/x``, ``s3://b/run/x``), as ``refuse_enclosing_buffer`` does on local
        disk: that buffer's overwrite erases its ``data/`` and ``meta/`` with what they hold, the
        new buffer's episodes too. One read of each enclosing prefix's ``zarr.json``, up to the
        bucket; a prefix whose buffer cannot be read is left to the open of that prefix."""
        scheme, _, path = self.location.partition("://")
        parts = path.rstrip("/").split("/")
        for depth in range(len(parts) - 1, 0, -1):
            parent = f"{scheme}://{'/'.join(parts[:depth])}"
            if type(self).can_open(parent, self.storage_options):
                raise ValueError(
                    f"cannot create a buffer at {self.location!r}: it is inside the 'zarr' buffer at {parent!r}, "
                    "whose overwrite would erase it; nothing was written. Choose a prefix outside that buffer"
                )

    def check_schema(self, schema: Schema) -> None:
        # docstring inherited: a dtype zarr has no data type for (float128, numpy's long double),
        # a field name a local folder's encoding cannot write
        from zarr.core.dtype import get_data_type_from_native_dtype

        if not is_url(self.location):
            refuse_unencodable_names(schema, f"creating the zarr buffer at {self.location!r}")
        for field in (*schema.fields.values(), *schema.meta_fields.values()):
            try:
                get_data_type_from_native_dtype(field.dtype)
            except ValueError:
                raise TypeError(
                    f"field {field.name!r}: dtype {field.dtype.name!r} has no zarr data type; the zarr backend "
                    "stores bool, int8 to int64, uint8 to uint64 and float16 to float64 (or use backend='memmap' "
                    "or 'hdf5'); nothing was erased"
                ) from None

    def create(self, schema: Schema, overwrite: bool) -> None:
        # docstring inherited: ``schema.uuid`` is required, the identity the shards are bound to
        import zarr
        from zarr.core.buffer import default_buffer_prototype

        if schema.uuid is None:
            raise ValueError(
                f"creating the zarr buffer at {self.location!r}: its schema has no uuid, which each of its shards "
                "is bound to (format 6); ReplayBuffer and convert give every new buffer one (storage.new_uuid())"
            )
        entries = self.check_creatable()
        self.check_schema(schema)
        self.read_only = False
        self._reading = None
        self.format_version = ZARR_FORMAT_VERSION
        self.meta_sums_as_earlier = False
        if overwrite:
            self._retire()
            erase_owned(self.kv, entries, markers=(ROOT_DOCUMENT,))
        try:
            # the documents are made in memory and written here, in order and with no write of
            # zarr's still running when one fails. The root document, which makes the location a
            # buffer, goes first: a create killed part way leaves a buffer (damaged) that the
            # next overwrite=True erases and creates again, never entries it must call foreign
            documents: dict = {}
            root = zarr.open_group(
                zarr.storage.MemoryStore(documents),
                mode="w",
                zarr_format=3,
                attributes={
                    "format": FORMAT_NAME,
                    "version": ZARR_FORMAT_VERSION,
                    **schema.to_json(),
                    **({MEASURED_CODECS: dict.fromkeys(measured)} if (measured := measured_fields(schema)) else {}),
                },
            )
            data, meta = root.require_group("data"), root.require_group("meta")
            for field in schema.fields.values():
                chunk = default_time_chunk(field, schema.max_timesteps)
                # only files are written in place: on an object store a packed chunk would be
                # rewritten whole for every episode
                packed = (
                    packed_episodes(field, schema.max_episodes, schema.max_timesteps) if self.kv.writes_in_place else 1
                )
                data.create_array(
                    field.name,
                    shape=(schema.max_episodes, schema.max_timesteps, *field.shape),
                    chunks=(packed, schema.max_timesteps, *field.shape) if packed > 1 else (1, chunk, *field.shape),
                    dtype=field.dtype,
                    shards=(1, -(-schema.max_timesteps // chunk) * chunk, *field.shape) if is_sharded(field) else None,
                    compressors=_data_codecs(field) if packed == 1 else None,
                    fill_value=0,
                    chunk_key_encoding=FLAT_KEYS,
                    dimension_names=field.dimension_names(),
                    attributes={BOUND_TO: schema.uuid, BINDS_GENERATIONS: True} if is_sharded(field) else None,
                )
            for field in {**schema.meta_fields, **bookkeeping_fields(schema)}.values():
                bound = {BOUND_TO: schema.uuid} if field.name == META_SUM else None
                _create_meta_array(meta, field, schema.max_episodes, bound)
            state_node = json.dumps(STATE_NODE).encode()
            documents[STATE_NODE_KEY] = default_buffer_prototype().buffer.from_bytes(state_node)
            _consolidate(root.store)
            blobs = {key: value.to_bytes() for key, value in documents.items()}
            self.kv.set(ROOT_DOCUMENT, blobs.pop(ROOT_DOCUMENT))
            self.kv.set_many(blobs)
            self._load_arrays(schema)
            self._unmeasured = set(measured)
            if self._packed:
                self.kv.set(CHECKSUMS_KEY, bytes(8 * schema.max_episodes * len(self._packed)))
            self.commit_state(empty_state())
        except (OSError, StorageError) as e:
            # a create cut short (a full disk) leaves no half buffer that opens as damaged
            with contextlib.suppress(Exception):
                # what a create writes (the location held nothing else: ``check_creatable``
                # above), by name: a root document cut short would not read as ours
                self.kv.delete_many([STATE_NODE_KEY, CHECKSUMS_KEY])
                erase_owned(self.kv, [ROOT_DOCUMENT, "data/", "meta/", f"{BLOB_DIR}/"], markers=(ROOT_DOCUMENT,))
            raise StorageError(f"creating the buffer at {self.location!r} failed, nothing of it was kept: {e}") from e

    def open(self, read_only: bool) -> Schema:
        # docstring inherited
        root_stat = self._stat_root()  # before the read: a document replaced after it differs
        document = self._root_document()
        attributes = self._root_attributes(document or {})
        if attributes is None:
            raise BufferNotFoundError(
                f"no replaybuf buffer at {self.location!r} (no zarr group with replaybuf attributes)"
            )
        if attributes.get(REPLACING):
            raise UnfinishedCreateError(
                f"the buffer at {self.location!r} is being replaced: an overwrite=True erases it now (or was "
                "stopped while it did; create the buffer again with overwrite=True)"
            )
        where = self.describe_key("zarr.json")
        schema = self._schema_from_config(attributes, where)
        if not is_url(self.location):
            refuse_unencodable_names(schema, f"opening the zarr buffer at {self.location!r}")
        if self.binds_buffer and schema.uuid is None:
            raise BufferDamagedError(
                f"{where}: invalid buffer config: format {self.format_version} binds each shard to the buffer's "
                "uuid, and the config holds none (key 'uuid')"
            )
        self.read_only = read_only
        self._reading = (schema.uuid,) if read_only else None
        self._root_stat = root_stat if read_only else None
        if read_only and is_url(self.location):
            self.kv = self._make_kv(self.location, self.storage_options, self.fsync, read_only=True)
        if not read_only and isinstance(self.kv, LocalKV):
            self.kv.prepare_writes()
        consolidated = (document or {}).get("consolidated_metadata")
        recorded = consolidated.get("metadata") if isinstance(consolidated, dict) else None
        recorded = recorded if isinstance(recorded, dict) else None
        try:
            self._load_arrays(schema, recorded)
        except BufferNotFoundError:
            if self._create_unfinished():
                raise UnfinishedCreateError(
                    f"the buffer at {self.location!r} was never fully created (its create was killed, or "
                    "another process is creating it now): it holds no episode; create it again with "
                    "overwrite=True"
                ) from None
            # a create in another process may have finished since the arrays were read; else the
            # missing array is damage, raised again
            self._load_arrays(schema, recorded)
        self._unmeasured = _unmeasured(attributes, schema, where)
        # only once every array checked out: a damaged buffer's refused open writes nothing
        if not read_only and self.kv.get_document(STATE_NODE_KEY) is None:
            self.kv.set(STATE_NODE_KEY, json.dumps(STATE_NODE).encode())
        if not read_only and self._create_optional_meta(schema):
            self._load_arrays(schema, recorded)
        return schema

    def _create_unfinished(self) -> bool:
        """Whether the location is a create cut short: no counters object (a create writes it
        last) and nothing under ``data/`` or ``meta/`` but array documents (no chunk of any
        episode was ever written)."""
        if self.read_blob(STATE_KEY) is not None:
            return False
        return all(key.endswith("zarr.json") for prefix in ("data/", "meta/") for key in self.kv.list_prefix(prefix))

    def _create_optional_meta(self, schema: Schema) -> bool:
        """A writable open of a buffer an earlier release wrote creates the ``OPTIONAL_META``
        arrays it lacks (zeros), and their metadata; whether it created any."""
        absent = [n for n in OPTIONAL_META if self.kv.get_document(f"meta/{n}/zarr.json") is None]
        if not absent:
            return False
        import zarr

        store = self._zarr_store(read_only=False)
        meta = zarr.open_group(store, mode="a", zarr_format=3).require_group("meta")
        for name in absent:
            _create_meta_array(meta, bookkeeping_fields(schema)[name], schema.max_episodes)
        _consolidate(store)
        return True

    @property
    def binds_shards(self) -> bool:
        # docstring inherited
        return self.format_version is not None and self.format_version >= SHARD_BINDING_FORMAT

    @property
    def binds_buffer(self) -> bool:
        """Whether each shard's binding names the buffer too, by its uuid (format 6 and later)."""
        return self.format_version is not None and self.format_version >= BUFFER_BINDING_FORMAT

    @property
    def binds_generations(self) -> bool:
        """Whether each shard's binding names its episode's generation (format 7 and later)."""
        return self.format_version is not None and self.format_version >= GENERATION_BINDING_FORMAT

    @property
    def early_hashing(self) -> str | None:
        # docstring inherited: format 6's first commits bound the entries to no buffer
        return "buffer" if self.format_version == BUFFER_BINDING_FORMAT else super().early_hashing

    @property
    def binds_meta_sums(self) -> bool:
        # docstring inherited: from format 6, as the shards (but in its first commits' buffers)
        return self.binds_buffer and not (self.meta_sums_as_earlier and self.format_version == BUFFER_BINDING_FORMAT)

    def _load_arrays(self, schema: Schema, recorded: dict | None = None) -> None:
        """Open and check every array of ``schema``; ``recorded``: the root document's copies of
        their documents (zarr's consolidated metadata), whose chunk shapes each must have."""
        layouts = self.stored_layouts(schema)
        paths = [f"{'meta' if meta else 'data'}/{n}" for n, meta in layouts]
        documents = self.kv.get_documents([f"{p}/zarr.json" for p in paths])
        if self.format_version == BUFFER_BINDING_FORMAT:
            self.meta_sums_as_earlier = _early_format_6(documents)
        self._arrays = {}
        for (name, meta), path, doc in zip(layouts, paths, documents):
            if doc is None and meta and name in OPTIONAL_META:
                continue  # an earlier release's buffer, opened read-only: reads as zeros (``array``)
            if doc is None:
                raise BufferNotFoundError(f"buffer at {self.location!r} is missing the array {path!r}")
            self._arrays[name, meta] = self._checked_array(
                path, doc, layouts[name, meta], (recorded or {}).get(path), schema
            )
        self._packed = [n for n in schema.fields if self._arrays[n, False].packed]

    def _checked_array(
        self,
        path: str,
        doc: bytes,
        expected: tuple[tuple[int, ...], np.dtype],
        recorded: Any = None,
        schema: Schema | None = None,
    ) -> ChunkedArray:
        """The array stored at ``path`` (its document ``doc``), checked against its ``expected``
        layout and the chunk shapes of ``recorded`` (the root document's copy of ``doc``, where
        it has one): chunk shapes never change after a buffer is created, and the chunk files
        hold the chunks of the shape it was created with, so a document edited or damaged to
        another shape is refused by name rather than every episode read failing (and ``verify
        --repair`` dropping them all)."""
        where = self.describe_key(f"{path}/zarr.json")
        try:
            parsed = parse_json(doc, where)
            _check_document(where, parsed, self.format_version)
            if parsed["chunk_key_encoding"] == _EARLY_KEY_ENCODING:
                self._check_early_keys(path, where, parsed)
            array = self._chunked_array(path, parsed, 1 if path.startswith("meta/") else 2, schema)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise BufferDamagedError(f"{where}: not a zarr v3 array document ({type(e).__name__}: {e})") from None
        check_layout(where, array.shape, array.dtype, expected)
        _check_chunks(where, array)
        _check_bound_to(
            path,
            where,
            parsed,
            self._bound_to(path, array, schema),
            self.describe_key(ROOT_DOCUMENT),
            self.format_version,
        )
        if isinstance(array, ShardedArray) and array.binding is not None:
            _check_binds_generations(where, parsed, array.binding.generations, self.describe_key(ROOT_DOCUMENT))
        held, created = _chunk_layout(parsed), _chunk_layout(recorded)
        if held is not None and created is not None and held != created:
            raise BufferDamagedError(
                f"{where}: chunk shape {_describe_layout(held)}, but the buffer was created with "
                f"{_describe_layout(created)} (the copy in {self.describe_key(ROOT_DOCUMENT)}), which its chunk files "
                "hold: the array document was edited or damaged; restore its chunk shape"
            )
        return array

    def _check_early_keys(self, path: str, where: str, doc: dict) -> None:
        """Refuse a format-1 document ``doc`` (``where``) naming zarr's default ``/`` chunk keys
        (``_EARLY_KEY_ENCODING``) whose array at ``path`` holds its first chunk under a flat key:
        one flipped bit (``.`` to ``/``) would read every chunk as missing, zeros in a format
        that keeps no checksums. One lookup, made only for such documents."""
        flat = f"{path}/c" + ".0" * len(doc["shape"])
        if self.kv.size(flat) is not None:
            raise BufferDamagedError(
                f"{where}: chunk_key_encoding is {doc['chunk_key_encoding']!r}, but the array's chunks are stored "
                f"under flat keys ({self.describe_key(flat)}): the document was damaged or edited; restore its "
                "separator '.'"
            )

    def _bound_to(self, path: str, array: ChunkedArray, schema: Schema | None) -> str | None:
        """The uuid the contents of the array at ``path`` are bound to, which its document keeps a
        copy of (``BOUND_TO``): a sharded array's shards (their binding), ``meta/_meta_sum``'s
        entries (``binds_meta_sums``, ``schema``: the buffer's); None for any other array, or
        an earlier format's."""
        if isinstance(array, ShardedArray):
            return None if array.binding is None else array.binding.buffer
        if path == f"meta/{META_SUM}" and self.binds_meta_sums and schema is not None:
            return schema.uuid
        return None

    def _probe_optional_meta(self) -> None:
        """A reader of a buffer an earlier release wrote takes the ``OPTIONAL_META`` arrays a
        writable open created since it opened (``drop_caches``)."""
        for name in OPTIONAL_META:
            if (name, True) in self._arrays or ("episode_lens", True) not in self._arrays:
                continue
            doc = self.kv.get_document(f"meta/{name}/zarr.json")
            if doc is not None:
                expected = (self._arrays["episode_lens", True].shape, OPTIONAL_META[name])
                self._arrays[name, True] = self._checked_array(f"meta/{name}", doc, expected)

    def _chunked_array(self, path: str, doc: dict, grid_axes: int, schema: Schema | None = None) -> ChunkedArray:
        """The array stored at ``path`` as its document ``doc`` lays it out; ``schema``: the
        buffer's, whose uuid its shards are bound to and whose fields a shard bound to another
        one is named by (``_shard_binding``)."""
        codecs, chunks = doc["codecs"], tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
        sharding = codecs[0]["configuration"] if codecs[0]["name"] == "sharding_indexed" else None
        if sharding is not None:
            codecs, chunks = sharding["codecs"], tuple(sharding["chunk_shape"])
        checksum = codecs[-1]["name"] == "crc32c"
        compressors = codecs[1:-1] if checksum else codecs[1:]
        if (
            codecs[0]["name"] != "bytes"
            or len(compressors) > 1
            or any(c["name"] not in ("zstd", "blosc", "gzip") for c in compressors)
        ):
            raise ValueError(
                f"array {path!r} uses codecs {codecs}; replaybuf reads the bytes + zstd/blosc/gzip "
                "(+ crc32c) stacks it writes itself"
            )
        dtype = np.dtype(doc["data_type"])
        codec = ChunkCodec(dtype, compressors[0] if compressors else None, checksum=checksum)
        args = (self.kv, path, tuple(doc["shape"]), chunks, dtype, codec, grid_axes)
        options = dict(
            # the storage's methods through weak references: it owns the array (``_owner.py``)
            zarr_array=functools.partial(OwnerMethod(self._open_zarr_array), path),
            check_writable=OwnerMethod(self._check_writable),
            separator=doc["chunk_key_encoding"].get("configuration", {}).get("separator", "/"),
            # format 2 data arrays and packed ones keep every chunk they write: a missing one is damage
            committed=OwnerMethod(self._committed_length) if (checksum or chunks[0] > 1) and grid_axes == 2 else None,
            # what a reader's re-check reads (``consistency.committed_generations``)
            generations_of=functools.partial(OwnerMethod(self.read_meta_rows), "_generation")
            if grid_axes == 2
            else None,
        )
        if grid_axes == 2 and chunks[0] > 1 and not compressors and not checksum:
            name = path.split("/", 1)[1]
            options.update(
                check_rows=functools.partial(OwnerMethod(self._check_rows), name),
                rows_written=functools.partial(OwnerMethod(self._rows_written), name),
                row_prints=functools.partial(OwnerMethod(self._row_prints), name),
            )
        if sharding is None:
            return ChunkedArray(*args, **options)
        index_crc = any(c["name"] == "crc32c" for c in sharding["index_codecs"])
        binding = self._shard_binding(path.split("/", 1)[1], schema)
        return ShardedArray(
            *args,
            index_crc=index_crc,
            binding=binding,
            length_error=OwnerMethod(self._length_error),
            writing_generations=OwnerMethod(self._writing_generations),
            **options,
        )

    def _shard_binding(self, field: str, schema: Schema | None) -> ShardBinding | None:
        """The binding the shards of data field ``field`` hold in this buffer's format: none
        before format 5, to field and slot in format 5, to the buffer too (its uuid) from 6, to
        the episode's generation too from 7; none either for an array read for its codec alone
        (``schema`` None: ``_reload_measured``)."""
        if schema is None or not self.binds_shards:
            return None
        return ShardBinding(
            field, schema.fields, schema.uuid if self.binds_buffer else None, generations=self.binds_generations
        )

    def plan_generations(self, episodes: np.ndarray, generations: np.ndarray) -> None:
        # docstring inherited: kept until the slot's ``_generation`` is written (``write_meta``)
        self._planned.update(zip(np.asarray(episodes, np.int64).tolist(), np.asarray(generations, np.int64).tolist()))

    def _writing_generations(self, slots: np.ndarray) -> np.ndarray:
        """The generations shards of ``slots`` written now are bound to: per slot, the one planned
        for the episode being written there, else the slot's as stored (an in-place edit keeps
        it), read once for all of them (an object store's GET, not one per slot)."""
        generations = np.array([self._planned.get(int(slot), -1) for slot in slots], np.int64)
        unplanned = generations < 0
        if unplanned.any():
            generations[unplanned] = self.read_meta_rows("_generation", np.asarray(slots, np.int64)[unplanned])
        return generations

    def _committed_length(self, slot: int) -> int:
        """The published length of ``slot`` as stored now (0 when absent)."""
        return int(self._stored_meta_rows("episode_lens", np.array([slot]))[0])

    def _stored_meta_rows(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Meta ``name`` of ``slots`` as stored now (0 where absent): one range read per slot
        of the uncompressed chunks, or the whole array for many slots."""
        array = self.array(name, meta=True)
        size = array.dtype.itemsize
        if len(slots) * 64 > array.shape[0] or array.codec.compressed or array.codec.checksum:
            return np.asarray(array[:])[slots]
        requests = []
        for slot in slots.tolist():
            chunk, row = divmod(slot, array.chunks[0])
            requests.append((array.chunk_key((chunk,)), size * row, size * row + size))
        return np.array(
            [
                0 if r is None or len(r) != size else int.from_bytes(r, "little", signed=True)
                for r in self.kv.get_ranges(requests)
            ],
            dtype=np.int64,
        )

    # ---- per-episode checksums of packed fields (format 3) ------------------------------------

    def _read_sums(self, slots: np.ndarray) -> np.ndarray:
        """Rows of ``CHECKSUMS_KEY`` for ``slots``: (len(slots), packed fields) uint64. A row the
        file does not hold (the file missing or truncated) reads as entries of 0, which a
        committed episode never has (``_check_entries``: a damaged entry, re-sealed by
        ``verify --repair``, not damaged data)."""
        width = 8 * len(self._packed)
        max_episodes = self.array(self._packed[0]).shape[0]
        whole = len(slots) * 64 > max_episodes
        if whole:  # the rows the config gives, never more: an oversize file is ``excess_bookkeeping``
            raw = self.kv.get_ranges([(CHECKSUMS_KEY, 0, width * max_episodes)])[0] or b""
            table = np.zeros((max_episodes, len(self._packed)), "<u8")
            kept = len(raw) // width
            table[:kept] = np.frombuffer(raw[: kept * width], "<u8").reshape(kept, len(self._packed))
            return table[slots]
        raws = self.kv.get_ranges([(CHECKSUMS_KEY, width * s, width * (s + 1)) for s in slots.tolist()])
        sums = np.zeros((len(slots), len(self._packed)), "<u8")
        for k, row in enumerate(raws):
            if row is not None and len(row) == width:
                sums[k] = np.frombuffer(row, "<u8")
        return sums

    def excess_bookkeeping(self, trim: bool = False) -> list[str]:
        # docstring inherited: ``CHECKSUMS_KEY`` past the rows of its ``max_episodes`` slots
        if not self._packed:
            return []
        expected = 8 * len(self._packed) * self.array(self._packed[0]).shape[0]
        size = self.kv.size(CHECKSUMS_KEY)
        if size is None or size <= expected:
            return []
        where = self.kv.where(CHECKSUMS_KEY)
        if not trim:
            return [
                f"{where}: the checksums of packed fields hold {size} bytes, more than the {expected} bytes the "
                f"config gives them; the {size - expected} bytes past them are not read"
            ]
        self._check_writable()
        table = self._read_sums(np.arange(self.array(self._packed[0]).shape[0]))
        self.kv.set(CHECKSUMS_KEY, np.ascontiguousarray(table, "<u8").tobytes())
        return [f"repaired: cut {where} to the {expected} bytes the config gives it (removed {size - expected})"]

    def _write_sums(self, slots: np.ndarray, sums: np.ndarray) -> None:
        """Store rows of ``CHECKSUMS_KEY``: in place where the medium allows (one read and write
        per span of nearby slots, ``nearby_spans``), else the table rewritten."""
        width = 8 * len(self._packed)
        if len(slots) == 1:  # one episode's commit: its row written as it is
            sums = np.ascontiguousarray(sums, "<u8")
            if self.kv.write_at(CHECKSUMS_KEY, width * int(slots[0]), sums.tobytes()):
                return
        keep = last_occurrences(slots)
        slots, sums = slots[keep], np.ascontiguousarray(sums[keep], "<u8")
        if self.kv.writes_in_place:
            bounds = nearby_spans(slots, width, self.array(self._packed[0]).shape[0])
            firsts, lasts = slots[bounds[:-1]], slots[bounds[1:] - 1] + 1
            requests = [(CHECKSUMS_KEY, width * a, width * b) for a, b in zip(firsts.tolist(), lasts.tolist())]
            gaps = (lasts - firsts) != np.diff(bounds)
            raws = self.kv.get_ranges([r for r, gap in zip(requests, gaps) if gap]) if gaps.any() else []
            read = iter(raws)
            for (key, lo, hi), gap, a, b in zip(requests, gaps, bounds[:-1].tolist(), bounds[1:].tolist()):
                span = np.zeros(((hi - lo) // width, len(self._packed)), "<u8")
                if gap:
                    raw = next(read)
                    if raw is None or len(raw) != hi - lo:
                        break  # missing or truncated: the table is rewritten below
                    span[:] = np.frombuffer(raw, "<u8").reshape(span.shape)
                span[slots[a:b] - lo // width] = sums[a:b]
                if not self.kv.write_at(key, lo, span.tobytes()):
                    break
            else:
                return
        table = self._read_sums(np.arange(self.array(self._packed[0]).shape[0])).copy()
        table[slots] = sums
        self.kv.set(CHECKSUMS_KEY, table.tobytes())

    def _seal(
        self, slots: np.ndarray, lengths: np.ndarray, names: list[str] | None = None, rows: np.ndarray | None = None
    ) -> None:
        """Compute and store the checksums of the packed rows of ``slots`` committed (or about
        to be) at ``lengths``: from ``rows`` (the rows of the one field ``names`` as stored),
        else read back as stored (a byte range per row)."""
        slots, lengths = np.asarray(slots, np.int64).reshape(-1), np.asarray(lengths, np.int64).reshape(-1)
        lengths = np.broadcast_to(lengths, slots.shape)
        keep = lengths > 0
        slots, lengths = slots[keep], lengths[keep]
        if not len(slots):
            return
        names = names or self._packed
        sums = np.zeros((len(slots), len(self._packed)), np.uint64)
        if len(names) < len(self._packed):
            sums[:] = self._read_sums(slots)
        if rows is not None:
            column = self._packed.index(names[0])
            for k, (row, n) in enumerate(zip(rows[keep], lengths.tolist())):
                sums[k, column] = _SEALED | crc32c(np.ascontiguousarray(row[:n]))
            self._write_sums(slots, sums)
            return
        requests = [
            self.array(name).row_range(slot, 0, n)
            for name in names
            for slot, n in zip(slots.tolist(), lengths.tolist())
        ]
        rows_read = self.kv.get_ranges(requests)
        for i, ((key, lo, hi), row) in enumerate(zip(requests, rows_read)):
            f, k = divmod(i, len(slots))
            if row is None:  # never written: its rows read as zeros (and as damage once committed)
                row = bytes(hi - lo)
            if len(row) != hi - lo:
                raise StorageError(f"reading back {self.kv.where(key)} to checksum slot {slots[k]} failed")
            sums[k, self._packed.index(names[f])] = _SEALED | crc32c(row)
        self._write_sums(slots, sums)

    def _rows_written(self, name: str, slots: np.ndarray, rows: np.ndarray | None) -> None:
        """After rows ``slots`` of packed field ``name`` were written (``rows``: as now stored,
        None: read them back): the committed ones among them (an update in place) get their
        checksums recomputed."""
        lengths = self._stored_meta_rows("episode_lens", slots)
        if (lengths > 0).any():
            self._seal(slots, lengths, [name], rows)

    def _row_prints(self, name: str, slots: np.ndarray) -> np.ndarray:
        """A fingerprint per row of packed field ``name``: its stored checksum, which changes
        whenever a committed row is rewritten (``ChunkedArray._fingerprints``)."""
        return self._read_sums(np.asarray(slots, np.int64))[:, self._packed.index(name)].view(np.int64)

    def _check_rows(
        self, name: str, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray
    ) -> None:
        """Check rows of packed field ``name`` just read into ``out`` (``read_into``'s
        arguments): each one read from step 0 through its whole committed length is compared
        with its checksum; a mismatch is read again (a writer reusing the slot meanwhile, or
        rewriting it in place), the new read replacing the row in ``out``, and one that stays
        is ``CorruptChunkError``."""
        array = self.array(name)
        column = self._packed.index(name)
        target, rows = out, np.arange(len(episodes))  # the caller's row of each item checked
        for attempt in range(_CHECK_READS):
            picked = np.flatnonzero(starts == 0)
            committed = self._stored_meta_rows("episode_lens", episodes[picked])
            whole = (committed > 0) & (committed <= lengths[picked])
            picked, committed = picked[whole], committed[whole]
            if not len(picked):
                return
            sums = self._read_sums(episodes[picked])[:, column]
            self._check_entries(name, episodes[picked], committed, sums, out, picked)
            bad = [
                k
                for k, (i, n, expected) in enumerate(zip(picked.tolist(), committed.tolist(), sums.tolist()))
                if expected & _SEALED and crc32c(np.ascontiguousarray(out[i, :n])) != expected & 0xFFFFFFFF
            ]
            if not bad:
                return
            picked = picked[bad]
            if attempt + 1 < _CHECK_READS:
                episodes, starts, lengths, rows = episodes[picked], starts[picked], lengths[picked], rows[picked]
                out = np.zeros((len(picked), *out.shape[1:]), out.dtype)
                array.read_into(out, episodes, starts, lengths, check=False)
                for k, (row, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
                    target[row, :n] = out[k, :n]
        slot = int(episodes[picked[0]])
        where = self.kv.where(array.chunk_key((slot // array.chunks[0], 0)))
        n = int(committed[bad[0]])
        self._check_entry_bit(name, slot, n, int(sums[bad[0]]), out[picked[0], :n])
        self._check_length(name, slot, n, int(sums[bad[0]]))
        raise CorruptChunkError.against_kept(f"data/{name}", slot, (0, n), where, self.kv.where(CHECKSUMS_KEY))

    def _check_length(self, name: str, slot: int, n: int, entry: int) -> None:
        """Raise EpisodeLengthError when the stored steps of ``slot`` of packed field ``name``
        match its checksum entry ``entry`` at another length than the ``n`` its stored length
        says: the length is damaged, not the data, and ``verify --repair`` restores it instead
        of dropping a sound episode (the memmap and hdf5 backends tell it apart the same way).
        One read of the whole row: the error path only."""
        matches = [length for length in self._prefixes_matching(name, slot, entry) if length != n]
        if matches:
            raise self._length_error(f"data/{name}", slot, n, matches[0], "matches its checksum at")

    def _prefixes_matching(self, name: str, slot: int, entry: int) -> list[int]:
        """The lengths at which the stored steps of ``slot`` of packed field ``name``, from step
        0, match the crc32c of checksum entry ``entry`` ([] when the row is unreadable)."""
        array = self.array(name)
        steps = array.shape[1]
        row = np.zeros((1, steps, *array.shape[2:]), array.dtype)
        try:
            array.read_into(row, np.array([slot]), np.zeros(1, np.int64), np.array([steps]), check=False)
        except (OSError, ValueError, CorruptChunkError):  # unreadable: the data is blamed
            return []
        crc, matches = 0, []
        for step in range(steps):
            crc = crc32c(np.ascontiguousarray(row[0, step]), crc)
            if crc == entry & 0xFFFFFFFF:
                matches.append(step + 1)
        return matches

    def lengths_matching(self, name: str, slot: int) -> list[int] | None:
        # docstring inherited: a packed field's entry in ``CHECKSUMS_KEY``; an image field's
        # shard holds the frames of its episode's steps only (one inner chunk each)
        array = self.array(name)
        if name in self._packed:
            entry = int(self._read_sums(np.array([slot]))[0, self._packed.index(name)])
            return self._prefixes_matching(name, slot, entry) if entry & _SEALED else None
        if isinstance(array, ShardedArray):
            return array.frames_held(slot)
        return None

    def _length_error(
        self, path: str, slot: int, n: int, matches: int, how: str = "holds whole frames of"
    ) -> EpisodeLengthError:
        """The error for ``slot``'s stored length ``n`` where the data of array ``path`` says
        ``matches`` steps (``EpisodeLengthError.found``)."""
        lens = self.array("episode_lens", meta=True)
        array = self.array(path.split("/", 1)[1])
        key = (
            array.shard_key(slot) if isinstance(array, ShardedArray) else array.chunk_key((slot // array.chunks[0], 0))
        )
        return EpisodeLengthError.found(
            path,
            slot,
            n,
            how,
            matches,
            self.kv.where(lens.chunk_key((slot // lens.chunks[0],))),
            self.kv.where(key),
            self.sums_lengths,
        )

    def _check_entry_bit(self, name: str, slot: int, n: int, entry: int, row: np.ndarray) -> None:
        """Raise ChecksumEntryError when the crc32c of ``row`` (slot ``slot`` of packed field
        ``name``, ``n`` steps) differs from its checksum entry ``entry`` in exactly one bit: the
        entry has a flipped bit and the data matches it otherwise (``crc_bit_flipped``),
        so ``verify --repair`` re-seals the entry rather than dropping a sound episode."""
        row = np.ascontiguousarray(row)
        computed = crc32c(row)
        if not crc_bit_flipped(computed, entry, row.nbytes):
            return
        where = self.kv.where(CHECKSUMS_KEY)
        raise ChecksumEntryError(
            f"data/{name}: slot {slot}: its checksum entry in {where} is damaged (it holds {entry:#018x}, one "
            f"bit away from the crc32c {computed:#010x} of the episode's data, which damaged data cannot "
            "cause), so the episode cannot be checked; its data matches the entry but for that bit. "
            "`replaybuf verify --repair` re-seals the entry from the data",
            field=f"data/{name}",
            slot=slot,
            steps=(0, n),
            location=where,
            data_verified=True,
        )

    def _check_entries(
        self, name: str, slots: np.ndarray, committed: np.ndarray, sums: np.ndarray, out: np.ndarray, items: np.ndarray
    ) -> None:
        """Raise ChecksumEntryError for the first of ``sums`` (the entries of committed
        ``slots`` of packed field ``name``, read into ``out[items]``) that is not ``1 << 32 |
        crc``: a committed row always has one, so a cleared kept bit or a set high bit is a
        damaged entry (which would otherwise turn the check off), not damaged data. Format 3's
        entries carry no tag: a flipped crc bit reads as damaged data."""
        bad = np.flatnonzero((np.asarray(sums, np.uint64) >> np.uint64(32)) != 1)
        if not len(bad):
            return
        k = int(bad[0])
        slot, n, entry = int(slots[k]), int(committed[k]), int(sums[k])
        verified = crc32c(np.ascontiguousarray(out[items[k], :n])) == entry & 0xFFFFFFFF
        where = self.kv.where(CHECKSUMS_KEY)
        held = (
            "it is missing or 0: the file is missing, truncated or zeroed"
            if entry == 0
            else f"it holds {entry:#018x}, not 1 << 32 | crc32c"
        )
        raise ChecksumEntryError(
            f"data/{name}: slot {slot}: its checksum entry in {where} is damaged ({held}), so the episode cannot "
            "be checked; "
            + ("its data still matches the crc32c the entry holds" if verified else "its data cannot be verified")
            + ". `replaybuf verify --repair` re-seals the entry from the data",
            field=f"data/{name}",
            slot=slot,
            steps=(0, n),
            location=where,
            data_verified=verified,
        )

    def _open_zarr_array(self, path: str):
        import zarr

        return zarr.open_array(self._zarr_store(self.read_only), path=path, mode="r" if self.read_only else "r+")

    # ---- primitives --------------------------------------------------------------------------

    def array(self, name: str, meta: bool = False) -> ChunkedArray:
        # docstring inherited: an object opened before a field's codec was chosen (a reader, or
        # a writer another object of the process wrote through) takes the choice before any use
        # of it, refreshed or not (one read of the root document while the field has no rows; a
        # raw chunk decoded by blosc would be reported as damage)
        if self._unmeasured and not meta and name in self._unmeasured:
            self._reload_measured()
        return self._array_named(self._arrays, name, meta)

    @property
    def is_local(self) -> bool:
        # docstring inherited
        return isinstance(self.kv, LocalKV)

    def close(self) -> None:
        # docstring inherited
        if self._hot is not None:
            self._hot.stop()
        self.kv.close()
        if isinstance(self.kv, LocalKV):
            shard_maps().drop_under(self.kv.root)

    # ---- the hot tier (``_hot.py``) ----------------------------------------------------------

    def start_hot_tier(self, hot_bytes: int, generations: np.ndarray) -> None:
        # docstring inherited: sharded blosc fields of a writable buffer on local disk
        arrays = [a for a in self._arrays.values() if isinstance(a, ShardedArray) and a.codec.writes_hot]
        if self.read_only or not isinstance(self.kv, LocalKV) or not arrays:
            return
        if self._hot is not None:
            self._hot.stop()
        self._hot = HotTier(self.kv, arrays, generations, hot_bytes)

    def compact(self) -> CompactionSummary:
        # docstring inherited: each replacement checks the lease first (``HotTier``)
        return CompactionSummary() if self._hot is None else self._hot.compact()

    def hot_shards(self, slots: np.ndarray) -> dict[int, int]:
        # docstring inherited: the flag of each shard's first stored chunk (local disk only)
        found: dict[int, int] = {}
        if isinstance(self.kv, LocalKV):
            sharded = [a for a in self._arrays.values() if isinstance(a, ShardedArray)]
            for (slot, _), size in find_hot(sharded, np.asarray(slots, np.int64).reshape(-1).tolist()).items():
                found[slot] = found.get(slot, 0) + size
        return found

    # ---- batched I/O -------------------------------------------------------------------------

    def time_chunk(self, name: str) -> int:
        # docstring inherited
        array = self.array(name)
        return array.shard_time if isinstance(array, ShardedArray) else array.chunks[1]

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        if name in self._unmeasured:
            self._choose_codec(name, values)
        self.array(name).write_rows(np.asarray(episodes), t0, values, atomic=False)

    def write_tail_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray, end: int) -> None:
        # docstring inherited: a shard leaves the padding's inner chunks out
        self._check_writable()
        if name in self._unmeasured:
            self._choose_codec(name, values[:, : max(end - t0, 1)])
        self.array(name).write_rows(np.asarray(episodes), t0, values, atomic=False, padding_from=end)

    def check_room(self, names: Sequence[str], steps: int, what: str) -> None:
        # docstring inherited: on local disk a slot's shard or chunk is written whole to a temp
        # file (at most its raw bytes), and an edit moves the slots' revisions twice
        if not isinstance(self.kv, LocalKV):
            return
        rows = steps * sum(self.array(name).item_nbytes for name in names)
        revisions = 2 * self.array("_revision", meta=True).shape[0] * 8
        self.kv.check_room(rows + revisions, what)

    def update_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited: chunks other readers trust are replaced whole (atomic), and the
        # checksums of packed rows are recomputed
        self._check_writable()
        self.array(name).write_rows(np.asarray(episodes), t0, values, atomic=True)

    def reseal(self, episodes: np.ndarray, lengths: np.ndarray, names: list[str] | None = None) -> None:
        # docstring inherited: the rows of the packed fields among ``names``
        packed = [name for name in self._packed if names is None or name in names]
        if packed:
            self._seal(episodes, lengths, packed)

    def reseal_chunks(self, name: str, slots: np.ndarray, write: bool = True) -> dict[int, list[str]]:
        # docstring inherited: the chunks (or shard) of each slot of a checksummed field
        if write:
            self._check_writable()
        array = self.array(name)
        if array.packed or not array.codec.checksum:
            return {}
        found = {int(slot): array.reseal_chunks(int(slot), write) for slot in np.asarray(slots).reshape(-1)}
        return {slot: where for slot, where in found.items() if where}

    def _update_steps(self, name: str, episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited: packed fields in place, one read and write per span of nearby rows
        if not self.array(name).write_steps(episodes, timesteps, values):
            super()._update_steps(name, episodes, timesteps, values)

    def _choose_codec(self, name: str, values: np.ndarray) -> None:
        """Measure the field's default codec on its first rows (``values``: episodes x steps) and
        keep it or store the field raw (MIN_COMPRESSION_RATIO): the array's metadata first (no
        chunk of it exists yet, so a kill before the root document leaves a field measured again
        at its next write), then the root attributes and zarr's consolidated copy in one write.
        A field another object of this process (sharing the writer lease) measured first keeps
        its choice: a second measurement would leave chunks of two codecs under one array's
        metadata."""
        root = parse_json(self.kv.get_document(ROOT_DOCUMENT) or b"{}", self.describe_key(ROOT_DOCUMENT))
        attributes = self._root_attributes(root)
        if attributes is not None and name in self._reload_measured(attributes):
            return
        array = self.array(name)
        if any(not key.endswith("zarr.json") for key in self.kv.list_prefix(f"{array.path}/")):
            # chunks beside a record reading null (a damaged root document): they keep the
            # codec they were written by
            ratio, chosen = float("nan"), array.codec.compressor
        else:
            # measured by the default codec: a measurement killed before the root document left
            # the array raw, and its field is compressed again when its frames compress
            default = compressor_codec(DEFAULT_IMAGE_COMPRESSOR, array.dtype, DEFAULT_ZSTD_LEVEL).to_dict()
            measuring = ChunkCodec(array.dtype, default, checksum=array.codec.checksum)
            ratio = compression_ratio(measuring, values.reshape(-1, *array.chunks[2:]))
            chosen = None if ratio < MIN_COMPRESSION_RATIO else default
        if chosen != array.codec.compressor:
            key = f"{array.path}/zarr.json"
            doc = parse_json(self.kv.get_document(key) or b"{}", self.describe_key(key))
            stack = doc["codecs"][0]["configuration"] if doc["codecs"][0]["name"] == "sharding_indexed" else doc
            stack["codecs"] = [c for c in stack["codecs"] if c["name"] not in _COMPRESSOR_CODECS]
            if chosen is not None:
                stack["codecs"].insert(1, chosen)  # after "bytes", before "crc32c"
            self.kv.set(key, json.dumps(doc, indent=2).encode())
            consolidated = root.get("consolidated_metadata") or {}
            if array.path in consolidated.get("metadata", {}):
                consolidated["metadata"][array.path] = doc
            array.codec = ChunkCodec(array.dtype, chosen, checksum=array.codec.checksum)
        measured = root["attributes"].setdefault(MEASURED_CODECS, {})
        measured[name] = {"compressor": array.codec.label, "ratio": round(ratio, 3) if np.isfinite(ratio) else None}
        self.kv.set(ROOT_DOCUMENT, json.dumps(root, indent=2).encode())
        self._unmeasured.discard(name)

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        episodes = np.asarray(episodes, np.int64).reshape(-1)
        if name == "episode_lens" and self._packed:
            self._seal(episodes, values)  # before the length publishes the episode
        if name == "_generation":  # published or cleared: a plan for the slot is spent
            for slot in episodes.tolist():
                self._planned.pop(slot, None)
        array = self.array(name, meta=True)
        array.write_rows(
            episodes, 0, np.broadcast_to(np.asarray(values, array.dtype), (len(episodes), *array.shape[1:]))
        )
        if name == "_generation" and self._hot is not None:
            self._hot.published(episodes, np.broadcast_to(values, episodes.shape))

    # Generations key the chunk cache and the resident copies of small fields (``_chunks.py``):
    # reads given them may be served from RAM. Reads of resident fields are verified (their rows
    # were checked against the stored generations when loaded: ``verifies_reads``), others not.

    def read_rows(
        self, name: str, episodes: np.ndarray, t0: int, t1: int, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        return self.array(name).read_rows(np.asarray(episodes), t0, t1, generations)

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        # docstring inherited: one read per shard or chunk, frames decoded into place
        self.array(name).read_into(out, spans.episodes, spans.starts, spans.lengths, generations, parallel=parallel)

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        return self.array(name).gather(episodes, timesteps, generations)

    def stored_uuid(self) -> str | None:
        # docstring inherited: one read of the root zarr.json
        attributes = self._root_attributes()
        return None if attributes is None else attributes.get("uuid")

    def unstored_meta_slots(self, name: str, slots: np.ndarray) -> np.ndarray:
        # docstring inherited: one byte read of each chunk holding ``slots``
        array = self.array(name, meta=True)
        slots = np.asarray(slots, dtype=np.int64)
        chunks = np.unique(slots // array.chunks[0])
        heads = self.kv.get_ranges([(array.chunk_key((int(c),)), 0, 1) for c in chunks.tolist()])
        lost = chunks[[not head for head in heads]]
        return slots[np.isin(slots // array.chunks[0], lost)]

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        # docstring inherited: only the chunks holding ``episodes``
        return self.array(name, meta=True).take(episodes)

    def preload(self, name: str, episodes: np.ndarray, generations: np.ndarray) -> None:
        # docstring inherited: the resident copy of a small field
        self.array(name).load_resident(np.asarray(episodes), np.asarray(generations))

    def verifies_reads(self, names: Iterable[str]) -> bool:
        # docstring inherited: fields held resident are checked when their rows are loaded
        return all(self.array(name).verifies_resident for name in names)

    def verifies_gathers(self, names: Iterable[str]) -> bool:
        # docstring inherited: resident rows were checked when loaded, others after each read
        # (the maps of hot shards once each)
        return all(self.array(name).verifies_gathers for name in names)

    def drop_caches(self) -> None:
        # docstring inherited
        for array in self._arrays.values():
            array.drop_cached()
        self.kv.drop_read_handles()
        if isinstance(self.kv, LocalKV):
            shard_maps().doubt_under(self.kv.root)
        self._probe_optional_meta()
        if self._unmeasured and self.read_only:
            self._reload_measured()

    def drop_cached_rows(self, name: str, slots: np.ndarray) -> None:
        # docstring inherited
        self.array(name).drop_cached_episodes(np.asarray(slots, np.int64).reshape(-1).tolist())

    def replaced(self, cheap_only: bool = False) -> bool:
        # docstring inherited: the root attributes read again (a file read or a GET, so not
        # after every read's re-check: an overwrite counts generations on and erases ``meta/``
        # first, so only a re-plan can reach the new buffer). ``cheap_only`` on a local folder:
        # a stat of the root document, read again only when it changed; a buffer deleted and
        # created again counts generations from 1 again, so a plan's generations can name its
        # episodes, and only this tells the new buffer from the old
        if self._reading is None:
            return False
        stat = self._stat_root()
        if cheap_only and (self._root_stat is None or stat == self._root_stat):
            return False
        attributes = self._root_attributes()
        replaced = attributes is None or bool(attributes.get(REPLACING)) or attributes.get("uuid") != self._reading[0]
        if not replaced and self._root_stat is not None:
            self._root_stat = stat  # the same buffer's document, written again
        return replaced

    def _stat_root(self) -> tuple[int, int, int] | None:
        """(inode, mtime, ctime) of a local buffer's root document (zeros: none there); None
        for an object store (a stat there is a request)."""
        if not isinstance(self.kv, LocalKV):
            return None
        try:
            st = os.stat(os.path.join(self.kv.root, ROOT_DOCUMENT))
        except OSError:
            return (0, 0, 0)
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def _retire(self) -> None:
        """Before an overwrite erases the buffer here: set ``REPLACING`` in its root attributes
        (one atomic write), so its readers see it replaced before any of its objects goes
        (their reads re-plan only after checking, ``replaced``). The attributes still mark a
        buffer, so an erase cut short is finished by the next overwrite."""
        try:
            raw = self.kv.get_document(ROOT_DOCUMENT)
            document = None if raw is None else parse_json(raw, self.describe_key(ROOT_DOCUMENT))
        except BufferDamagedError:
            return  # nothing can open it, readers included
        attributes = None if document is None else document.get("attributes")
        if isinstance(attributes, dict) and attributes.get("format") == FORMAT_NAME:
            document["attributes"] = {**attributes, REPLACING: True}  # type: ignore[index]
            self.kv.set(ROOT_DOCUMENT, json.dumps(document).encode())

    def _reload_measured(self, attributes: dict | None = None) -> set[str]:
        """A reader opened before a field's codec was chosen takes the choice the writer made
        since (the array's metadata): its chunks are decoded by it from the first one. Returns
        the fields so taken (``attributes``: the root attributes, None: read them now)."""
        attributes = (self._root_attributes() or {}) if attributes is None else attributes
        chosen = self._unmeasured - _unmeasured(attributes, None, self.describe_key(ROOT_DOCUMENT))
        for name in chosen:
            path = f"data/{name}"
            doc = parse_json(self.kv.get_document(f"{path}/zarr.json") or b"{}", self.describe_key(f"{path}/zarr.json"))
            self._array_named(self._arrays, name, False).codec = self._chunked_array(path, doc, 2).codec
        self._unmeasured -= chosen
        return chosen

    def describe(self) -> dict:
        # docstring inherited
        fields = {}
        for array in self._arrays.values():
            fields[array.path] = {
                "shape": array.shape,
                "chunks": array.chunks,
                "dtype": array.dtype.name,
                "compressor": array.codec.label,
                "stored_bytes": self._stored_bytes(f"{array.path}/"),
                "raw_bytes": int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize,
                "shards": (1, array.shard_time, *array.shape[2:]) if isinstance(array, ShardedArray) else None,
            }
        return {**super().describe(), "format": "replaybuf zarr v3", "arrays": fields}

    def _stored_bytes(self, prefix: str) -> int:
        """Bytes of every object under ``prefix`` (chunks and metadata) as stored."""
        if isinstance(self.kv, LocalKV):
            folder = os.path.join(self.kv.root, *prefix.rstrip("/").split("/"))
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
        from ._settle import run

        assert isinstance(self.kv, StoreKV)  # a zarr buffer's objects are local files or a zarr Store
        return int(run(self.kv.store.getsize_prefix(prefix)))


_COMPRESSOR_CODECS = ("zstd", "blosc", "gzip")


def _unmeasured(attributes: dict, schema: Schema | None, where: str) -> set[str]:
    """Fields the root attributes list as not yet measured (buffers made before measuring
    existed list none: their codecs stay as they were made)."""
    measured = attributes.get(MEASURED_CODECS, {})
    if (
        not isinstance(measured, dict)
        or not all(choice is None or isinstance(choice, dict) for choice in measured.values())
        or (schema is not None and not set(measured) <= set(schema.fields))
    ):
        raise BufferDamagedError(f"{where}: {MEASURED_CODECS} must map data field names to choices, got {measured!r}")
    return {name for name, choice in measured.items() if choice is None}


# the chunk key encoding replaybuf writes (``FLAT_KEYS``) as a zarr v3 document holds it
_KEY_ENCODING = {"name": "default", "configuration": {"separator": "."}}
# the chunk key encoding of the buffers main's first commits wrote (format 1, before flat keys):
# zarr's default, chunks under ``<array>/c/0/0``
_EARLY_KEY_ENCODING = {"name": "default", "configuration": {"separator": "/"}}
_LITTLE_ENDIAN = {"endian": "little"}


def _early_format_6(documents: list[bytes | None]) -> bool:
    """Whether the array ``documents`` of a format-6 buffer are those main's first format-6
    commits wrote, which bound the shards alone (``EARLY_BOUND_TO``): none keeps ``BOUND_TO``
    (``meta/_meta_sum``'s included), where later ones all do. A buffer whose meta folder lacks it
    but whose shards' documents keep it (another buffer's meta folder copied in) is not: its
    ``meta/_meta_sum`` is refused by name (``_check_bound_to``). An unreadable document counts as
    keeping none: its own check names it."""
    for doc in documents:
        try:
            attributes = json.loads(doc or b"{}").get("attributes")
        except (ValueError, AttributeError, RecursionError):
            continue
        if isinstance(attributes, dict) and BOUND_TO in attributes:
            return False
    return True


def _check_bound_to(path: str, where: str, doc: dict, bound: str | None, root: str, version: int | None) -> None:
    """Refuse the array at ``path`` (``where``) whose contents are bound to the config's uuid
    ``bound`` (``_bound_to``; None: none) and whose document ``doc`` names another
    (``BOUND_TO``; ``root``: the config's document). Which of the two is wrong cannot be told,
    so ``verify --repair`` writes nothing. A document naming a uuid in a buffer whose config
    says a format (``version``) that binds none was written by format 6 or later: the config's
    version was damaged or edited, and read in that format every shard and meta checksum
    would fail (``verify --repair`` dropping every episode)."""
    attributes = doc.get("attributes")
    held = attributes.get(BOUND_TO) if isinstance(attributes, dict) else None
    if held is None and isinstance(attributes, dict) and version == BUFFER_BINDING_FORMAT:
        held = attributes.get(EARLY_BOUND_TO)
    if bound is None:
        if held is not None and (version or 0) < BUFFER_BINDING_FORMAT:
            raise BufferDamagedError(
                f"{where} keeps the uuid its contents are bound to ({BOUND_TO!r}), which only format "
                f"{BUFFER_BINDING_FORMAT} and later write, but the config in {root} says format {version}: its "
                "version was damaged or edited (read in that format, every shard and meta checksum would fail); "
                f"restore the version in {root}. `replaybuf verify --repair` changes nothing"
            )
        return
    if held == bound:
        return
    if path == f"meta/{META_SUM}":
        what = "the checksum entries of its slots' meta values are"
        cause = (
            "the slots' meta values (meta/) are another buffer's (its meta folder copied in over this one's), or "
            "one of the two documents was damaged or edited; restore meta/ from this buffer (each entry hashes its "
            "slot with the uuid it was written under)"
        )
    else:
        what = "its shards are"
        cause = (
            "one of the two was damaged or edited; restore it (a shard's binding holds the crc32c of the uuid it "
            "was written under and its field's name)"
        )
    raise BufferDamagedError(
        f"{where}: {what} bound to the buffer uuid {held!r}, but the config in {root} holds {bound!r}: {cause}. "
        "`replaybuf verify --repair` changes nothing: which of the two is wrong cannot be told"
    )


def _check_binds_generations(where: str, doc: dict, binds: bool, root: str) -> None:
    """Refuse the sharded array whose document ``doc`` (``where``) says its shards' bindings name
    their episodes' generations (``BINDS_GENERATIONS``) where the config in ``root`` says a format
    that binds none (``binds`` False), or the reverse: the config's version was damaged or edited,
    and read in that format every shard's binding would fail (``verify --repair`` dropping every
    episode)."""
    attributes = doc.get("attributes")
    held = isinstance(attributes, dict) and attributes.get(BINDS_GENERATIONS) is True
    if held == binds:
        return
    if held:
        said = f"says its shards are bound to their episodes' generations ({BINDS_GENERATIONS!r}), which only format"
        said += f" {GENERATION_BINDING_FORMAT} and later write, but the config in {root} says an earlier format"
    else:
        said = f"lacks {BINDS_GENERATIONS!r}, which format {GENERATION_BINDING_FORMAT} and later write, but the config"
        said += f" in {root} says such a format"
    raise BufferDamagedError(
        f"{where} {said}: the config's version or this document was damaged or edited (read so, every shard's "
        f"binding would fail); restore the version in {root}. `replaybuf verify --repair` changes nothing"
    )


def _check_document(where: str, doc: dict, version: int | None) -> None:
    """Refuse an array document that says what no replaybuf writer writes (the layout and
    codecs are checked as they are read): a flipped byte in the key encoding would read every
    chunk as missing, in the fill value or the byte order would change what other zarr
    readers see. A buffer of format ``version`` 1 may name zarr's default chunk keys, which
    main's first commits wrote (``_EARLY_KEY_ENCODING``)."""

    def bytes_codec_ok(codec: dict) -> bool:
        return codec.get("name") != "bytes" or codec.get("configuration", _LITTLE_ENDIAN) == _LITTLE_ENDIAN

    fill = doc.get("fill_value")
    codecs = doc["codecs"]
    inner = codecs[0].get("configuration", {}) if codecs[0].get("name") == "sharding_indexed" else {}
    problems = [
        f"{key} is {doc.get(key)!r}, expected {value!r}"
        for key, value in (("zarr_format", 3), ("node_type", "array"), ("chunk_key_encoding", _KEY_ENCODING))
        if doc.get(key) != value
        and not (key == "chunk_key_encoding" and version == 1 and doc.get(key) == _EARLY_KEY_ENCODING)
    ]
    if doc["chunk_grid"].get("name") != "regular":
        problems.append(f"chunk_grid is {doc['chunk_grid']!r}, expected a regular grid")
    if isinstance(fill, str) or not isinstance(fill, (int, float)) or fill != 0:
        problems.append(f"fill_value is {fill!r}, expected 0")
    if doc.get("storage_transformers", []) != []:
        problems.append(f"storage_transformers is {doc['storage_transformers']!r}, expected []")
    every = [*codecs, *inner.get("codecs", []), *inner.get("index_codecs", [])]
    if not all(isinstance(c, dict) and bytes_codec_ok(c) for c in every):
        problems.append(f"codecs {codecs} are not little-endian")
    if inner and inner.get("index_location") != "end":
        problems.append(f"the shard index location is {inner.get('index_location')!r}, expected 'end'")
    if problems:
        raise BufferDamagedError(f"{where}: {'; '.join(problems)} (damaged, or not written by replaybuf)")


def _chunk_layout(document: Any) -> tuple[list, list | None] | None:
    """(chunk shape, inner chunk shape of a shard or None) of an array ``document``; None where
    it does not say (not a document replaybuf writes)."""
    try:
        codecs = document["codecs"]
        inner = codecs[0]["configuration"]["chunk_shape"] if codecs[0]["name"] == "sharding_indexed" else None
        return list(document["chunk_grid"]["configuration"]["chunk_shape"]), None if inner is None else list(inner)
    except (KeyError, IndexError, TypeError):
        return None


def _describe_layout(layout: tuple[list, list | None]) -> str:
    chunks, inner = layout
    return str(chunks) if inner is None else f"{chunks} (shards of chunks {inner})"


def _check_chunks(where: str, array: ChunkedArray) -> None:
    """Refuse chunk (and shard) shapes no replaybuf writer makes: a chunk is decoded whole, so
    a damaged chunk shape would otherwise size an allocation."""
    shapes = [array.chunks] + ([(1, array.shard_time, *array.shape[2:])] if isinstance(array, ShardedArray) else [])
    for chunks in shapes:
        if len(chunks) != len(array.shape) or any(
            not isinstance(c, int) or not 1 <= c <= 2 * max(n, 1) for c, n in zip(chunks, array.shape)
        ):
            raise BufferDamagedError(f"{where}: chunk shape {list(chunks)} does not fit the array {list(array.shape)}")


def _consolidate(store) -> None:
    """Copy every array's metadata into the root group's document (zarr's consolidated
    metadata), so ``xarray.open_zarr(path, group='data')`` opens with one read and no warning.
    Array metadata changes after create only when a field's codec is measured
    (``ZarrStorage._choose_codec``), which updates the copy in the same write."""
    import warnings

    import zarr

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        zarr.consolidate_metadata(store)


def _open_zarr_store(location: str, storage_options: dict, read_only: bool):
    """A zarr Store for a URL; object stores go through ``_remote`` when it is available."""
    try:
        from ._remote import open_store
    except ImportError:
        pass
    else:
        return open_store(location, storage_options, read_only)
    import zarr

    return zarr.storage.FsspecStore.from_url(location, storage_options=storage_options or None, read_only=read_only)


def list_children(location: str, storage_options: dict | None = None) -> list[str]:
    """Names of the entries directly under a local folder or URL prefix (``[]`` when there is
    none): how ``shards.discover_shards`` finds the shards of a root."""
    if "://" not in location or location.startswith("file://"):
        path = location.removeprefix("file://")
        return os.listdir(path) if os.path.isdir(path) else []
    from ._settle import run

    store = _open_zarr_store(location, storage_options or {}, True)

    async def listing() -> list[str]:
        return [name.rstrip("/") async for name in store.list_dir("")]

    return run(listing())
