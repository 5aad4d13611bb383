"""``update_priorities`` after every training step: ms per call of one batch of scattered pairs.

A buffer of ``--episodes`` x ``--steps`` with ``state`` f32[8] and ``priority`` f32 is filled
with ``store_episode``; then ``--calls`` calls of ``update_priorities`` each write ``--batch``
random (episode, timestep) pairs (repeats included, as a sampler draws them). Reported per
backend: the median and the best ms per call (the first call, a warm-up,
is left out). The local zarr buffer packs both fields (one chunk file each), so a call is one
read and one write per span of nearby rows plus the two revision writes and the checksums.
TorchRL's ``PrioritizedSampler`` keeps its sum tree in RAM (no store to write); its C++
segment tree is not built on this machine, so it is not measured here.

Run: python benchmarks/bench_priorities.py [--episodes 500] [--steps 50] [--batch 256] [--calls 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from replaybuf import ReplayBuffer  # noqa: E402
from replaybuf.sampling import update_priorities  # noqa: E402


def measure(backend: str, root: str, episodes: int, steps: int, batch: int, calls: int) -> list[float]:
    """Seconds per ``update_priorities`` call on a filled buffer of ``backend``."""
    buffer = ReplayBuffer(
        str(Path(root) / backend),
        backend=backend,
        max_episodes=episodes,
        max_timesteps=steps,
        fields={"state": ("float", (8,)), "priority": "float"},
    )
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        buffer.store_episode(state=rng.random((steps, 8), dtype=np.float32), priority=np.ones(steps, np.float32))
    times = []
    for _ in range(calls + 1):
        pairs = np.stack([rng.integers(0, episodes, batch), rng.integers(0, steps, batch)], 1)
        start = time.perf_counter()
        update_priorities(buffer, pairs, rng.random(batch))
        times.append(time.perf_counter() - start)
    buffer.close()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=500)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--backends", nargs="+", default=["zarr", "memmap", "hdf5"])
    args = parser.parse_args()
    print(f"| backend | median ms / call | best ms / call |  ({args.episodes} x {args.steps}, batch {args.batch})")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for backend in args.backends:
            times = measure(backend, root, args.episodes, args.steps, args.batch, args.calls)
            print(f"| {backend} | {1e3 * np.median(times):.2f} | {1e3 * min(times):.2f} |")


if __name__ == "__main__":
    main()
