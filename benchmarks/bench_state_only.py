"""State-only buffers (issue 20): vectors only, short episodes, sampled by a read-only reader.

2,000 episodes x 20 steps of ``state`` f32[32], ``action`` f32[6], ``reward`` f32 are written
with ``store_episode`` into the seed (memmap-replay-buffer), replaybuf's zarr and memmap
backends, and TorchRL's LazyMemmapStorage when installed. Each store is then opened by a
read-only reader in its own process (the offline-RL case: a training process opening a finished
dataset), which samples batches of 256 timesteps, 256 n-step transitions (n=3) and 32
trajectories, 30 batches each after one warm-up batch, with 0 workers. Reported: samples/s
(trajectories: episodes/s) and ratios vs the seed, seconds from opening the folder to the first
batch, and the reader's peak RSS with its rise above two baselines, both the same for every
store: the RSS after its imports and one epoch of a torch DataLoader over a small in-memory
TensorDataset (``warm_torch``: what any training process runs whatever its store; its first run
faults in ~4.7 MB of torch's own code pages, ~5 MB with what it allocates), and the RSS after
its imports alone (the second rise includes the warm-up's ~5 MB).

``store_episode`` is timed over the first ``--timed-episodes`` episodes (default 20,000: the
seed's and TorchRL's per-episode writes slow down as their files grow, and 100,000 episodes
one by one take minutes on 2 cores); the rest of a larger buffer is written in groups of
1,000 episodes (``batched_episode`` + ``store_batch``; TorchRL: one ``extend`` per group), so
every reader samples the full size. ``--steps 1000`` measures 1,000-step episodes.

Run: python benchmarks/bench_state_only.py [--episodes 100000] [--steps 20] [--stores seed 'replaybuf zarr']
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.peers import SeedApiPeer, Unavailable, read_folder  # noqa: E402
from benchmarks.workload import WorkloadSize, format_rate, markdown_table, print_header  # noqa: E402

FIELDS = {"state": ("float", 32), "action": ("float", 6), "reward": "float"}
BATCH_SIZES = {"timestep": 256, "nstep": 256, "trajectory": 32}
KINDS = tuple(BATCH_SIZES)
NSTEP = 3
TIMED_BATCHES = 30
STORES = ("seed", "replaybuf zarr", "replaybuf memmap", "TorchRL")
TIMED_EPISODES = 20_000
GROUP = 1000  # episodes written together after the timed ones


def make_state_episode(steps: int, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(index)
    return {
        "state": rng.standard_normal((steps, 32), dtype=np.float32),
        "action": rng.uniform(-1, 1, (steps, 6)).astype(np.float32),
        "reward": rng.standard_normal(steps, dtype=np.float32),
    }


def make_state_group(steps: int, first: int, count: int) -> dict[str, np.ndarray]:
    """``count`` episodes at once, time-major (steps, count, ...) as ``store_batch`` takes them."""
    rng = np.random.default_rng(first)
    return {
        "state": rng.standard_normal((steps, count, 32), dtype=np.float32),
        "action": rng.uniform(-1, 1, (steps, count, 6)).astype(np.float32),
        "reward": rng.standard_normal((steps, count), dtype=np.float32),
    }


def vector_bytes(size: WorkloadSize) -> int:
    return size.total_steps * (32 + 6 + 1) * 4


# ---- writing (parent) ----------------------------------------------------------------------


def write_seed_api(
    name: str, module: str, size: WorkloadSize, workdir: Path, timed: int, **options: Any
) -> tuple[Path, float]:
    """Fill a seed-API buffer: store_episode for the first ``timed`` episodes (timed), then
    groups of ``batched_episode`` + ``store_batch``; (its folder, store_episode episodes/s)."""
    peer = SeedApiPeer(name, module, size, workdir, fields=FIELDS, **options)
    start = time.perf_counter()
    for index in range(timed):
        peer.fill_episode(make_state_episode(size.steps, index))
    peer.finish_fill()
    rate = timed / (time.perf_counter() - start)
    buffer = peer.buffer
    for first in range(timed, size.episodes, GROUP):
        count = min(GROUP, size.episodes - first)
        group = make_state_group(size.steps, first, count)
        with buffer.batched_episode(count):
            for t in range(size.steps):
                buffer.store_batch(**{k: v[t] for k, v in group.items()})
    peer.finish_fill()
    peer.buffer = None
    return peer.folder / "buffer", rate


def write_torchrl(size: WorkloadSize, workdir: Path, timed: int) -> tuple[Path, float]:
    """Fill a LazyMemmapStorage (one timed extend per episode for the first ``timed``, then one
    per group) and dump it for the reader."""
    try:
        import tensordict
        import torch
        import torchrl.data
    except ImportError as error:
        raise Unavailable(f"torchrl/tensordict not importable: {error}") from error
    folder = Path(tempfile.mkdtemp(prefix="torchrl-", dir=workdir))
    storage = torchrl.data.LazyMemmapStorage(size.total_steps, scratch_dir=str(folder / "scratch"), existsok=True)
    buffer = torchrl.data.ReplayBuffer(storage=storage)
    start = time.perf_counter()
    for index in range(timed):
        fields = {k: torch.from_numpy(v) for k, v in make_state_episode(size.steps, index).items()}
        fields["episode"] = torch.full((size.steps,), index, dtype=torch.int64)
        buffer.extend(tensordict.TensorDict(fields, batch_size=[size.steps]))
    rate = timed / (time.perf_counter() - start)
    for first in range(timed, size.episodes, GROUP):
        count = min(GROUP, size.episodes - first)
        # episode-major rows, as one extend per episode leaves them
        group = {
            k: torch.from_numpy(np.ascontiguousarray(v.swapaxes(0, 1)).reshape(count * size.steps, *v.shape[2:]))
            for k, v in make_state_group(size.steps, first, count).items()
        }
        group["episode"] = torch.arange(first, first + count).repeat_interleave(size.steps)
        buffer.extend(tensordict.TensorDict(group, batch_size=[count * size.steps]))
    buffer.dumps(str(folder / "dump"))
    return folder / "dump", rate


# ---- reading (child process) -----------------------------------------------------------------


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def warm_torch() -> None:
    """One epoch of a shuffled torch DataLoader over a small in-memory TensorDataset: the
    batching and collating every torch training process runs whatever its store. Its first run
    faults in pages of torch's shared libraries (~4.7 MB here) that each reader's first batch
    would otherwise count as its own."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    values = torch.zeros(64, 39)
    for _ in DataLoader(TensorDataset(values, values[:, 0]), batch_size=16, shuffle=True, drop_last=True):
        pass


