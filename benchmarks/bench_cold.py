"""Cold reads alone: bench_tiers' cold row (issue 16, point 4) in a minute or two, best of a few.

Writes the shared workload (workload.py) into the default ``ReplayBuffer(path)`` and closes it
(every episode compacted: blosc-lz4 + crc32c shards), then times each read kind exactly as
bench_tiers' cold row does (``bench_tiers.Run.cold_reads``: a fresh read-only process per kind,
the kind read first from a scratch buffer, page cache warm, one epoch; get_all_data: one call),
``--repeats`` times, beside the decode bound (the frame codec decoding alone, numcodecs: us per
frame x frames read / cores). On a shared machine the best of several runs is the figure to quote.

Run: python benchmarks/bench_cold.py [--repeats 3] [--kinds trajectory get_all_data] [--quick | --episodes N --steps T]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_tiers import (  # noqa: E402
    DEFAULT_EPISODES,
    DEFAULT_STEPS,
    READ_KINDS,
    Run,
    decode_us_per_frame,
    frame_codec,
    frames_read,
)
from benchmarks.peers import SeedApiPeer, import_buffer_class  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    add_size_arguments,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser, DEFAULT_EPISODES, DEFAULT_STEPS)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per kind; the best is kept")
    parser.add_argument("--kinds", nargs="+", choices=READ_KINDS, default=list(READ_KINDS))
    arguments = parser.parse_args()
    size = size_from_arguments(arguments)
    print_header("Cold reads against the decode bound (issue 16)", size)
    workdir = Path(tempfile.mkdtemp(prefix="replaybuf-bench-cold-"))
    try:
        writer = SeedApiPeer("zarr", "replaybuf", size, workdir, backend="zarr")
        for index in range(size.episodes):
            writer.fill_episode(make_episode(size, index))
        writer.buffer.close()  # compacts every episode
        folder = writer.folder / "buffer"
        run = Run(size, workdir, quick=arguments.quick)
        seconds: dict[str, list[float]] = {}
        samples: dict[str, int | None] = {}
        for _ in range(arguments.repeats):
            for kind in arguments.kinds:
                run.extra.pop("cold", None)
                run.cold_reads(folder, kinds=(kind,))
                if kind in run.extra.get("cold", {}):
                    value, samples[kind] = run.extra["cold"][kind]
                    seconds.setdefault(kind, []).append(value)
        codec = import_buffer_class("replaybuf").from_folder(str(folder), read_only=True).storage.describe()
        label = codec["arrays"]["data/frame"]["compressor"]
        us, ratio = decode_us_per_frame(frame_codec(label), make_episode(size, 0)["frame"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cores = len(os.sched_getaffinity(0))
    print(
        f"\nframe codec {label} (ratio {ratio:.2f}x), decode alone {us:.1f} us a frame; bound = us x frames / {cores}\n"
    )
    rows = []
    for kind, values in seconds.items():
        frames = frames_read(kind, samples[kind], size)
        bound = us * 1e-6 * frames / cores
        best = min(values)
        rate = f"{samples[kind] / best:,.0f} episodes/s" if kind == "trajectory" else ""
        rows.append(
            [
                kind,
                f"{best:.3f}",
                " ".join(f"{v:.3f}" for v in values),
                f"{frames:,}",
                f"{bound:.3f}",
                f"{best / bound:.2f}x",
                rate,
            ]
        )
    header = ["cold read", "best s", "every run s", "frames read", "decode bound s", "best / bound", ""]
    print(markdown_table(header, rows))
    for note in run.notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
