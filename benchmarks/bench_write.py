"""Collection throughput: replaybuf vs memmap-replay-buffer 0.2.3, same workload, same run.

Measures steps/s of ``store()`` inside ``one_episode()`` (as an agent collects), with
flush_every_store_step=1 (the seed's default: durable every step) and 0 (flush at episode
end only), and of ``store_episode()`` (whole episodes). The buffer holds --episodes episodes;
store() runs write the first --store-episodes of them (default 4 = 1,000 steps) and
store_episode() runs the first --whole-episodes (default 20): per-step rates do not depend on
the count, and the seed msyncs its state files on every store(), ~2 ms each on this machine's
disk, so a full 200-episode store() run would take minutes. The final flush is timed. After
each replaybuf run, ``compact()`` (the hot tier compressing what was written raw) is timed
apart, with its CPU time and the bytes at rest before and after.

Run: python benchmarks/bench_write.py [--episodes N --steps T --quick] [--backends zarr memmap]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peers import SeedApiPeer, folder_bytes, replaybuf_peers, seed_peer  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    add_size_arguments,
    format_rate,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)

# (label, method, flush_every_store_step, target ratio replaybuf/seed from issue 2)
MODES = (
    ("store() flush=1", "store_steps", 1, 3.0),
    ("store() flush=0", "store_steps", 0, 2.0),
    ("store_episode() flush=1", "store_episodes", 1, 1.0),
)


# (peer, method, flush) -> what compact() did after the timed run (replaybuf's hot tier)
COMPACTIONS: dict[tuple[str, str, int], str] = {}


def run_mode(peer: SeedApiPeer, method: str, flush: int, episodes: list) -> tuple[float, int, int]:
    """(steps/s, bytes stored, files stored) for one mode on a fresh buffer."""
    peer.open(flush_every_store_step=flush)
    gc.collect()
    start = time.perf_counter()
    getattr(peer, method)(episodes)
    peer.buffer.flush()
    seconds = time.perf_counter() - start
    stored = folder_bytes(peer.folder)
    files = sum(1 for path in peer.folder.rglob("*") if path.is_file())
    if hasattr(peer.buffer, "compact"):  # replaybuf's hot tier: what compressing at rest costs
        cpu, wall = time.process_time(), time.perf_counter()
        summary = peer.buffer.compact()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        COMPACTIONS[peer.name, method, flush] = (
            f"{summary.episodes} episodes in {wall:.3f} s ({cpu:.3f} s CPU); stored "
            f"{stored / 1e6:,.1f} MB hot -> {folder_bytes(peer.folder) / 1e6:,.1f} MB compacted"
        )
    if hasattr(peer.buffer, "close"):  # replaybuf: gives the writer lease back (the seed has no close)
        peer.buffer.close()
    peer.buffer = None
    gc.collect()
    shutil.rmtree(peer.folder / "buffer", ignore_errors=True)
    return sum(len(episode["done"]) for episode in episodes) / seconds, stored, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument(
        "--store-episodes", type=int, default=None, help="episodes written with store() per mode (default 4, quick 2)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds, best kept (default 3, quick 1)")
    parser.add_argument(
        "--whole-episodes", type=int, default=None, help="episodes written with store_episode() (default 20, quick 8)"
    )
    parser.add_argument("--backends", nargs="*", default=["zarr"], help="replaybuf backends to include (default zarr)")
    parser.add_argument(
        "--frame-chunks",
        nargs="*",
        type=int,
        default=[],
        help="extra replaybuf zarr variants with this frame time chunk (steps), e.g. 4 16",
    )
    parser.add_argument(
        "--frame-compressors",
        nargs="*",
        default=[],
        help="extra replaybuf zarr variants with this frame compressor, e.g. none blosc-lz4 zstd:1",
    )
    arguments = parser.parse_args()
    size = size_from_arguments(arguments)
    store_count = min(size.episodes, arguments.store_episodes or (2 if arguments.quick else 4))
    whole_count = min(size.episodes, arguments.whole_episodes or (8 if arguments.quick else 20))
    repeats = arguments.repeats or (1 if arguments.quick else 3)
    print_header("Collection throughput (store / store_episode)", size)
    print(
        f"buffer capacity {size.episodes} episodes; store() modes write {store_count} episodes, "
        f"store_episode() writes {whole_count}; best of {repeats} interleaved rounds.\n"
    )

    episodes = [make_episode(size, index) for index in range(max(store_count, whole_count))]
    workdir = Path(tempfile.mkdtemp(prefix="replaybuf-bench-write-"))
    notes = []
    try:
        peers = [seed_peer(size, workdir)] + replaybuf_peers(
            size, workdir, arguments.backends, arguments.frame_chunks, arguments.frame_compressors, notes
        )
        results: dict[tuple[str, str], tuple[float, int, int]] = {}
        failed: set[str] = set()
        for round_index in range(repeats):  # interleaved rounds, best kept: the machine is shared
            for label, method, flush, _ in MODES:
                chosen = episodes[:store_count] if method == "store_steps" else episodes[:whole_count]
                for peer in peers:
                    if peer.name in failed:
                        continue
                    try:
                        outcome = run_mode(peer, method, flush, chosen)
                    except Exception as error:  # report and continue: one peer must not hide the others
                        failed.add(peer.name)
                        notes.append(f"{peer.name} {label}: failed, {type(error).__name__}: {error}")
                        continue
                    if outcome[0] > results.get((peer.name, label), (0.0, 0, 0))[0]:
                        results[peer.name, label] = outcome
                    print(
                        f"  round {round_index + 1} {label:24s} {peer.name:40s} {outcome[0]:>10,.0f} steps/s",
                        flush=True,
                    )
        print()
        rows = []
        for label, _, _, target in MODES:
            seed_rate = results.get(("seed", label), (None, 0, 0))[0]
            for peer in peers:
                rate, stored, files = results.get((peer.name, label), (None, 0, 0))
                versus = f"{rate / seed_rate:.2f}x" if rate and seed_rate else "-"
                rows.append(
                    [
                        label,
                        peer.name,
                        format_rate(rate),
                        versus,
                        "" if peer.name == "seed" else f">= {target:g}x",
                        f"{stored / 1e6:,.1f}" if rate else "-",
                        files if rate else "-",
                    ]
                )
        print("## Results\n")
        print(markdown_table(["mode", "peer", "steps/s", "/ seed", "target (issue 2)", "MB stored", "files"], rows))
        for note in notes:
            print(f"- {note}")
        if COMPACTIONS:
            print("\ncompact() after the last round's timed run (not timed above; 'MB stored' is before it):")
            for label, method, flush, _ in MODES:
                for peer in peers:
                    if (peer.name, method, flush) in COMPACTIONS:
                        print(f"- {label}, {peer.name}: {COMPACTIONS[peer.name, method, flush]}")
        for peer in peers:
            peer.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntemp folder removed: {not workdir.exists()}")


if __name__ == "__main__":
    main()
