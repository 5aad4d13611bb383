"""A dataset of an HDF5 file replaced by one that keeps its data elsewhere (HDF5 external
storage, a virtual dataset, an external or soft link): what the tests that nothing reads or
writes through one build."""

from __future__ import annotations

from pathlib import Path

import numpy as np

KINDS = ["external storage", "virtual", "external link", "soft link"]


def replace_with_outside(
    path: Path, name: str, how: str, outside: Path, shape: tuple[int, ...], value: float, soft_target: str
) -> bytes:
    """Replace float32 dataset ``name`` of the HDF5 file ``path`` by one of kind ``how`` whose data
    is in the file ``outside`` (written here, holding ``value``) or, for a soft link, at
    ``soft_target`` of the same file (made there, holding ``value``, where absent); returns the
    bytes of ``outside`` as written."""
    import h5py

    if how == "external storage":
        outside.write_bytes(np.full(shape, value, np.float32).tobytes())
    else:
        with h5py.File(outside, "w") as f:
            f["v"] = np.full(shape, value, np.float32)
    with h5py.File(path, "r+") as f:
        del f[name]
        if how == "external storage":
            f.create_dataset(name, shape, np.float32, external=[(str(outside), 0, h5py.h5f.UNLIMITED)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape, np.float32)
            layout[:] = h5py.VirtualSource(str(outside), "v", shape=shape)
            f.create_virtual_dataset(name, layout)
        elif how == "external link":
            f[name] = h5py.ExternalLink(str(outside), "v")
        else:
            if soft_target not in f:
                f[soft_target] = np.full(shape, value, np.float32)
            f[name] = h5py.SoftLink(soft_target)
    return outside.read_bytes()