def seed_api_loaders(store: str, folder: str) -> dict[str, Any]:
    module = "memmap_replay_buffer" if store == "seed" else "replaybuf"
    buffer = __import__(module).ReplayBuffer.from_folder(folder, read_only=True)
    common = dict(shuffle=True, drop_last=True, num_workers=0)
    return {
        "timestep": lambda: buffer.dataloader(batch_size=256, timestep_level=True, **common),
        "nstep": lambda: buffer.dataloader(batch_size=256, n_steps=NSTEP, **common),
        "trajectory": lambda: buffer.dataloader(batch_size=32, **common),
    }


def torchrl_loaders(folder: str, steps: int, total_steps: int) -> dict[str, Any]:
    import torchrl.data

    buffer = torchrl.data.ReplayBuffer(storage=torchrl.data.LazyMemmapStorage(total_steps))
    buffer.loads(folder)
    storage = buffer.storage

    def make(kind: str):
        if kind == "timestep":
            sampler, total = torchrl.data.RandomSampler(), 256
        else:
            length = NSTEP + 1 if kind == "nstep" else steps
            sampler = torchrl.data.SliceSampler(slice_len=length, traj_key="episode", strict_length=False)
            total = BATCH_SIZES[kind] * length
        return lambda: iter(torchrl.data.ReplayBuffer(storage=storage, sampler=sampler, batch_size=total))

    return {kind: make(kind) for kind in KINDS}


