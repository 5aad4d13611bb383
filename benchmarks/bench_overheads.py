"""What the features beyond the seed cost when they are used: the README's figures for them.

- ``rate limiter``: a timestep loader (64 a batch, state-only buffer of ``--episodes`` x
  ``--steps``, read-only) with ``samples_per_insert=inf`` (it never blocks) against the same
  loader without it, in alternating rounds in this process (batches/s, medians), for three ways
  of reading: the buffer's own read cache (``cache='disk'`` at open, the default on object
  stores), none, and a loader's ``cache='ram'``. A rate-limited loader makes its loader anew for
  each pass (to see newer commits), so what that costs is paid once per pass.
- ``snapshot``: ``buffer.snapshot(name)`` on a buffer of ``--snapshot-episodes`` committed
  episodes (ms, median of 5; the bytes of its ``snapshot.json``).
- ``first stats()``: a writer's first ``replaybuf.analysis.stats(buffer)`` (builds every
  episode's sketches) and its second, on ``--stats-episodes`` episodes of 1,000 steps of 39
  float features; ms per episode.

Run: python benchmarks/bench_overheads.py [--episodes 200] [--steps 100] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from replaybuf import ReplayBuffer  # noqa: E402
from replaybuf.analysis import stats  # noqa: E402

STATE_FIELDS = {"state": ("float", (8,)), "action": ("float", (2,)), "reward": "float"}
LIMITED = {"samples_per_insert": float("inf")}  # a limiter that never blocks: its cost alone


def filled(folder: Path, episodes: int, steps: int, fields: dict, **options) -> ReplayBuffer:
    """A zarr buffer at ``folder`` holding ``episodes`` random episodes of ``steps`` steps."""
    buffer = ReplayBuffer(str(folder), max_episodes=episodes, max_timesteps=steps, fields=fields, **options)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        buffer.store_episode(
            **{
                name: rng.random((steps, *(spec[1] if isinstance(spec, tuple) else ())), dtype=np.float32)
                for name, spec in fields.items()
            }
        )
    buffer.flush()
    return buffer


def batches_per_second(loader, batches: int) -> float:
    """Batches/s over ``batches`` batches after two warm-up ones (the loader restarts at its end)."""
    iterator, done = iter(loader), 0
    for _ in range(2):
        next(iterator)
    start = time.perf_counter()
    while done < batches:
        try:
            next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        done += 1
    return batches / (time.perf_counter() - start)


def rate_limiter(root: Path, episodes: int, steps: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per way of reading, (median batches/s without a limiter, with one that never blocks) of
    a timestep loader over a read-only reader, in alternating rounds."""
    filled(root / "rate", episodes, steps, STATE_FIELDS).close()
    common = dict(batch_size=64, timestep_level=True, shuffle=True, drop_last=True)
    ways = {
        "buffer cache='disk' (as s3:// by default)": ({"cache": "disk", "cache_dir": str(root / "cache")}, {}),
        "no read cache": ({}, {}),
        "loader cache='ram'": ({}, {"cache": "ram"}),  # under $REPLAYBUF_CACHE_DIR (``main`` sets it)
    }
    figures = {}
    for way, (opened, loader_options) in ways.items():
        reader = ReplayBuffer.from_folder(str(root / "rate"), read_only=True, **opened)
        loaders = [reader.dataloader(**common, **loader_options, **limited) for limited in ({}, LIMITED)]
        times: list[list[float]] = [[], []]
        for round_ in range(rounds):
            for k in (0, 1) if round_ % 2 == 0 else (1, 0):
                times[k].append(batches_per_second(loaders[k], 500))
        figures[way] = (statistics.median(times[0]), statistics.median(times[1]))
    return figures


def snapshot_cost(root: Path, episodes: int) -> tuple[float, int]:
    """(median ms of ``snapshot(name)`` over 5 names, bytes of one snapshot.json) at ``episodes``."""
    buffer = filled(root / "snap", episodes, 4, {"x": "float"})
    times = []
    for k in range(5):
        start = time.perf_counter()
        buffer.snapshot(f"s{k}")
        times.append(time.perf_counter() - start)
    size = (root / "snap" / "replaybuf" / "snapshots" / "s0" / "snapshot.json").stat().st_size
    buffer.close()
    return statistics.median(times) * 1e3, size


def stats_cost(root: Path, episodes: int) -> tuple[float, float]:
    """(ms per episode of a writer's first stats(), of its second) on 1,000-step episodes of 39 features."""
    buffer = filled(root / "stats", episodes, 1000, {"obs": ("float", (32,)), "act": ("float", (6,)), "rew": "float"})
    start = time.perf_counter()
    stats(buffer)
    first = time.perf_counter() - start
    start = time.perf_counter()
    stats(buffer)
    second = time.perf_counter() - start
    buffer.close()
    return first * 1e3 / episodes, second * 1e3 / episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--snapshot-episodes", type=int, default=10_000)
    parser.add_argument("--stats-episodes", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        os.environ["REPLAYBUF_CACHE_DIR"] = str(root / "cache")  # a loader's cache='ram' files go with the run
        for way, (plain, limited) in rate_limiter(root, args.episodes, args.steps, args.rounds).items():
            print(
                f"rate limiter (never blocking), timestep batches of 64, {way}: {limited:,.0f} batches/s against "
                f"{plain:,.0f} without ({limited / plain:.2f}x), medians of {args.rounds} alternating rounds"
            )
        ms, size = snapshot_cost(root, args.snapshot_episodes)
        print(f"snapshot(name) at {args.snapshot_episodes:,} episodes: {ms:.1f} ms (median of 5), {size / 1e3:.0f} kB")
        first, second = stats_cost(root, args.stats_episodes)
        print(
            f"stats() on {args.stats_episodes} x 1,000 steps of 39 features: first {first:.2f} ms per episode, "
            f"second {second:.2f} ms per episode"
        )


if __name__ == "__main__":
    main()
