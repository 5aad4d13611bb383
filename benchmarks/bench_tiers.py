"""One table for issue 16: replaybuf's hot, cold and warm tiers beside its peers, one run.

Writes the shared workload (workload.py: 84x84x3 rendered-like frames + small vectors) into
memmap-replay-buffer 0.2.3 (the seed), replaybuf (zarr default, memmap backend) and TorchRL's
LazyMemmapStorage, timing ``store_episode`` (every episode, final flush included) and
``store()`` with flush_every_store_step=0 (a few episodes, fresh buffers). Every read then runs
as in training: in its own read-only process, 0 DataLoader workers, after the store's files
were read once (warm page cache for everyone). Rows:

- replaybuf zarr **hot**: the episodes just written by the default ``ReplayBuffer(path)``, its
  writer still open (hot tier, before compaction);
- replaybuf zarr **cold**: after ``compact()`` and ``close()``; each kind timed over one epoch
  as the first read of a fresh process (nothing decoded resident), beside the decode bound that
  process measures right after its read (the frame codec's decode alone: us per frame x frames
  read / cores);
- replaybuf zarr **warm**: ``cache='disk'``, timed after one epoch of its reader filled the cache;
- replaybuf memmap (reference), the seed, TorchRL LazyMemmapStorage (its files mapped by the
  reader), TorchRL CompressedListStorage (zstd-3 in RAM: it lives in one process, so its reader
  process writes it too), and np.memmap gathers of the seed's files (the limit).

The rows run minutes apart, and this VM's speed drifts between them (the gather's timestep
figure ran at 267k and 472k samples/s in two runs of one tree), so the hot timestep row is also
measured **paired** with the gather, and so is the warm one: two reader processes kept open,
timed in alternating rounds, medians compared.

Run: python benchmarks/bench_tiers.py [--quick | --episodes N --steps T]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import google_crc32c  # noqa: E402
import numcodecs  # noqa: E402
import numcodecs.blosc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_sample import BATCH_SIZES, TIMED_BATCHES, timed_batches  # noqa: E402
from benchmarks.bench_write import run_mode  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    NSTEP,
    MemmapGatherPeer,
    SeedApiPeer,
    TorchRLPeer,
    Unavailable,
    folder_bytes,
    import_buffer_class,
    read_folder,
    seed_api_loader,
    seed_peer,
    torchrl_loader,
)
from benchmarks.workload import (  # noqa: E402
    FIELD_NAMES,
    FIELDS,
    WorkloadSize,
    add_size_arguments,
    format_rate,
    make_episode,
    markdown_table,
    print_header,
    size_from_arguments,
)

DEFAULT_EPISODES, DEFAULT_STEPS = 40, 250
# (episodes, steps) of the scratch buffer a cold reader reads first: one batch of every kind
WARMUP_SIZE = (8, 40)
# fresh reader processes per cold kind; the fastest is kept
COLD_REPEATS = 3
CORES = len(os.sched_getaffinity(0))
# get_all_data calls per steady figure, the fastest kept, for every store alike: one call is ~40 ms,
# most of it the kernel zeroing the fresh result's pages, which swings 2-4x from call to call on
# this VM (the seed's own calls: 30-48 ms in one process)
GET_ALL_ROUNDS = 9
# store_episode passes per writer over fresh folders (``fill_timed``); the fastest is kept
WRITE_ROUNDS = 5
READ_KINDS = ("timestep", "nstep", "trajectory", "get_all_data")
COLUMNS = ("store_episode", "store", "timestep", "nstep", "trajectory", "get_all_data", "bytes")
HEADER = (
    "store_episode steps/s",
    "store() flush=0 steps/s",
    f"timestep ({BATCH_SIZES['timestep']}) samples/s",
    f"n-step (n={NSTEP}, {BATCH_SIZES['nstep']}) samples/s",
    f"trajectory ({BATCH_SIZES['trajectory']}) episodes/s",
    "get_all_data s",
    "bytes at rest MB (x raw)",
)

SEED = "seed (memmap-replay-buffer 0.2.3)"
GATHER = "np.memmap gather (the limit)"
TORCHRL = "TorchRL LazyMemmapStorage"
COMPRESSED = "TorchRL CompressedListStorage (zstd-3, RAM)"
HOT = "replaybuf zarr hot"
COLD = "replaybuf zarr cold"
WARM = "replaybuf zarr warm (cache='disk')"
MEMMAP = "replaybuf memmap"
ROWS = (HOT, COLD, WARM, MEMMAP, SEED, TORCHRL, COMPRESSED, GATHER)
BASES = (SEED, TORCHRL, GATHER)
STEADY = (HOT, WARM)
NOT_AVAILABLE = "hot tier not available"

# (target, column, base row, least ratio to it, rows it holds for); issue 16's "Targets"
TARGETS = (
    ("store_episode >= 1x seed", "store_episode", SEED, 1.0, (HOT,)),
    ("store() flush=0 >= 2x seed", "store", SEED, 2.0, (HOT,)),
    ("timestep >= 1x TorchRL LazyMemmapStorage", "timestep", TORCHRL, 1.0, STEADY),
    ("n-step >= 5x seed", "nstep", SEED, 5.0, STEADY),
    ("trajectory >= 2x seed", "trajectory", SEED, 2.0, STEADY),
    ("get_all_data >= 1x seed", "get_all_data", SEED, 1.0, STEADY),
    *((f"{kind} >= 0.8x np.memmap gather", kind, GATHER, 0.8, STEADY) for kind in READ_KINDS),
    ("cold trajectory >= 1x seed", "trajectory", SEED, 1.0, (COLD,)),
)
COLD_BOUND_TARGET = 1.3  # cold get_all_data within 1.3x of the decode bound
PAIRED_ROUNDS = 24  # rounds of the paired timestep readers (hot, warm): one round's ratio swings 0.4-3x here
BYTES_TARGET = 0.5  # bytes at rest after compaction <= 0.5x raw


def hot_tier_available() -> bool:
    """Whether this replaybuf has the hot write tier (``hot_bytes`` and ``compact()``)."""
    buffer_class = import_buffer_class("replaybuf")
    return hasattr(buffer_class, "compact") and "hot_bytes" in inspect.signature(buffer_class.__init__).parameters


def raw_bytes(size: WorkloadSize) -> int:
    """Bytes of the workload's data fields, uncompressed."""
    per_step = 0
    for spec in FIELDS.values():
        dtype, shape = (spec, ()) if isinstance(spec, str) else spec
        dtype = {"float": np.float32, "bool": np.bool_}.get(dtype, dtype)
        per_step += np.dtype(dtype).itemsize * int(np.prod(shape))
    return per_step * size.total_steps


