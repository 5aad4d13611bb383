"""Writes a released format's fixture buffers (``zarr/``, ``memmap/``, ``hdf5/``) into its folder
here, run once with the replaybuf that wrote that format: ``python tests/data/make_fixtures.py
format-vN [BACKEND ...]``. format-v1: main before the checksummed format; format-v2: crc32c on
every zarr data chunk, replaybuf/checksums.npy for memmap and hdf5; format-v3: zarr's small
fields packed, many episodes to a raw chunk, a crc32c per episode in replaybuf/checksums (zarr
written first), then memmap and hdf5 whose checksum entries carry a tag that checks them
(written later, ``format-v3 memmap hdf5``); format-v4: a checksum of each slot's meta values
(meta/_meta_sum) and a crc32c in replaybuf/state.json, every backend; format-v5: each zarr
shard bound to its field and slot (16 bytes before its index), and each slot's length under its
meta checksum; format-v6 (zarr only: memmap and hdf5 stay format 5): each zarr shard's
binding and each slot's meta checksum name its buffer (the uuid in its config) too; format-v7
(zarr only): each zarr shard's binding names its episode's generation too; format-v1-early (zarr,
main at 4a115de: format 1 with zarr's default chunk keys, image frames one chunk each); format-v5-early (main at
7eeb1c3: format 5 whose meta checksums leave lengths out) and format-v6-early (zarr, main at
8dde15c: meta checksums bound to no buffer, ``shards_bound_to`` in the shards' documents), run with
those commits' replaybuf. Run with the worktree's
replaybuf first on the path (``PYTHONPATH=.``). Kept to show how the fixtures were made; the
tests only read them. Expected values come from ``expected_episode``."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = dict(frame=("uint8", (32, 32, 4)), state=("float", 3), reward="float", done="bool")
META = dict(task="int")
LENGTHS = [5, 3, 6, 4]  # stored into 3 slots circularly: slot 0 holds the 4th episode


def expected_episode(i: int) -> dict[str, np.ndarray]:
    """The i-th stored episode's values (0-based, in commit order)."""
    rng = np.random.default_rng(i)
    n = LENGTHS[i]
    return dict(
        frame=rng.integers(0, 255, (n, 32, 32, 4), dtype=np.uint8),
        state=rng.standard_normal((n, 3)).astype(np.float32),
        reward=rng.standard_normal(n).astype(np.float32),
        done=np.arange(n) == n - 1,
        task=np.int32(10 + i),
    )


def main(folder: str, *backends: str) -> None:
    from replaybuf import ReplayBuffer

    for backend in backends or ("zarr", "memmap", "hdf5"):
        path = os.path.join(HERE, folder, backend)
        shutil.rmtree(path, ignore_errors=True)
        buffer = ReplayBuffer(path, 3, 6, FIELDS, META, circular=True, backend=backend)
        for i in range(len(LENGTHS)):
            buffer.store_episode(**expected_episode(i))
        buffer.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
