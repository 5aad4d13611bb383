"""get_all_data and stats() on the shared image workload, against the seed in the same run.

Measures, best of ``--repeat`` runs on warm page caches:

- replaybuf ``get_all_data()`` (zarr, zstd-compressed, decoded through dask's threads
  scheduler) vs memmap-replay-buffer 0.2.3's ``get_all_data()`` (uncompressed .npy memmaps),
  and the same with frames stored uncompressed (``compressor='none'``);
- the same without dask (one ``storage.read_rows`` per field, the loop it replaces);
- ``stats()`` (mean/std/min/max per feature over valid steps, returns) vs reading and
  decoding every byte once through the same dask chunks and discarding it.

Run: ``python benchmarks/bench_analysis.py`` (``--quick`` for a small run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import dask
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workload import (  # noqa: E402
    FIELDS,
    add_size_arguments,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)

from replaybuf import ReplayBuffer  # noqa: E402
from replaybuf.analysis import get_all_data, stats, to_dask  # noqa: E402


def best_of(repeat: int, call: Callable[[], object]) -> float:
    """Fastest wall time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


# The same fields with frames stored uncompressed: what get_all_data costs without decoding.
RAW_FRAME_FIELDS = {**FIELDS, "frame": {"dtype": "uint8", "shape": FIELDS["frame"][1], "compressor": "none"}}


def build(folder: str, size, reuse: bool) -> tuple[ReplayBuffer, ReplayBuffer, object]:
    """The workload stored in replaybuf (zstd frames, raw frames) and in the seed's memmap buffer."""
    from memmap_replay_buffer import ReplayBuffer as SeedBuffer

    paths = [os.path.join(folder, name) for name in ("zarr", "zarr-raw", "seed")]
    if not (reuse and all(os.path.isdir(p) for p in paths)):
        ours, raw = (
            ReplayBuffer(path, max_episodes=size.episodes, max_timesteps=size.steps, fields=fields)
            for path, fields in zip(paths, (FIELDS, RAW_FRAME_FIELDS))
        )
        seed = SeedBuffer(paths[2], max_episodes=size.episodes, max_timesteps=size.steps, fields=FIELDS, overwrite=True)
        for episode in range(size.episodes):
            data = make_episode(size, episode)
            for buffer in (ours, raw, seed):
                buffer.store_episode(**data)
        for buffer in (ours, raw, seed):
            buffer.flush()
    return (
        ReplayBuffer.from_folder(paths[0], read_only=True),
        ReplayBuffer.from_folder(paths[1], read_only=True),
        SeedBuffer.from_folder(paths[2], read_only=True),
    )


def read_once(buffer: ReplayBuffer) -> None:
    """Read and decode every byte of every field once through the dask chunks, keeping nothing."""
    arrays = to_dask(buffer, list(buffer.schema.fields), [])
    dask.compute(
        *[
            a.map_blocks(lambda b: np.zeros((1,) * b.ndim, np.uint8), dtype=np.uint8, chunks=(1,) * a.ndim)
            for a in arrays.values()
        ],
        scheduler="threads",
    )


def loop_get_all_data(buffer: ReplayBuffer) -> None:
    """The plain loop get_all_data replaces: one read_rows per field, padding zeroed."""
    slots = buffer.valid_episodes()
    lens = buffer.episode_lens[slots]
    longest = int(lens.max())
    for name in buffer.schema.fields:
        rows = buffer.storage.read_rows(name, slots, 0, longest)
        rows[np.arange(longest)[None, :] >= lens[:, None]] = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_arguments(parser)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to build the buffers (default: a temp folder)")
    parser.add_argument("--reuse", action="store_true", help="reuse the buffers an earlier run left in --folder")
    arguments = parser.parse_args()
    size = size_from_arguments(arguments)
    print_header("get_all_data and stats() through dask", size)
    folder = arguments.folder or tempfile.mkdtemp(prefix="replaybuf-bench-analysis-")
    try:
        ours, raw, seed = build(folder, size, arguments.reuse and arguments.folder is not None)
        print(
            f"stored: replaybuf {du(os.path.join(folder, 'zarr')) / 2**20:.0f} MiB, raw frames "
            f"{du(os.path.join(folder, 'zarr-raw')) / 2**20:.0f} MiB, seed {du(os.path.join(folder, 'seed')) / 2**20:.0f} MiB\n",
            flush=True,
        )
        seed_time = best_of(arguments.repeat, seed.get_all_data)
        ours_time = best_of(arguments.repeat, lambda: get_all_data(ours))
        raw_time = best_of(arguments.repeat, lambda: get_all_data(raw))
        loop_time = best_of(arguments.repeat, lambda: loop_get_all_data(ours))
        read_time = best_of(arguments.repeat, lambda: read_once(ours))
        stats_time = best_of(arguments.repeat, lambda: stats(ours))
        rows = [
            ["seed get_all_data (memmap)", f"{seed_time:.3f}", "1.00"],
            ["replaybuf get_all_data (dask, threads)", f"{ours_time:.3f}", f"{seed_time / ours_time:.2f}"],
            ["replaybuf get_all_data, frames stored uncompressed", f"{raw_time:.3f}", f"{seed_time / raw_time:.2f}"],
            ["replaybuf read_rows loop (no dask)", f"{loop_time:.3f}", f"{seed_time / loop_time:.2f}"],
        ]
        print(markdown_table(["get_all_data", "seconds", "speed vs seed"], rows))
        print()
        rows = [
            ["read + decode every byte once", f"{read_time:.3f}", "1.00"],
            ["stats() (all fields, one graph)", f"{stats_time:.3f}", f"{stats_time / read_time:.2f}"],
        ]
        print(markdown_table(["stats", "seconds", "time vs reading once"], rows))
    finally:
        if arguments.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


def du(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


if __name__ == "__main__":
    main()
