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
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_tiers import (  # noqa: E402
    CORES,
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
        codec = import_buffer_class("replaybuf").from_folder(str(folder), read_only=True).storage.describe()
        label = codec["arrays"]["data/frame"]["compressor"]
        runs: dict[str, list[dict]] = {}
        for _ in range(arguments.repeats):
            for kind in arguments.kinds:
                run.extra.pop("cold", None)
                run.cold_reads(folder, label, kinds=(kind,))
                runs.setdefault(kind, []).extend(run.extra.get("cold", {}).get(kind, {}).get("runs", []))
        _, ratio = decode_us_per_frame(frame_codec(label), make_episode(size, 0)["frame"], repeats=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nframe codec {label} (ratio {ratio:.2f}x); bound = us x frames / {CORES}, us = one frame decoded alone "
        "on one thread, measured by each process right after its read\n"
    )
    rows = []
    for kind, figures in runs.items():
        frames = frames_read(kind, figures[0]["samples"], size)
        best = min(figures, key=lambda one: one["seconds"])
        bounds = [one.get("decode_us", 0.0) * 1e-6 * frames / CORES for one in figures]
        rate = f"{best['samples'] / best['seconds']:,.0f} episodes/s" if kind == "trajectory" else ""
        rows.append(
            [
                kind,
                f"{best['seconds']:.3f}",
                " ".join(f"{one['seconds']:.3f}" for one in figures),
                f"{frames:,}",
                " ".join(f"{one['seconds'] / bound:.2f}x" if bound else "-" for one, bound in zip(figures, bounds)),
                rate,
            ]
        )
    header = ["cold read", "best s", "every run s", "frames read", "every run / its bound", ""]
    print(markdown_table(header, rows))
    for note in run.notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