def child(store: str, folder: str, steps: int, total_steps: int) -> None:
    """Open ``folder`` read-only, time the first batch and 30 batches of each kind; print JSON."""
    import torch  # noqa: F401  (its import is the baseline, not the reader's data)

    if store == "TorchRL":
        import torchrl.data  # noqa: F401
    if store != "TorchRL":
        import memmap_replay_buffer  # noqa: F401

        import replaybuf  # noqa: F401
    imported = rss_bytes()
    warm_torch()
    baseline = rss_bytes()
    start = time.perf_counter()
    loaders = torchrl_loaders(folder, steps, total_steps) if store == "TorchRL" else seed_api_loaders(store, folder)
    result: dict[str, Any] = {}
    for kind in KINDS:
        iterator = iter(loaders[kind]())
        next(iterator)  # warm-up
        if kind == "timestep":
            result["first_batch_s"] = time.perf_counter() - start
        began = time.perf_counter()
        for _ in range(TIMED_BATCHES):
            try:
                next(iterator)
            except StopIteration:
                iterator = iter(loaders[kind]())
                next(iterator)
        result[kind] = TIMED_BATCHES * BATCH_SIZES[kind] / (time.perf_counter() - began)
    result["peak_rss"] = peak_rss_bytes()
    result["rss_above_baseline"] = result["peak_rss"] - baseline
    result["rss_above_imports"] = result["peak_rss"] - imported
    print(json.dumps(result))


def run_child(store: str, folder: Path, size: WorkloadSize) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            store,
            str(folder),
            "--steps",
            str(size.steps),
            "--episodes",
            str(size.episodes),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise Unavailable(f"reader failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES), help="stores to compare")
    parser.add_argument(
        "--timed-episodes",
        type=int,
        default=TIMED_EPISODES,
        help="store_episode is timed over this many first episodes; the rest is written in groups",
    )
    parser.add_argument("--child", nargs=2, metavar=("STORE", "FOLDER"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child(arguments.child[0], arguments.child[1], arguments.steps, arguments.episodes * arguments.steps)
        return
    size = WorkloadSize(arguments.episodes, arguments.steps)
    print_header("State-only buffers, read-only reader in its own process (issue 20)")
    print(f"workload: {size.episodes} episodes x {size.steps} steps, state f32[32] + action f32[6] + reward f32\n")
    timed = max(1, min(size.episodes, arguments.timed_episodes))
    notes: list[str] = []
    if timed < size.episodes:
        notes.append(
            f"store_episode timed over the first {timed:,} episodes; the other {size.episodes - timed:,} "
            f"were written in groups of {GROUP:,} (batched_episode + store_batch; TorchRL: extend)"
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-state-") as tmp:
        workdir = Path(tmp)
        writers = {
            "seed": lambda: write_seed_api("seed", "memmap_replay_buffer", size, workdir, timed),
            "replaybuf zarr": lambda: write_seed_api("zarr", "replaybuf", size, workdir, timed, backend="zarr"),
            "replaybuf memmap": lambda: write_seed_api("memmap", "replaybuf", size, workdir, timed, backend="memmap"),
            "TorchRL": lambda: write_torchrl(size, workdir, timed),
        }
        results = {}
        for store in arguments.stores:
            try:
                folder, write_rate = writers[store]()
                read_folder(folder)  # warm the OS cache: every reader starts from the same state
                results[store] = {"store_episode": write_rate, **run_child(store, folder, size)}
            except Unavailable as reason:
                notes.append(f"{store}: skipped, {reason}")
    seed = results.get("seed")

    def cell(r: dict[str, Any], key: str) -> str:
        ratio = f" ({r[key] / seed[key]:.2f}x)" if seed else ""
        return f"{format_rate(r[key])}{ratio}"

    for store, r in results.items():
        rows.append(
            [
                store,
                *(cell(r, key) for key in ("store_episode", *KINDS)),
                f"{r['first_batch_s']:.2f}",
                f"{r['peak_rss'] / 1e6:,.0f}; "
                + "; ".join(
                    f"+{r[key] / 1e6:,.1f} ({r[key] / vector_bytes(size):.2f}x)"
                    for key in ("rss_above_baseline", "rss_above_imports")
                ),
            ]
        )
    header = [
        "store",
        "store_episode episodes/s",
        "timestep samples/s",
        f"n-step (n={NSTEP}) samples/s",
        "trajectory episodes/s",
        "first batch s",
        "reader peak RSS, MB; rise above its RSS after imports + torch warm-up; above imports alone,"
        " warm-up included (x vector bytes)",
    ]
    print(markdown_table(header, rows))
    print(f"\nvector bytes: {vector_bytes(size) / 1e6:,.1f} MB")
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