# ---- readers (child processes) -----------------------------------------------------------------


def open_reader(spec: dict, size: WorkloadSize, peer: Any) -> tuple[Callable[[str], Iterable], Callable[[], Any]]:
    """(kind -> a fresh iterable of batches, a call reading every episode) for the store ``spec`` names."""
    store, folder = spec["store"], Path(spec["folder"])
    if store in ("seed", "replaybuf"):
        module = "memmap_replay_buffer" if store == "seed" else "replaybuf"
        buffer = import_buffer_class(module).from_folder(str(folder), read_only=True, **spec.get("options", {}))
        if store == "replaybuf":
            import replaybuf.analysis  # noqa: F401  (dask's import is not part of get_all_data's first call)
        all_data = buffer.get_all_data if store == "seed" else partial(buffer.get_all_data, progress=False)
        return lambda kind: seed_api_loader(buffer, kind, BATCH_SIZES[kind], 0), all_data
    if store == "gather":
        gather = MemmapGatherPeer(folder, size)
        arrays = {name: np.load(folder / f"{name}.data.npy", mmap_mode="r") for name in FIELD_NAMES}
        return lambda kind: gather.loader(kind, BATCH_SIZES[kind], 0), lambda: {
            name: torch.from_numpy(np.array(array)) for name, array in arrays.items()
        }
    if store == "torchrl":
        # the writer's LazyMemmapStorage files, mapped, behind TensorStorage (its base class)
        import tensordict
        import torchrl.data

        storage = torchrl.data.TensorStorage(storage=tensordict.TensorDict.load_memmap(folder))
    else:
        storage = peer.storage
    indices = list(range(len(storage))) if store == "torchrl-compressed" else torch.arange(len(storage))

    def all_data() -> Any:
        data = storage.get(indices)
        return torch.stack(data) if isinstance(data, list) else data  # CompressedListStorage: one item per step

    return lambda kind: torchrl_loader(storage, kind, BATCH_SIZES[kind], size.steps), all_data


def touch_memory(nbytes: int) -> None:
    """Write one byte per page of ``nbytes`` of fresh memory, then free it. On this VM memory
    that has been free for ~2 s is handed back to the host, and touching it again costs
    0.1-0.25 s per 213 MB against 18 ms for memory freed moments ago (measured). The
    steady-state rows reuse theirs between rounds; a cold row's warm-up touches as much as the
    read returns just before it, so its epoch finds recently freed memory as they do."""
    scratch = np.empty(nbytes, np.uint8)
    scratch[:: mmap.PAGESIZE] = 1
    del scratch


def timed_count(kind: str, scale: float) -> int:
    """Batches a steady-state figure times: ``scale`` x bench_sample's TIMED_BATCHES, at least 2."""
    return max(2, int(TIMED_BATCHES[kind] * scale))


def one_epoch(loader: Iterable, kind: str) -> tuple[float, int]:
    """(seconds, samples) of one pass over ``loader`` (drop_last: full batches only)."""
    start, batches = time.perf_counter(), 0
    for _ in loader:
        batches += 1
    return time.perf_counter() - start, batches * BATCH_SIZES[kind]


def best_get_all_data(all_data: Callable[[], Any], rounds: int, cold: bool) -> float:
    """Seconds of one call (cold: the process's first read) or the best of ``rounds`` after a warm-up."""
    times = []
    for _ in range(1 if cold else rounds + 1):
        start = time.perf_counter()
        data = all_data()
        times.append(time.perf_counter() - start)
        del data
        gc.collect()
    return times[0] if cold else min(times[1:])


