"""Collection and sampling speed of each replaybuf backend, against memmap-replay-buffer 0.2.3.

    python benchmarks/bench_backends.py [--episodes 48] [--steps 100] [--batches 40]

Per backend: ``store()`` steps/s (one step at a time inside ``one_episode``), ``store_episode()``
steps/s, and random single-timestep batches of 256 gathered from storage (one
``Storage.gather`` per field per batch, handed to torch without a copy), in samples/s. The
seed is measured in the same run: its store()/store_episode(), and its own timestep-level
DataLoader (batch 256, shuffled), plus the plain-numpy limit (fancy index on its .npy memmaps).
Ratios are against the seed's figures from this run; no figure from another run is used.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replaybuf import ReplayBuffer  # noqa: E402

FIELDS = {"frame": ("uint8", (64, 64, 3)), "state": ("float", 32), "action": ("float", 6), "reward": "float"}
VARIANTS = {  # name -> ReplayBuffer keyword arguments
    "zarr": {"backend": "zarr"},
    "memmap": {"backend": "memmap"},
    "hdf5": {"backend": "hdf5"},
    "hdf5-gzip": {"backend": "hdf5", "storage_options": {"compression": "gzip", "compression_opts": 4}},
}
BATCH = 256


def make_episode(rng: np.random.Generator, steps: int) -> dict[str, np.ndarray]:
    base = rng.integers(0, 255, (1, 64, 64, 3), dtype=np.uint8)
    frames = np.repeat(base, steps, axis=0)
    frames[:, rng.integers(0, 64), :, :] = rng.integers(0, 255, (steps, 1, 3), dtype=np.uint8)
    return {
        "frame": frames,
        "state": rng.standard_normal((steps, 32)).astype(np.float32),
        "action": rng.standard_normal((steps, 6)).astype(np.float32),
        "reward": rng.standard_normal(steps).astype(np.float32),
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ours(kwargs: dict, folder: Path, episodes: list[dict], store_episodes: int, batches: int) -> dict:
    steps = len(episodes[0]["reward"])
    buffer = ReplayBuffer(folder, len(episodes), steps, fields=FIELDS, **kwargs)

    def per_step():
        for data in episodes[:store_episodes]:
            with buffer.one_episode():
                for t in range(steps):
                    buffer.store(**{k: v[t] for k, v in data.items()})

    store_rate = store_episodes * steps / timed(per_step)
    buffer.clear()
    store_episode_rate = len(episodes) * steps / timed(lambda: [buffer.store_episode(**d) for d in episodes])
    buffer.close()
    reader = ReplayBuffer.from_folder(folder, read_only=True)
    rng = np.random.default_rng(1)
    slots, lens = reader.valid_episodes(), reader.episode_lens

    def sample():
        for _ in range(batches):
            episode_ids = slots[rng.integers(0, len(slots), BATCH)]
            timesteps = (rng.random(BATCH) * lens[episode_ids]).astype(np.int64)
            {n: torch.from_numpy(reader.storage.gather(n, episode_ids, timesteps)) for n in FIELDS}

    sample()  # warm the page cache, as the seed's run below is warmed
    sample_rate = batches * BATCH / timed(sample)
    return {"store": store_rate, "store_episode": store_episode_rate, "sample": sample_rate}


def bench_seed(folder: Path, episodes: list[dict], store_episodes: int, batches: int, h5: bool) -> dict:
    import memmap_replay_buffer

    steps = len(episodes[0]["reward"])
    cls = memmap_replay_buffer.ReplayBufferH5PY if h5 else memmap_replay_buffer.ReplayBuffer
    buffer = cls(str(folder), max_episodes=len(episodes), max_timesteps=steps, fields=FIELDS)

    def per_step():
        for data in episodes[:store_episodes]:
            with buffer.one_episode():
                for t in range(steps):
                    buffer.store(**{k: v[t] for k, v in data.items()})

    store_rate = store_episodes * steps / timed(per_step)
    buffer.clear()
    store_episode_rate = len(episodes) * steps / timed(lambda: [buffer.store_episode(**d) for d in episodes])
    loader = buffer.dataloader(batch_size=BATCH, timestep_level=True, shuffle=True)

    def sample():
        for i, _ in enumerate(loader):
            if i + 1 == batches:
                break

    sample()
    out = {"store": store_rate, "store_episode": store_episode_rate, "sample": batches * BATCH / timed(sample)}
    if not h5:
        memmaps = {n: np.load(folder / f"{n}.data.npy", mmap_mode="r") for n in FIELDS}
        rng = np.random.default_rng(1)

        def numpy_limit():
            for _ in range(batches):
                e, t = rng.integers(0, len(episodes), BATCH), rng.integers(0, steps, BATCH)
                {n: torch.from_numpy(m[e, t]) for n, m in memmaps.items()}

        numpy_limit()
        out["numpy_limit"] = batches * BATCH / timed(numpy_limit)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--store-episodes", type=int, default=3, help="episodes written with store() per step")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    episodes = [make_episode(rng, args.steps) for _ in range(args.episodes)]
    root = Path(tempfile.mkdtemp(prefix="bench-backends-"))
    results = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results["seed memmap"] = bench_seed(root / "seed", episodes, args.store_episodes, args.batches, h5=False)
            results["seed h5py"] = bench_seed(root / "seed-h5", episodes, args.store_episodes, args.batches, h5=True)
        for name in args.variants:
            results[name] = bench_ours(VARIANTS[name], root / name, episodes, args.store_episodes, args.batches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seed = results["seed memmap"]
    print(f"workload: {args.episodes} episodes x {args.steps} steps, fields {FIELDS}; timestep batches of {BATCH}")
    print(
        f"{'variant':<14} {'store() steps/s':>16} {'store_episode steps/s':>22} {'timestep samples/s':>19}"
        f" {'x seed store':>12} {'x seed sample':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:<14} {r['store']:>16,.0f} {r['store_episode']:>22,.0f} {r['sample']:>19,.0f}"
            f" {r['store'] / seed['store']:>12.1f} {r['sample'] / seed['sample']:>13.1f}"
        )
    print(f"plain numpy fancy index on the seed's memmaps: {seed['numpy_limit']:,.0f} samples/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
