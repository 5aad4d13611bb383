"""``replaybuf.testing.StorageTests`` on every backend and storage layer: zarr (local disk,
``memory://``, S3 on moto, GCS on the emulator), memmap, hdf5 and the concatenated storage."""

from __future__ import annotations

import contextlib
import os
import urllib.parse
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from replaybuf import ReplayBuffer, metasums
from replaybuf.concat import ConcatStorage
from replaybuf.metasums import META_SUM
from replaybuf.schema import Schema
from replaybuf.storage import Storage, make_storage, new_uuid
from replaybuf.testing import StorageFactory, StorageTests, snapshot

pytest_plugins = ["tests._servers"]  # fixtures: s3_server, gcs_server


class TestZarrLocal(StorageTests):
    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        return lambda name="buffer": make_storage(tmp_path / name, backend="zarr")


class TestZarrMemory(StorageTests):
    @pytest.fixture
    def storage_factory(self) -> StorageFactory:
        root = f"memory://replaybuf-conformance-{uuid.uuid4().hex[:12]}"
        return lambda name="buffer": make_storage(f"{root}/{name}", backend="zarr")


class RemoteStorageTests(StorageTests):
    """zarr on an object-storage server: nothing written is checked on the server's request log.
    Two fields (sharded frames, partly written chunks) and four slots: every read is a request."""

    server_fixture = ""
    fields = {name: StorageTests.fields[name] for name in ("frame", "state")}
    max_episodes = 4

    @pytest.fixture
    def storage_factory(self, request) -> StorageFactory:
        self.server = request.getfixturevalue(self.server_fixture)
        root = self.root = f"conformance/{uuid.uuid4().hex[:12]}"
        return lambda name="buffer": make_storage(
            self.server.url(f"{root}/{name}"), backend="zarr", storage_options=self.server.storage_options
        )

    @contextlib.contextmanager
    def no_writes(self, storage: Storage) -> Iterator[None]:
        with self.server.record() as requests:
            yield
        # the server is shared: another test's writer (a lease it still renews) writes elsewhere
        assert [write for write in requests.writes() if self.root in urllib.parse.unquote(write[1])] == []


class TestZarrS3(RemoteStorageTests):
    server_fixture = "s3_server"


class TestZarrGCS(RemoteStorageTests):
    server_fixture = "gcs_server"
    # gcp-storage-emulator answers a suffix range ("bytes=-N", how a shard's index is read) with
    # the whole object, so this class stores no image-like (sharded) field: S3 covers sharding
    fields = {**RemoteStorageTests.fields, "frame": ("uint8", (4, 4))}


class TestMemmap(StorageTests):
    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        return lambda name="buffer": make_storage(tmp_path / name, backend="memmap")


class TestHDF5(StorageTests):
    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        return lambda name="buffer": make_storage(tmp_path / name, backend="hdf5")


class TestConcat(StorageTests):
    """Members on three backends, one shorter in time (read as zeros past its end), one that
    keeps data in RAM for reading (hdf5, compressed): its caches must drop with the concat's."""

    members = (
        ("zarr", 2, StorageTests.max_timesteps, {}),
        ("memmap", 2, StorageTests.max_timesteps - 3, {}),
        ("hdf5", 2, StorageTests.max_timesteps, {"compression": "gzip", "compression_opts": 1}),
    )

    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        self.root = tmp_path

        def factory(name: str = "buffer") -> ConcatStorage:
            if not all(os.path.isdir(path) for path in self.member_paths(name)):
                for storage, _ in self.open_members(name):  # empty members where none exist yet
                    storage.close()
            buffers = [ReplayBuffer.from_folder(path, read_only=True) for path in self.member_paths(name)]
            return ConcatStorage(buffers, self.schema())

        return factory

    def member_paths(self, name: str) -> list[str]:
        return [str(self.root / f"{name}-{k}") for k in range(len(self.members))]

    def open_members(self, name: str) -> list[tuple[Storage, Schema]]:
        """The members' storages opened for writing, created where absent, with their schemas."""
        schema, out = self.schema(), []
        for path, (backend, count, timesteps, options) in zip(self.member_paths(name), self.members):
            storage = make_storage(path, backend=backend, storage_options=options)
            if storage.exists():
                member = storage.open(read_only=False)
            else:
                member = Schema(schema.fields, schema.meta_fields, count, timesteps, uuid=new_uuid())
                storage.create(member, overwrite=False)
            out.append((storage, member))
        return out

    def write(self, factory, episodes, rows, meta):
        # docstring inherited: each member writes its own episodes, cut to its time axis
        stored = {n: r.copy() for n, r in rows.items()}
        first = 0
        for (storage, schema), (_, count, timesteps, _) in zip(self.open_members("buffer"), self.members):
            mine = np.flatnonzero((episodes >= first) & (episodes < first + count))
            storage.plan_generations(episodes[mine] - first, meta["_generation"][mine])
            for name, values in rows.items():
                storage.write_rows(name, episodes[mine] - first, 0, values[mine, :timesteps])
                stored[name][mine, timesteps:] = 0
            # a member refuses lengths past its own time axis, and readers expect them so
            meta["episode_lens"][mine] = np.minimum(meta["episode_lens"][mine], timesteps)
            # a member's checksums are of its own slots
            member = {n: v[mine] for n, v in meta.items()}
            summed = metasums.summed(schema, storage)
            meta[META_SUM][mine] = metasums.entries(episodes[mine] - first, member["_generation"], member, summed)
            for name, values in meta.items():
                storage.write_meta(name, episodes[mine] - first, values[mine])
            storage.close()
            first += count
        return stored

    @contextlib.contextmanager
    def no_writes(self, storage: Storage) -> Iterator[None]:
        before = [snapshot(path) for path in self.member_paths("buffer")]
        yield
        assert [snapshot(path) for path in self.member_paths("buffer")] == before


class TestHDF5Gzip(StorageTests):
    """Compressed datasets: chunked, read through h5py rather than a memmap of the file."""

    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        options = {"compression": "gzip", "compression_opts": 1}
        return lambda name="buffer": make_storage(tmp_path / name, backend="hdf5", storage_options=options)
