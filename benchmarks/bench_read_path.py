"""Read-path throughput: replaybuf's loaders against memmap-replay-buffer 0.2.3 in one run.

Workload (the issue's): episodes of 84x84x3 uint8 frames + state f32[32] + action f32[6] +
reward + done, 200 x 250 by default, written once to both libraries under ``--folder`` (reused
by later runs). Measured with a warm OS cache, shuffled (random) sampling:

- timestep batches of 256, n-step (n=5) batches of 256, trajectory batches of 8;
- replaybuf on zarr (the default: compressed, sharded frames) through its direct chunk path,
  and with ``cache='ram'`` / ``cache='memmap'``; the memmap backend; ``num_workers=2`` for
  timestep batches.

Prints samples/s and the ratio to the seed measured in the same run. Every store's files are
read once before each case (this VM's kernel evicts idle page cache, which made cold-cache
outliers of earlier runs).

    python benchmarks/bench_read_path.py [--episodes 200 --steps 250 --seconds 5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIELDS = {
    "frame": ("uint8", (84, 84, 3)),
    "state": ("float", 32),
    "action": ("float", 6),
    "reward": "float",
    "done": "bool",
}


def make_episode(index: int, steps: int) -> dict[str, np.ndarray]:
    """Rendered-like frames (the shared benchmark workload when present) and small vectors."""
    try:
        from benchmarks.workload import WorkloadSize
        from benchmarks.workload import make_episode as shared

        return shared(WorkloadSize(index + 1, steps), index)
    except ImportError:
        rng = np.random.default_rng(index)
        yy, xx = np.mgrid[0:84, 0:84]
        frames = np.empty((steps, 84, 84, 3), np.uint8)
        frames[:] = (np.stack([yy, xx, yy + xx], -1) * 1.4).astype(np.uint8)
        for t in range(steps):
            cy, cx = (20 + t) % 70, (40 + 2 * t) % 70
            frames[t, cy : cy + 12, cx : cx + 12] = rng.integers(0, 255, 3, dtype=np.uint8)
        return {
            "frame": frames,
            "state": rng.standard_normal((steps, 32)).astype(np.float32),
            "action": rng.standard_normal((steps, 6)).astype(np.float32),
            "reward": rng.random(steps).astype(np.float32),
            "done": np.arange(steps) == steps - 1,
        }


def build(folder: Path, episodes: int, steps: int):
    """The same episodes in replaybuf zarr and memmap buffers and a seed buffer (kept for later
    runs)."""
    import memmap_replay_buffer as seed

    from replaybuf import ReplayBuffer

    stamp = folder / f"done-{episodes}x{steps}"
    options = dict(max_episodes=episodes, max_timesteps=steps, fields=FIELDS)
    if not stamp.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        ours = ReplayBuffer(folder / "zarr", **options)
        theirs = seed.ReplayBuffer(folder / "seed", **options)
        for index in range(episodes):
            data = make_episode(index, steps)
            data = {k: data[k] for k in FIELDS}
            ours.store_episode(**data)
            theirs.store_episode(**data)
            if index % 20 == 0:
                print(f"  wrote {index + 1}/{episodes} episodes", file=sys.stderr)
        ours.close()
        theirs.flush()
        stamp.touch()
    zarr_buffer = ReplayBuffer.from_folder(folder / "zarr", read_only=True)
    if not (folder / "memmap-done").exists():
        shutil.rmtree(folder / "memmap", ignore_errors=True)
        raw = ReplayBuffer(folder / "memmap", backend="memmap", **options)
        for slot in zarr_buffer.valid_episodes():
            length = int(zarr_buffer.episode_lens[slot])
            raw.store_episode(**{k: zarr_buffer.storage.read_rows(k, [slot], 0, length)[0] for k in FIELDS})
        raw.close()
        (folder / "memmap-done").touch()
    return (
        zarr_buffer,
        ReplayBuffer.from_folder(folder / "memmap", read_only=True),
        seed.ReplayBuffer.from_folder(folder / "seed", read_only=True),
    )


def rate(loader, seconds: float) -> tuple[float, float]:
    """Samples per wall-clock second and per CPU second of this process (the CPU figure is
    steadier on a shared machine; it leaves out worker processes), after one warm-up batch."""
    iterator = iter(loader)
    next(iterator)
    count, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        try:
            batch = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        count += len(batch["_lens"] if "_lens" in batch else next(iter(batch.values())))
    return count / (time.perf_counter() - start), count / max(time.process_time() - cpu, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/replaybuf-bench-read"))
    parser.add_argument("--skip", default="", help="comma-separated cases to skip (e.g. workers,ram)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from benchmarks.peers import read_folder
    from replaybuf.sampling import chunk_cache, make_dataloader

    ours, raw, theirs = build(args.folder, args.episodes, args.steps)
    print(
        f"workload: {args.episodes} episodes x {args.steps} steps; frames 84x84x3 uint8 + state[32] + action[6] "
        f"+ reward + done; chunk cache {chunk_cache().max_bytes >> 20} MiB\n"
    )
    cases = [
        ("timestep  B=256", 256, {"timestep_level": True}),
        ("n-step n=5 B=256", 256, {"n_steps": 5}),
        ("trajectory B=8", 8, {}),
    ]
    print(
        f"{'case':18s} {'reader':20s} {'samples/s':>10s} {'seed':>8s} {'ratio':>6s} | "
        f"{'per CPU-s':>10s} {'seed':>8s} {'ratio':>6s}"
    )
    for label, batch, options in cases:
        # every store's files read once first: this VM evicts idle page cache (DAMON reclaim)
        for name in ("zarr", "memmap", "seed"):
            read_folder(args.folder / name)
        seed_wall, seed_cpu = rate(theirs.dataloader(batch, shuffle=True, **options), args.seconds)
        variants = [("zarr", {}), ("memmap backend", {"buffer": raw})]
        if "ram" not in skip:
            variants.append(("zarr cache='ram'", {"dataset_kwargs": {"cache": "ram"}}))
            variants.append(("zarr cache='memmap'", {"dataset_kwargs": {"cache": "memmap"}}))
        for name, extra in variants:
            source = extra.pop("buffer", ours)
            wall, cpu = rate(make_dataloader(source, batch, shuffle=True, **options, **extra), args.seconds)
            print(
                f"{label:18s} {name:20s} {wall:10.0f} {seed_wall:8.0f} {wall / seed_wall:5.2f}x | "
                f"{cpu:10.0f} {seed_cpu:8.0f} {cpu / seed_cpu:5.2f}x",
                flush=True,
            )
        if "workers" not in skip and options.get("timestep_level"):
            workers = {"num_workers": 2, "persistent_workers": True}
            seed_wall, _ = rate(theirs.dataloader(batch, shuffle=True, **workers, **options), args.seconds)
            wall, _ = rate(make_dataloader(ours, batch, shuffle=True, **workers, **options), args.seconds)
            print(
                f"{label:18s} {'zarr num_workers=2':20s} {wall:10.0f} {seed_wall:8.0f} {wall / seed_wall:5.2f}x"
                f" | (seed with num_workers=2 as well)",
                flush=True,
            )
    print(
        f"\nchunk cache: {chunk_cache().hits} hits, {chunk_cache().misses} misses, "
        f"{chunk_cache().nbytes >> 20} MiB held"
    )


if __name__ == "__main__":
    main()
