"""``ReplayBufferH5PY``: memmap-replay-buffer's HDF5 variant, as a ReplayBuffer on the hdf5 backend.

Importing this module never imports h5py; creating a buffer without h5py installed raises an
ImportError that says what to install.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from .buffer import ReplayBuffer
from .storage.base import Storage

INSTALL_HINT = "ReplayBufferH5PY needs h5py: pip install 'replaybuf[h5py]'"


def _require_h5py() -> None:
    try:
        found = importlib.util.find_spec("h5py") is not None
    except ValueError:  # h5py blocked in sys.modules
        found = False
    if not found:
        raise ImportError(INSTALL_HINT)
    try:
        importlib.import_module("h5py")
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e


class ReplayBufferH5PY(ReplayBuffer):
    """A ReplayBuffer stored in one HDF5 file (``<folder>/data.h5``), optionally compressed.

    ``h5py_compression`` is 'gzip', 'lzf' or None and ``h5py_compression_opts`` the gzip level,
    as in memmap-replay-buffer; they apply when the buffer is created (a reopened file keeps the
    compression it was created with). Everything else is ReplayBuffer's.
    """

    def __init__(
        self,
        folder: str | os.PathLike | Storage,
        max_episodes: int | None = None,
        max_timesteps: int | None = None,
        fields: dict[str, Any] | None = None,
        meta_fields: dict[str, Any] | None = None,
        circular: bool = False,
        overwrite: bool = True,
        read_only: bool = False,
        flush_every_store_step: int = 1,
        h5py_compression: str | None = None,
        h5py_compression_opts: int | None = None,
        *,
        fsync: bool = False,
        break_lock: bool = False,
    ):
        _require_h5py()
        options = {}
        if h5py_compression is not None:
            options["compression"] = h5py_compression
        if h5py_compression_opts is not None:
            options["compression_opts"] = h5py_compression_opts
        super().__init__(
            folder,
            max_episodes,
            max_timesteps,
            fields,
            meta_fields,
            circular,
            overwrite,
            read_only,
            flush_every_store_step,
            storage_options=options,
            backend="hdf5",
            fsync=fsync,
            break_lock=break_lock,
        )

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        read_only: bool = False,
        storage_options: dict | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> ReplayBufferH5PY:
        """Reopen the HDF5 buffer stored at ``folder`` with its stored config."""
        _require_h5py()
        if backend not in (None, "hdf5"):
            raise ValueError(f"ReplayBufferH5PY reads the 'hdf5' backend only, got backend={backend!r}")
        return super().from_folder(
            folder, read_only=read_only, storage_options=storage_options, backend="hdf5", **kwargs
        )
