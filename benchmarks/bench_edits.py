"""In-place edits of image rows: ms per ``update()`` of whole episodes, per backend.

A buffer of ``--episodes`` x ``--steps`` frames (84x84x3 uint8) and a float reward is filled
with ``store_episode``; then ``--calls`` calls of ``update`` each rewrite ``--edited`` episodes'
frames and rewards (new values each call). Reported per backend: the median and the best ms
per call (the first call, a warm-up, is left out) and the MB of new values a call writes.
Each edit writes its new values twice, to the edit log (``replaybuf/edit``) and to the rows:
run this on two checkouts (``PYTHONPATH=<checkout>``) to compare.

Run: python benchmarks/bench_edits.py [--episodes 16] [--steps 250] [--edited 8] [--calls 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from replaybuf import ReplayBuffer  # noqa: E402

FRAME = (84, 84, 3)


def measure(backend: str, root: str, episodes: int, steps: int, edited: int, calls: int) -> list[float]:
    """Seconds per ``update`` call on a filled buffer of ``backend``."""
    buffer = ReplayBuffer(
        str(Path(root) / backend),
        backend=backend,
        max_episodes=episodes,
        max_timesteps=steps,
        fields={"frame": ("uint8", FRAME), "reward": "float"},
    )
    frames = np.random.default_rng(0).integers(0, 255, (steps, *FRAME), dtype=np.uint8)
    for _ in range(episodes):
        buffer.store_episode(frame=frames, reward=np.zeros(steps))
    slots, seconds = list(range(edited)), []
    for call in range(calls + 1):
        new = np.broadcast_to(frames ^ np.uint8(call + 1), (edited, steps, *FRAME))
        start = time.perf_counter()
        buffer.update(slots, frame=new, reward=np.full((edited, steps), float(call)))
        seconds.append(time.perf_counter() - start)
    buffer.close()
    return seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--edited", type=int, default=8)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--backends", nargs="+", default=["zarr", "memmap", "hdf5"])
    args = parser.parse_args()
    megabytes = args.edited * args.steps * (np.prod(FRAME) + 8) / 1e6
    print(f"update() of {args.edited} episodes x {args.steps} steps ({megabytes:.0f} MB of new values a call)\n")
    print("| backend | median ms | best ms |\n|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="replaybuf-bench-edits-") as root:
        for backend in args.backends:
            seconds = measure(backend, root, args.episodes, args.steps, args.edited, args.calls)
            print(f"| {backend} | {statistics.median(seconds) * 1e3:.0f} | {min(seconds) * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