def child(spec: dict) -> dict[str, Any]:
    """Open one store read-only and time what ``spec['kinds']`` asks; figures keyed by column.

    ``cold``: each kind (one per process) is timed over one epoch, the process's first read of
    the store (after the same kind read once from the ``warmup`` buffer, if given);
    otherwise the best of ``rounds`` runs of ``scale`` x TIMED_BATCHES after warm-up batches.
    ``fill`` (a kind): one epoch of timestep batches (fills a read cache)."""
    size = WorkloadSize(spec["episodes"], spec["steps"], spec["seed"])
    result: dict[str, Any] = {"errors": {}}
    peer = None
    if spec["store"] == "torchrl-compressed":  # lives in RAM: this process writes it, then reads it
        episodes = [make_episode(size, index) for index in range(size.episodes)]
        peer = TorchRLPeer(size, Path(spec["folder"]), compressed=True)
        start = time.perf_counter()
        for episode in episodes:
            peer.fill_episode(episode)
        result["store_episode"] = size.total_steps / (time.perf_counter() - start)
        del episodes
        # the compressed tensors it holds (CompressedListStorage keeps them in a list)
        result["bytes"] = sum(value.nbytes for item in peer.storage._storage for value in item.values())
    if spec.get("warmup"):  # the process's one-time costs (imports, dask's threads), on another buffer
        warmup = WorkloadSize(*WARMUP_SIZE)
        warm_loader, warm_all_data = open_reader({**spec, "folder": spec["warmup"]}, warmup, None)
        for kind in spec["kinds"]:
            if kind == "get_all_data":
                warm_all_data()
            else:
                one_epoch(warm_loader(kind), kind)
        touch_memory(raw_bytes(size))
    loader, all_data = open_reader(spec, size, peer)
    for kind in spec["kinds"]:
        try:
            if kind == "get_all_data":
                result[kind] = best_get_all_data(all_data, GET_ALL_ROUNDS, spec["cold"])
            elif kind == "fill" or spec["cold"]:
                read_kind = "timestep" if kind == "fill" else kind
                seconds, samples = one_epoch(loader(read_kind), read_kind)
                result[kind], result[f"{kind}_seconds"], result[f"{kind}_samples"] = samples / seconds, seconds, samples
            else:
                count = timed_count(kind, spec["scale"])
                seconds = min(timed_batches(partial(loader, kind), count) for _ in range(spec["rounds"]))
                result[kind] = count * BATCH_SIZES[kind] / seconds
        except Exception as error:  # report and continue: one kind must not hide the others
            result["errors"][kind] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if spec["cold"] and spec.get("codec"):  # the bound, in the same minutes as the read it bounds
        codec, frames = frame_codec(spec["codec"]), make_episode(size, 0)["frame"]
        result["decode_us"], _ = decode_us_per_frame(codec, frames)
        result["check_us"] = check_us_per_frame(codec, frames)
        if "get_all_data" in spec["kinds"]:
            result["fresh_s"] = fresh_memory_seconds(raw_bytes(size))
    return result


def serve(spec: dict) -> None:
    """``--serve``: open one store read-only, then for each line on stdin time ``spec['kind']``
    batches (TIMED_BATCHES of them after the warm-up ones) and print the seconds."""
    size = WorkloadSize(spec["episodes"], spec["steps"], spec["seed"])
    loader, _ = open_reader(spec, size, None)
    count = timed_count(spec["kind"], 1.0)
    for _ in sys.stdin:
        print(timed_batches(partial(loader, spec["kind"]), count), flush=True)


