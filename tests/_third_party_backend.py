"""A backend written as a third party would, from the README and ``storage/base.py`` alone:
the eight abstract primitives over a folder of ``.npy`` files and plain side files, every
other method left to the ``Storage`` defaults (which the built-in backends all override, so
only a backend like this one runs them). Registered through an entry point by
``tests/test_third_party_backend.py``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from replaybuf.schema import Schema
from replaybuf.storage import (
    MAX_DOCUMENT_BYTES,
    ArrayBase,
    BufferDamagedError,
    BufferNotFoundError,
    Storage,
    bookkeeping_fields,
    parse_json,
)

CONFIG = "npyfolder.json"  # only this backend writes it: how its buffers are recognised


class NpyArray(ArrayBase):
    """One stored ``.npy`` array: reads return copies, writes go to the file in place."""

    def __init__(self, storage: NpyFolderStorage, path: str):
        self.storage, self.path = storage, path

    @property
    def shape(self) -> tuple[int, ...]:
        return np.load(self.path, mmap_mode="r").shape

    @property
    def dtype(self) -> np.dtype:
        return np.load(self.path, mmap_mode="r").dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.array(np.load(self.path, mmap_mode="r")[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.storage._check_writable()
        stored = np.load(self.path, mmap_mode="r+")
        stored[key] = value
        stored.flush()


class NpyFolderStorage(Storage):
    """A buffer as ``npyfolder.json``, ``data/<field>.npy``, ``meta/<field>.npy`` and side
    files under ``replaybuf/`` (each written to a temp file, then renamed)."""

    backend_name = "npyfolder"

    def _path(self, key: str = "") -> str:
        return os.path.join(self.location.removeprefix("file://"), key)

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        return os.path.isfile(os.path.join(location.removeprefix("file://"), CONFIG))

    def exists(self) -> bool:
        return os.path.isfile(self._path(CONFIG))

    def _file(self, name: str, meta: bool) -> str:
        return self._path(f"{'meta' if meta else 'data'}/{name}.npy")

    def create(self, schema: Schema, overwrite: bool) -> None:
        if self.exists() and not overwrite:
            raise FileExistsError(f"a buffer exists at {self.location!r}")
        for entry in ("data", "meta", "replaybuf"):
            shutil.rmtree(self._path(entry), ignore_errors=True)
        for group, fields, leading in (
            ("data", schema.fields, (schema.max_episodes, schema.max_timesteps)),
            ("meta", {**schema.meta_fields, **bookkeeping_fields(schema)}, (schema.max_episodes,)),
        ):
            os.makedirs(self._path(group), exist_ok=True)
            for name, field in fields.items():
                np.lib.format.open_memmap(self._file(name, group == "meta"), "w+", field.dtype, leading + field.shape)
        self.read_only = False
        self.format_version = self.newest_format_version
        self.write_blob(CONFIG, json.dumps({**schema.to_json(), "version": self.format_version}).encode())

    def open(self, read_only: bool) -> Schema:
        raw = self.read_blob(CONFIG)
        if raw is None:
            raise BufferNotFoundError(f"no npyfolder buffer at {self.location!r}")
        schema = self._schema_from_config(parse_json(raw, self._path(CONFIG)), self._path(CONFIG))
        self.read_only = read_only
        return schema

    def array(self, name: str, meta: bool = False) -> NpyArray:
        path = self._file(name, meta)
        if not os.path.isfile(path):
            raise KeyError(f"no {'meta ' if meta else ''}array {name!r} in {self.location!r}")
        return NpyArray(self, path)

    def read_blob(self, key: str, limit: int | None = None) -> bytes | None:
        path = self._path(key)
        if not os.path.isfile(path):
            return None
        limit = MAX_DOCUMENT_BYTES if limit is None else limit
        if limit >= 0 and os.path.getsize(path) > limit:
            raise BufferDamagedError(f"{path}: over the {limit}-byte limit")
        with open(path, "rb") as f:
            return f.read()

    def write_blob(self, key: str, data: bytes) -> None:
        self._check_writable()
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)

    def delete_blobs(self, prefix: str) -> None:
        self._check_writable()
        for key in self.list_blobs(prefix):
            os.remove(self._path(key))

    def list_blobs(self, prefix: str) -> list[str]:
        root, keys = self._path(), []
        for folder, _, files in os.walk(self._path("replaybuf")):
            for name in files:
                key = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                if not name.startswith(".tmp-") and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)
