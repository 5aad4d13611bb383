"""DataLoader sampling throughput: replaybuf vs memmap-replay-buffer vs TorchRL vs np.memmap gather.

One run, same workload, warm OS cache (every store's files are read once before timing):
timestep batches of 256, n-step (n=5) batches of 256, trajectory batches of 8, with 0 and 2
DataLoader workers, printed as samples/s and as ratios between peers.

Run: python benchmarks/bench_sample.py [--episodes N --steps T --quick] [--backends zarr memmap]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peers import (  # noqa: E402
    KINDS,
    MemmapGatherPeer,
    TorchRLPeer,
    Unavailable,
    folder_bytes,
    read_folder,
    replaybuf_peers,
    seed_peer,
)
from benchmarks.workload import (  # noqa: E402
    add_size_arguments,
    format_rate,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)

BATCH_SIZES = {"timestep": 256, "nstep": 256, "trajectory": 8}
TIMED_BATCHES = {"timestep": 40, "nstep": 40, "trajectory": 10}
WARMUP_BATCHES = 2


def timed_batches(make_loader: Callable[[], Iterable[Any]], count: int) -> float:
    """Seconds for ``count`` batches after WARMUP_BATCHES; restarts the loader if an epoch ends."""
    loader = make_loader()
    state = {"loader": loader, "iterator": iter(loader)}

    def next_batch() -> Any:
        try:
            return next(state["iterator"])
        except StopIteration:
            state["iterator"] = iter(state["loader"])
            return next(state["iterator"])

    for _ in range(WARMUP_BATCHES):
        next_batch()
    start = time.perf_counter()
    for _ in range(count):
        next_batch()
    seconds = time.perf_counter() - start
    del loader
    state.clear()  # ends the iterator and its worker processes
    gc.collect()
    return seconds


def build_peers(
    size, workdir: Path, backends: list[str], frame_chunks: list[int], frame_compressors: list[str]
) -> tuple[list[Any], list[str]]:
    """Every peer that can run here, and a note per peer that cannot."""
    notes: list[str] = []
    peers: list[Any] = [seed_peer(size, workdir)]
    peers += replaybuf_peers(size, workdir, backends, frame_chunks, frame_compressors, notes)
    try:
        peers.append(TorchRLPeer(size, workdir))
    except Unavailable as reason:
        notes.append(f"TorchRL: skipped, {reason}")
    return peers, notes


def fill_peers(peers: list[Any], size, notes: list[str]) -> list[Any]:
    """Write the workload into every peer, one generated episode at a time; drop peers that fail."""
    filled = []
    fill_seconds = {peer.name: 0.0 for peer in peers}
    failed = set()
    for index in range(size.episodes):
        episode = make_episode(size, index)
        for peer in peers:
            if peer.name in failed:
                continue
            start = time.perf_counter()
            try:
                peer.fill_episode(episode)
            except Exception as error:  # a peer that cannot store the workload is reported, not fatal
                failed.add(peer.name)
                notes.append(f"{peer.name}: skipped, storing the workload failed: {type(error).__name__}: {error}")
            fill_seconds[peer.name] += time.perf_counter() - start
    for peer in peers:
        if peer.name in failed:
            peer.close()
            continue
        peer.finish_fill()
        filled.append(peer)
    rows = [
        [peer.name, f"{folder_bytes(peer.folders()[0]) / 1e6:,.0f}", f"{fill_seconds[peer.name]:.1f}"]
        for peer in filled
    ]
    print("## Stores\n")
    print(markdown_table(["peer", "MB on disk", "fill seconds (whole episodes)"], rows))
    print()
    return filled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
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
    parser.add_argument("--workers", nargs="*", type=int, default=[0, 2], help="DataLoader worker counts (default 0 2)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    arguments = parser.parse_args()
    size = size_from_arguments(arguments)
    print_header("Sampling throughput (DataLoader, warm OS cache)", size)
    scale = 0.25 if arguments.quick else 1.0

    workdir = Path(tempfile.mkdtemp(prefix="replaybuf-bench-sample-"))
    try:
        peers, notes = build_peers(
            size, workdir, arguments.backends, arguments.frame_chunks, arguments.frame_compressors
        )
        peers = fill_peers(peers, size, notes)
        seed = next(peer for peer in peers if peer.name == "seed")
        peers.insert(1, MemmapGatherPeer(seed.folder / "buffer", size))
        for peer in peers:
            for folder in peer.folders():
                read_folder(folder)
        results: dict[tuple[str, str, int], float] = {}
        for kind in arguments.kinds:
            batch_size = BATCH_SIZES[kind]
            count = max(2, int(TIMED_BATCHES[kind] * scale))
            for workers in arguments.workers:
                for peer in peers:
                    try:
                        seconds = timed_batches(partial(peer.loader, kind, batch_size, workers), count)
                    except Exception as error:  # report and continue: one peer must not hide the others
                        notes.append(f"{peer.name} {kind} workers={workers}: failed, {type(error).__name__}: {error}")
                        continue
                    results[peer.name, kind, workers] = count * batch_size / seconds
                    print(
                        f"  {kind:10s} workers={workers} {peer.name:40s} {results[peer.name, kind, workers]:>10,.0f} samples/s",
                        flush=True,
                    )
        print()
        print_results(results, [peer.name for peer in peers], arguments, notes)
        for peer in peers:
            peer.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntemp folder removed: {not workdir.exists()}")


def ratio(results: dict, numerator: tuple, denominator: tuple) -> str:
    if numerator not in results or denominator not in results:
        return "-"
    return f"{results[numerator] / results[denominator]:.2f}x"


def print_results(results: dict, names: list[str], arguments: argparse.Namespace, notes: list[str]) -> None:
    """One table: a row per (kind, workers, peer) with samples/s and its ratio to each baseline."""
    baselines = ["seed", "TorchRL", "np.memmap gather"]
    rows = []
    for kind in arguments.kinds:
        for workers in arguments.workers:
            for name in names:
                key = (name, kind, workers)
                rows.append(
                    [f"{kind} ({BATCH_SIZES[kind]})", workers, name, format_rate(results.get(key))]
                    + [ratio(results, key, (base, kind, workers)) for base in baselines]
                )
    print("## Results\n")
    print(markdown_table(["kind (batch)", "workers", "peer", "samples/s"] + [f"/ {base}" for base in baselines], rows))
    print(
        "\nsamples = timesteps for timestep/n-step, episodes for trajectory. TorchRL: its own ReplayBuffer.sample(), "
        "'workers' = prefetch threads; its n-step row is a SliceSampler of n+1 steps returning every field at every "
        "step (more bytes than the others move)."
    )
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
