"""The read cache (issue 16) on moto's S3 server and on local disk: timestep batches per second.

Run from the repository root::

    python benchmarks/bench_cache.py [--episodes 40] [--steps 100] [--batch 256]

Writes ``episodes`` x ``steps`` of 84x84x3 frames + a 4-float state to moto (in this process,
recording requests) and to a local zarr buffer, then reads timestep batches for two epochs
(0 workers) from one DataLoader, as a training loop does: the first fills the cache (peak
requests in flight and GETs counted at the server), the second reads it; then one epoch of a new
DataLoader (its snapshot's requests). Local: uncached vs warm cache, second epoch of one loader.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replaybuf import ReplayBuffer  # noqa: E402
from replaybuf.sampling import make_dataloader  # noqa: E402
from tests._servers import S3TestServer  # noqa: E402

FIELDS = {"image": ("uint8", (84, 84, 3)), "state": ("float", 4)}


def fill(buffer: ReplayBuffer, episodes: int, steps: int) -> None:
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (steps, 84, 84, 3), dtype=np.uint8)
    for _ in range(episodes):
        buffer.store_episode(image=frame, state=rng.random((steps, 4), dtype=np.float32))
    buffer.close()


def loader(buffer: ReplayBuffer, batch: int, seed: int) -> Iterable:
    """A shuffled DataLoader of timestep batches (its snapshot taken now)."""
    return make_dataloader(buffer, batch_size=batch, timestep_level=True, shuffle=True, seed=seed)


def epoch(batches: Iterable) -> float:
    """Samples per second of one pass over ``batches``."""
    start, count = time.perf_counter(), 0
    for out in batches:
        count += len(out["state"])
    return count / (time.perf_counter() - start)


def du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    options = dict(max_episodes=args.episodes, max_timesteps=args.steps, fields=FIELDS)
    server = S3TestServer()
    server.start()
    server.create_bucket()
    tmp = tempfile.mkdtemp(prefix="bench-cache-")
    try:
        url = server.url(f"bench-{uuid.uuid4().hex[:8]}")
        fill(ReplayBuffer(url, storage_options=server.storage_options, **options), args.episodes, args.steps)
        fill(ReplayBuffer(os.path.join(tmp, "local"), **options), args.episodes, args.steps)
        for label, cache in (("uncached", False), ("cached", None)):
            reader = ReplayBuffer.from_folder(
                url,
                read_only=True,
                storage_options=server.storage_options,
                cache=cache,
                cache_dir=None if cache is False else os.path.join(tmp, "cache-s3"),
            )
            batches = loader(reader, args.batch, seed=0)
            for index, label_epoch in enumerate(("epoch 1", "epoch 2", "new loader")):
                with server.record() as log:
                    rate = epoch(loader(reader, args.batch, seed=1) if index == 2 else batches)
                gets = sum(1 for m, p in log.requests if m == "GET" and "/data/" in p)
                print(
                    f"s3 {label} {label_epoch}: {rate:,.0f} samples/s, data GETs {gets} "
                    f"(all requests {log.count()}), "
                    f"peak in flight {log.peak_in_flight['GET']}"
                )
        local = os.path.join(tmp, "local")
        plain = ReplayBuffer.from_folder(local, read_only=True)
        cached = ReplayBuffer.from_folder(local, read_only=True, cache="disk", cache_dir=os.path.join(tmp, "cache"))
        cached.warm_cache(progress=False)
        for label, buffer in (("local uncached", plain), ("local warm cache", cached)):
            batches = loader(buffer, args.batch, seed=0)
            epoch(batches)
            print(f"{label}: {epoch(batches):,.0f} samples/s (epoch 2)")
        print(
            f"cache bytes: {du(os.path.join(tmp, 'cache')):,} (raw image+state {args.episodes * args.steps * (84 * 84 * 3 + 16):,})"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