def paired(size: WorkloadSize, kind: str, stores: dict[str, tuple[dict, Path]]) -> dict[str, list[float]]:
    """Seconds per round of each store's reader, in rounds that alternate the readers (one
    process each, kept open): a figure for each store from the same minutes, where the rows of
    the main table are minutes apart and this VM's speed drifts between them."""
    readers = {}
    for row, (spec, folder) in stores.items():
        read_folder(folder)
        spec = {**spec, "kind": kind, "folder": str(folder), "episodes": size.episodes, "steps": size.steps}
        readers[row] = subprocess.Popen(
            [sys.executable, __file__, "--serve", json.dumps({**spec, "seed": size.seed})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    seconds: dict[str, list[float]] = {row: [] for row in readers}
    try:
        for round_ in range(PAIRED_ROUNDS):
            order = list(readers) if round_ % 2 == 0 else list(reversed(readers))
            for row in order:
                reader = readers[row]
                assert reader.stdin is not None and reader.stdout is not None
                reader.stdin.write("go\n")
                reader.stdin.flush()
                line = reader.stdout.readline()
                if not line:
                    raise Unavailable(f"paired reader {row} stopped")
                seconds[row].append(float(line))
    finally:
        for reader in readers.values():
            if reader.stdin is not None:
                reader.stdin.close()
            reader.wait()
    return seconds


def run_child(spec: dict, size: WorkloadSize, folder: Path) -> dict[str, Any]:
    """``child(spec)`` in a fresh process over ``folder``, after reading ``folder``'s files once."""
    read_folder(folder)
    spec = {**spec, "folder": str(folder), "episodes": size.episodes, "steps": size.steps, "seed": size.seed}
    spec.setdefault("cold", False)
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise Unavailable(f"reader failed: {(out.stderr.strip().splitlines() or [out.returncode])[-1]}")
    return json.loads(lines[-1][len("RESULT ") :])


# ---- writers and the decode bound (this process) ------------------------------------------------


def fill_timed(peer: SeedApiPeer, episodes: list[dict[str, np.ndarray]], rounds: int) -> float:
    """store_episode steps/s of every episode into a fresh buffer, final flush included, best
    of ``rounds``; the last buffer stays open. Each round deletes the last one's folder first,
    so every writer writes new files into memory freed moments before: on this VM memory left
    free for ~2 s goes back to the host and costs 2-10x more to touch again, so a single pass
    swung 0.4-1.3x against the seed, and a writer's kernel time per pass 0.05-0.22 s."""
    steps, best = sum(len(episode["done"]) for episode in episodes), 0.0
    for _ in range(rounds):
        if peer.buffer is not None and hasattr(peer.buffer, "close"):  # the seed's has no close()
            peer.buffer.close()
        peer.buffer = None
        shutil.rmtree(peer.folder / "buffer", ignore_errors=True)
        peer.open(flush_every_store_step=1)
        gc.collect()
        start = time.perf_counter()
        peer.store_episodes(episodes)
        peer.buffer.flush()
        best = max(best, steps / (time.perf_counter() - start))
    return best


def store_rate(
    name: str, module: str, size: WorkloadSize, workdir: Path, episodes: list, rounds: int, **options: Any
) -> float:
    """store() steps/s, flush_every_store_step=0, best of ``rounds`` fresh buffers."""
    peer = SeedApiPeer(name, module, size, workdir, **options)
    try:
        return max(run_mode(peer, "store_steps", 0, episodes)[0] for _ in range(rounds))
    finally:
        peer.close()


def frame_codec(label: str) -> Any:
    """The numcodecs codec of a frame codec label ('blosc-lz4:9', 'zstd:3', 'none' -> None)."""
    name, _, level = label.partition(":")
    if name == "none":
        return None
    if name.startswith("blosc-"):  # uint8 frames: no shuffle, as replaybuf writes them
        return numcodecs.Blosc(cname=name.split("-", 1)[1], clevel=int(level or 5), shuffle=numcodecs.Blosc.NOSHUFFLE)
    return {"zstd": numcodecs.Zstd, "gzip": numcodecs.GZip}[name](level=int(level))


def decode_us_per_frame(codec: Any, frames: np.ndarray, repeats: int = 5) -> tuple[float, float]:
    """(best us to decode one frame with ``codec`` alone, compression ratio) over ``frames``."""
    if codec is None:
        return 0.0, 1.0
    encoded = [codec.encode(np.ascontiguousarray(frame)) for frame in frames]
    out = np.empty_like(frames[0])
    # blosc's module function skips the codec object's argument checks, as replaybuf's reads do
    decode = numcodecs.blosc.decompress if isinstance(codec, numcodecs.Blosc) else codec.decode
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for data in encoded:
            decode(data, out)
        best = min(best, time.perf_counter() - start)
    return best / len(frames) * 1e6, frames.nbytes / sum(len(data) for data in encoded)


def check_us_per_frame(codec: Any, frames: np.ndarray, repeats: int = 5) -> float:
    """Best us to check one encoded frame's crc32c (google-crc32c, as replaybuf's reads check
    every stored chunk), over ``frames`` encoded with ``codec`` (0 for raw frames)."""
    if codec is None:
        return 0.0
    encoded = [codec.encode(np.ascontiguousarray(frame)) for frame in frames]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for data in encoded:
            google_crc32c.value(data)
        best = min(best, time.perf_counter() - start)
    return best / len(frames) * 1e6


def fresh_memory_seconds(nbytes: int) -> float:
    """Seconds to make ``nbytes`` of fresh memory present, in the state a cold read finds it
    (``touch_memory`` just before): what a result of that size costs before any byte of it is
    decoded, and what the decode bound leaves out."""
    touch_memory(nbytes)
    start = time.perf_counter()
    scratch = np.empty(nbytes, np.uint8)
    scratch[:: mmap.PAGESIZE] = 1
    seconds = time.perf_counter() - start
    del scratch
    return seconds


# ---- the run ------------------------------------------------------------------------------------


class Run:
    """The figures of one run: ``results[row][column]`` (a number, or a string saying why not)."""

    def __init__(self, size: WorkloadSize, workdir: Path, quick: bool) -> None:
        self.size, self.workdir, self.quick = size, workdir, quick
        self.results: dict[str, dict[str, Any]] = {row: {} for row in ROWS}
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    @property
    def rounds(self) -> int:
        """Timed runs per figure, best kept (the machine is shared)."""
        return 2 if self.quick else 3

    @property
    def scale(self) -> float:
        """Timed batches, as a share of bench_sample's TIMED_BATCHES."""
        return 0.5 if self.quick else 1.0

    def read(self, row: str, spec: dict, folder: Path) -> dict[str, Any]:
        """Run a reader child for ``row`` and keep its figures."""
        try:
            figures = run_child({**spec, "rounds": self.rounds, "scale": self.scale}, self.size, folder)
        except Unavailable as reason:
            self.notes.append(f"{row}: {reason}")
            return {}
        for kind, error in figures.pop("errors").items():
            self.results[row][kind] = "n/a"
            self.notes.append(f"{row} {kind}: {error}")
        self.results[row].update({k: v for k, v in figures.items() if k in COLUMNS and k not in self.results[row]})
        print(f"  {row}: " + ", ".join(f"{k} {v:,.3f}" for k, v in figures.items()), flush=True)
        return figures

    def pair(self, row: str, spec: dict, folder: Path, gather_folder: Path) -> None:
        """``row``'s timestep reader and the gather, paired (``paired``), into extra['paired'][row]."""
        try:
            seconds = paired(self.size, "timestep", {row: (spec, folder), GATHER: ({"store": "gather"}, gather_folder)})
        except Unavailable as reason:
            self.notes.append(f"paired timestep, {row}: {reason}")
            return
        self.extra.setdefault("paired", {})[row] = seconds

    def cold_reads(self, folder: Path, codec: str, kinds: tuple[str, ...] = READ_KINDS) -> None:
        """Fresh processes per kind, ``COLD_REPEATS`` of them, the fastest kept: each is the first
        read of the compacted episodes, after the same kind read from a small scratch buffer (the
        process's one-time costs), and then measures the decode bound of ``codec`` (the frame
        codec's label) itself, so that a read and its bound come from the same minutes. A first
        read allocates its memory fresh, which on this VM costs 2-10x more when the kernel has
        lately handed free memory back to the host, so one process alone swung ~1.5x from run
        to run."""
        warmup_size = WorkloadSize(*WARMUP_SIZE, seed=self.size.seed + 1)
        warmup = SeedApiPeer("warmup", "replaybuf", warmup_size, self.workdir, backend="zarr")
        for index in range(warmup_size.episodes):
            warmup.fill_episode(make_episode(warmup_size, index))
        warmup.buffer.close()
        spec = {"store": "replaybuf", "cold": True, "warmup": str(warmup.folder / "buffer"), "codec": codec}
        for kind in kinds:
            runs = []
            for _ in range(COLD_REPEATS):
                figures = self.read(COLD, {**spec, "kinds": [kind]}, folder)
                seconds = figures.get("get_all_data") if kind == "get_all_data" else figures.get(f"{kind}_seconds")
                if seconds is not None:
                    runs.append({**figures, "seconds": seconds, "samples": figures.get(f"{kind}_samples")})
            if runs:
                best = min(runs, key=lambda figures: figures["seconds"])
                self.extra.setdefault("cold", {})[kind] = {**best, "runs": runs}
                self.results[COLD][kind] = best[kind]


def frames_read(kind: str, samples: int | None, size: WorkloadSize) -> int:
    """Frames a kind's cold epoch must decode: one per timestep, two per n-step transition (t
    and t+n), every frame of each trajectory, every frame for get_all_data."""
    if kind == "get_all_data":
        return size.total_steps
    return {"timestep": 1, "nstep": 2, "trajectory": size.steps}[kind] * int(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser, DEFAULT_EPISODES, DEFAULT_STEPS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print("RESULT " + json.dumps(child(json.loads(arguments.child))))
        return
    if arguments.serve:
        serve(json.loads(arguments.serve))
        return
    size = size_from_arguments(arguments)
    print_header("Tiers: replaybuf hot / cold / warm beside its peers (issue 16)", size)
    workdir = Path(tempfile.mkdtemp(prefix="replaybuf-bench-tiers-"))
    run = Run(size, workdir, arguments.quick)
    try:
        measure(run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(run)
    print(f"\ntemp folder removed: {not workdir.exists()}")


def measure(run: Run) -> None:
    """Write every store, then read each in its own process, row by row."""
    size, workdir, results = run.size, run.workdir, run.results
    hot = hot_tier_available()
    run.extra["hot"] = hot
    episodes = [make_episode(size, index) for index in range(size.episodes)]
    store_episodes = episodes[: min(size.episodes, 2 if run.quick else 4)]
    rounds = 1 if run.quick else 2
    print("## Writing (this process)\n", flush=True)
    seed = seed_peer(size, workdir)
    zarr = SeedApiPeer("zarr", "replaybuf", size, workdir, backend="zarr")
    memmap = SeedApiPeer("memmap", "replaybuf", size, workdir, backend="memmap")
    for row, peer, module, options in (
        (SEED, seed, "memmap_replay_buffer", {}),
        (HOT if hot else COLD, zarr, "replaybuf", {"backend": "zarr"}),
        (MEMMAP, memmap, "replaybuf", {"backend": "memmap"}),
    ):
        results[row]["store_episode"] = fill_timed(peer, episodes, WRITE_ROUNDS)
        results[row]["store"] = store_rate(row, module, size, workdir, store_episodes, rounds, **options)
        print(f"  {row}: store_episode {results[row]['store_episode']:,.0f}, store() {results[row]['store']:,.0f}")
    if hot:  # what the cold tier costs a writer: every episode compressed as written
        cold_writer = SeedApiPeer("zarr-cold", "replaybuf", size, workdir, backend="zarr", hot_bytes=0)
        results[COLD]["store_episode"] = fill_timed(cold_writer, episodes, WRITE_ROUNDS)
        cold_writer.buffer.close()
        run.extra["cold_written_bytes"] = folder_bytes(cold_writer.folder)
        cold_writer.close()
        results[COLD]["store"] = store_rate(
            COLD, "replaybuf", size, workdir, store_episodes, rounds, backend="zarr", hot_bytes=0
        )
    else:
        results[HOT] = dict.fromkeys(COLUMNS, NOT_AVAILABLE)
    torchrl = None
    try:
        torchrl = TorchRLPeer(size, workdir)
        start = time.perf_counter()
        for episode in episodes:
            torchrl.fill_episode(episode)
        results[TORCHRL]["store_episode"] = size.total_steps / (time.perf_counter() - start)
        results[TORCHRL]["bytes"] = folder_bytes(torchrl.folder)
    except Unavailable as reason:
        run.notes.append(f"{TORCHRL}: {reason}")
    results[SEED]["bytes"] = results[GATHER]["bytes"] = folder_bytes(seed.folder)
    results[MEMMAP]["bytes"] = folder_bytes(memmap.folder)
    memmap.buffer.close()
    frames = episodes[0]["frame"]
    del episodes

    print("\n## Reading (one read-only process per reader)\n", flush=True)
    steady = list(READ_KINDS)
    run.read(SEED, {"store": "seed", "kinds": steady}, seed.folder / "buffer")
    run.read(GATHER, {"store": "gather", "kinds": steady}, seed.folder / "buffer")
    if torchrl is not None:
        run.read(TORCHRL, {"store": "torchrl", "kinds": steady}, torchrl.folder)
        compressed = workdir / "compressed"  # an empty folder: this peer lives in its reader's RAM
        compressed.mkdir()
        run.read(COMPRESSED, {"store": "torchrl-compressed", "kinds": steady}, compressed)
    zarr_folder = zarr.folder / "buffer"
    if hot:
        results[HOT]["bytes"] = folder_bytes(zarr.folder)
        run.read(HOT, {"store": "replaybuf", "kinds": steady}, zarr_folder)
        run.pair(HOT, {"store": "replaybuf"}, zarr_folder, seed.folder / "buffer")
        wall, cpu = time.perf_counter(), time.process_time()
        run.extra["compact_summary"] = zarr.buffer.compact()
        run.extra["compact_s"] = (time.perf_counter() - wall, time.process_time() - cpu)
    zarr.buffer.close()
    results[COLD]["bytes"] = folder_bytes(zarr.folder)
    described = import_buffer_class("replaybuf").from_folder(str(zarr_folder), read_only=True).storage.describe()
    run.extra["codec"] = described["arrays"]["data/frame"]["compressor"]
    run.cold_reads(zarr_folder, run.extra["codec"])
    cache_dir = workdir / "cache"
    cached = {"store": "replaybuf", "options": {"cache": "disk", "cache_dir": str(cache_dir)}}
    run.extra["cache_fill"] = run.read(WARM, {**cached, "kinds": ["fill", *steady]}, zarr_folder).get("fill")
    run.extra["cache_bytes"] = folder_bytes(cache_dir)
    run.pair(WARM, cached, zarr_folder, seed.folder / "buffer")
    results[WARM]["bytes"] = results[COLD]["bytes"] + run.extra["cache_bytes"]
    run.read(MEMMAP, {"store": "replaybuf", "kinds": steady}, memmap.folder / "buffer")

    run.extra["decode_us"], run.extra["codec_ratio"] = decode_us_per_frame(frame_codec(run.extra["codec"]), frames)
    for peer in (seed, zarr, memmap, torchrl):
        if peer is not None:
            peer.close()


# ---- the report ---------------------------------------------------------------------------------


def ratio(results: dict, row: str, base: str, column: str) -> float | None:
    """How many times faster ``row`` is than ``base`` on ``column`` (get_all_data: by time)."""
    value, reference = results[row].get(column), results[base].get(column)
    if not isinstance(value, float | int) or not isinstance(reference, float | int) or not value or not reference:
        return None
    return reference / value if column == "get_all_data" else value / reference


def cell(run: Run, row: str, column: str) -> str:
    value = run.results[row].get(column)
    if value is None or isinstance(value, str):
        return value or "-"
    if column == "bytes":
        return f"{value / 1e6:,.1f} ({value / raw_bytes(run.size):.2f}x)"
    text = f"{value:.3f}" if column == "get_all_data" else format_rate(value)
    ratios = [ratio(run.results, row, base, column) for base in BASES]
    return text + " (" + " · ".join("-" if r is None else f"{r:.2f}x" for r in ratios) + ")"


def report(run: Run) -> None:
    size, results, extra = run.size, run.results, run.extra
    raw = raw_bytes(size)
    print("\n## Tiers and peers\n")
    print(
        "Cells: figure (/ seed · / TorchRL LazyMemmapStorage · / np.memmap gather), as speed ratios (> 1: "
        "faster; get_all_data compared by time). Bytes: MB at rest (x the raw bytes of the fields).\n"
    )
    print(markdown_table(["row", *HEADER], [[row, *(cell(run, row, c) for c in COLUMNS)] for row in ROWS]))

    samples = timed_count("timestep", 1.0) * BATCH_SIZES["timestep"]
    for row, seconds in extra.get("paired", {}).items():
        medians = {reader: float(np.median(values)) for reader, values in seconds.items()}
        print(
            f"\n## {row} timestep against the gather, paired\n\n{PAIRED_ROUNDS} rounds alternating the two "
            f"readers (one process each), {timed_count('timestep', 1.0)} batches of {BATCH_SIZES['timestep']} a "
            "round: samples/s, median (best)\n"
        )
        readers = [
            [reader, f"{format_rate(samples / medians[reader])} ({format_rate(samples / min(values))})"]
            for reader, values in seconds.items()
        ]
        print(markdown_table(["reader", "timestep samples/s"], readers))
        print(f"\nratio of the medians: {medians[GATHER] / medians[row]:.2f}x the gather")
        rounds = np.asarray(seconds[GATHER]) / np.asarray(seconds[row])
        quartiles = " / ".join(f"{q:.2f}x" for q in np.percentile(rounds, [25, 50, 75]))
        print(f"each round's ratio (its gather's seconds / its reader's), quartiles: {quartiles}")

    print("\n## Cold reads against the decode bound\n")
    print(
        f"frame codec {extra.get('codec')} (ratio {extra.get('codec_ratio', float('nan')):.2f}x on episode 0). "
        f"Bound = us x frames read / {CORES} cores, us = the best time to decode one frame with numcodecs alone "
        "(episode 0's frames into one reused frame, best of 5), measured by each cold process right after its "
        f"read (this process, after the writes: {extra.get('decode_us', float('nan')):.1f} us). Figures of the "
        "fastest process; 'figure / bound': figure / its own bound, of each process. Like with like: the read "
        "also checks each frame's crc32c and writes its result into fresh memory, which the bound skips; the "
        "last columns add both, measured by the same process (the check's us a frame x frames / cores, and the "
        "seconds to make a result-sized block of fresh memory present, get_all_data only). Not a target.\n"
    )
    bound_rows, bound_ratio = [], {}
    for kind, cold in extra.get("cold", {}).items():
        frames = frames_read(kind, cold["samples"], size)

        def bound(figures: dict, frames: int = frames) -> float:
            return figures.get("decode_us", 0.0) * 1e-6 * frames / CORES

        def equal(figures: dict, frames: int = frames) -> float:
            checks = figures.get("check_us", 0.0) * 1e-6 * frames / CORES
            return bound(figures, frames) + checks + figures.get("fresh_s", 0.0)

        label = "get_all_data (first call)" if kind == "get_all_data" else f"{kind}, one epoch"
        if not bound(cold):  # a frame field stored raw has no decode to bound it
            bound_rows.append([label, f"{cold['seconds']:.3f}", f"{frames:,}", *"-" * 7])
            continue
        bound_ratio[kind] = cold["seconds"] / bound(cold)
        every = [figures["seconds"] / bound(figures) for figures in cold["runs"] if bound(figures)]
        every_equal = [figures["seconds"] / equal(figures) for figures in cold["runs"] if bound(figures)]
        bound_rows.append(
            [
                label,
                f"{cold['seconds']:.3f}",
                f"{frames:,}",
                f"{cold['decode_us']:.1f}",
                f"{bound(cold):.3f}",
                " ".join(f"{value:.2f}x" for value in every),
                f"{cold.get('check_us', 0.0):.2f}",
                f"{cold.get('fresh_s', 0.0):.3f}" if "fresh_s" in cold else "-",
                f"{equal(cold):.3f}",
                " ".join(f"{value:.2f}x" for value in every_equal),
            ]
        )
    header = [
        "cold read",
        "seconds",
        "frames read",
        "decode us a frame",
        "decode bound s",
        "figure / bound",
        "check us a frame",
        "fresh memory s",
        "bound + check + memory s",
        "figure / it",
    ]
    print(markdown_table(header, bound_rows))

    print("\n## Bytes at rest and compaction\n")
    hot_bytes, cold_bytes = results[HOT].get("bytes"), results[COLD]["bytes"]
    rows = [["raw (data fields)", f"{raw / 1e6:,.1f}", "1.00x"]]
    if isinstance(hot_bytes, int):
        rows.append(["replaybuf zarr hot (before compaction)", f"{hot_bytes / 1e6:,.1f}", f"{hot_bytes / raw:.2f}x"])
    rows.append(["replaybuf zarr after compaction / close", f"{cold_bytes / 1e6:,.1f}", f"{cold_bytes / raw:.2f}x"])
    if "cold_written_bytes" in extra:
        written = extra["cold_written_bytes"]
        rows.append(
            ["replaybuf zarr hot_bytes=0 (compressed as written)", f"{written / 1e6:,.1f}", f"{written / raw:.2f}x"]
        )
    rows.append(
        ["read cache after one epoch", f"{extra['cache_bytes'] / 1e6:,.1f}", f"{extra['cache_bytes'] / raw:.2f}x"]
    )
    print(markdown_table(["store", "MB", "x raw"], rows))
    if "compact_s" in extra:
        wall, cpu = extra["compact_s"]
        print(f"\ncompact(): {wall:.2f} s wall, {cpu:.2f} s CPU (this process); returned {extra['compact_summary']!r}")
    else:
        print(
            f"\ncompaction: {NOT_AVAILABLE} (no ReplayBuffer.compact / hot_bytes): the zarr rows are compressed as written"
        )
    if extra.get("cache_fill"):
        print(
            f"cache fill (one epoch of timestep batches, in the warm row's reader): {extra['cache_fill']:,.0f} samples/s"
        )

    print("\n## Targets (issue 16)\n")
    rows = []
    for label, column, base, least, checked in TARGETS:
        for row in checked:
            value = ratio(results, row, base, column)
            verdict = "-" if value is None else ("PASS" if value >= least else "MISS")
            rows.append([label, row, "-" if value is None else f"{value:.2f}x", verdict])
    if "get_all_data" in bound_ratio:
        value = bound_ratio["get_all_data"]
        verdict = "PASS" if value <= COLD_BOUND_TARGET else "MISS"
        rows.append([f"cold get_all_data <= {COLD_BOUND_TARGET}x decode bound", COLD, f"{value:.2f}x", verdict])
    for row, seconds in extra.get("paired", {}).items():
        value = float(np.median(seconds[GATHER]) / np.median(seconds[row]))
        verdict = "PASS" if value >= 0.8 else "MISS"
        rows.append(["timestep >= 0.8x np.memmap gather (paired, medians)", row, f"{value:.2f}x", verdict])
    verdict = "PASS" if cold_bytes / raw <= BYTES_TARGET else "MISS"
    rows.append([f"bytes at rest after compaction <= {BYTES_TARGET}x raw", COLD, f"{cold_bytes / raw:.2f}x", verdict])
    print(markdown_table(["target", "row", "figure", "verdict"], rows))

    print("\n## How it ran\n")
    print(
        f"- Readers: each in its own read-only process, 0 workers; each store's files (and the read cache) were "
        f"read once before its reader started (warm page cache for everyone). Steady rows: best of {run.rounds} "
        f"runs of {'/'.join(str(timed_count(kind, run.scale)) for kind in READ_KINDS[:3])} batches "
        "(timestep/n-step/trajectory) after 2 warm-up batches; "
        f"get_all_data: best of {GET_ALL_ROUNDS} calls after one warm-up call. Cold row: per column the best of "
        f"{COLD_REPEATS} fresh processes, each one epoch (get_all_data: one call), the first read of the "
        "compacted episodes; before it, the process read the same kind from a scratch zarr buffer "
        f"({WARMUP_SIZE[0]} x {WARMUP_SIZE[1]} steps) and touched as much fresh memory as the read returns, so "
        "one-time costs (imports, thread pools, the VM handing the process memory) are not counted as decoding."
    )
    print(
        "- Writers (this process): store_episode over every episode into a fresh buffer with "
        f"flush_every_store_step=1, final flush timed, best of {WRITE_ROUNDS} passes, each after deleting the "
        "last pass's folder (every writer writes new files into memory freed just before: on this VM memory "
        "free for ~2 s goes back to the host and a pass's kernel time swung 4x); store() flush=0 into fresh "
        "buffers, best of "
        f"{1 if run.quick else 2}. Durability: the seed msyncs its memmaps on every flush (once per episode) "
        "and its counter files on every store(), whatever flush_every_store_step; "
        "replaybuf runs with fsync=False (its default: atomic renames, no fsync); TorchRL neither msyncs nor "
        "fsyncs. The hot row's writer stays open while its reader runs (close() would compact)."
    )
    print(
        "- TorchRL: its ReplayBuffer and samplers (n-step: a SliceSampler of n+1 steps returning every field at "
        "every step). The LazyMemmapStorage reader maps the writer's files (TensorDict.load_memmap behind "
        "TensorStorage, LazyMemmapStorage's base class); get_all_data = storage.get(every index). "
        "CompressedListStorage lives in one process's RAM: its reader process writes it first (that is its "
        "store_episode figure), with zstd-3 functions given (its own default is zlib before Python 3.14); "
        "its bytes are the compressed tensors it holds."
    )
    if extra["hot"]:
        print(
            "- Cold row, write columns: `ReplayBuffer(path, hot_bytes=0)` (every episode compressed as written); "
            "its reads are of the hot row's buffer after compact() and close()."
        )
    print(
        "- Warm row: its reader fills the cache with one epoch of timestep batches, then is timed (the second "
        "epoch of a training run). Its bytes are the compacted buffer plus the cache."
    )
    for note in run.notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
