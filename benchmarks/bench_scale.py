"""Scale: open time and object count of a buffer with many episode slots, and peak RSS while
writing episodes into it, against the same writes into a small buffer (staging memory should
follow the episodes in progress, not the number of slots).

Each measurement runs in a fresh subprocess so peak RSS is its own. Usage:

    python benchmarks/bench_scale.py [--slots 100000] [--episodes 1000] [--steps 50] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FIELDS = {
    "obs": ("float", 16),
    "action": ("int", 2),
    "reward": "float",
    "frame": ("uint8", (40, 40, 3)),  # image-sized: one shard per episode
}
META_FIELDS = {"task": "int"}
MAX_TIMESTEPS = 200


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def count_objects(root: str) -> dict[str, int]:
    """Files under the buffer, split into metadata (zarr.json, counters) and chunk/shard objects."""
    counts = {"metadata": 0, "data": 0, "meta_arrays": 0, "other": 0}
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        for name in files:
            if name == "zarr.json" or name.endswith(".json"):
                counts["metadata"] += 1
            elif rel.startswith("data"):
                counts["data"] += 1
            elif rel.startswith("meta"):
                counts["meta_arrays"] += 1
            else:
                counts["other"] += 1
    return counts


def create(path: str, slots: int) -> dict:
    from replaybuf import ReplayBuffer

    start = time.perf_counter()
    ReplayBuffer(path, max_episodes=slots, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META_FIELDS).close()
    return {"create_s": time.perf_counter() - start, "objects": count_objects(path)}


def open_times(path: str, repeats: int = 5) -> dict:
    from replaybuf import ReplayBuffer

    out = {}
    for mode, read_only in (("read_only", True), ("writable", False)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ReplayBuffer.from_folder(path, read_only=read_only).close()
            times.append(time.perf_counter() - start)
        out[f"open_{mode}_s"] = statistics.median(times)
    return out


def write(path: str, episodes: int, steps: int) -> dict:
    import numpy as np

    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer.from_folder(path)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(steps, 16)).astype(np.float32)
    frames = ((np.arange(steps)[:, None, None, None] + np.arange(40 * 40 * 3).reshape(40, 40, 3) // 97) % 256).astype(
        np.uint8
    )
    base = highest = current_rss_mib()
    start = time.perf_counter()
    for episode in range(episodes):
        with buffer.one_episode(task=episode):
            for t in range(steps):
                buffer.store(obs=obs[t], action=np.array([t, episode]), reward=float(t), frame=frames[t])
            highest = max(highest, current_rss_mib())  # the episode's rows are all staged here
    elapsed = time.perf_counter() - start
    buffer.close()
    return {
        "write_s": elapsed,
        "episodes_per_s": episodes / elapsed,
        "rss_before_write_mib": base,
        "peak_rss_while_writing_mib": highest,
        "objects_after": count_objects(path),
    }


def child(argv: list[str]) -> dict:
    """Run one measurement in a fresh interpreter and return its JSON."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(f"measurement {argv} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=100_000)
    parser.add_argument("--small-slots", type=int, default=1_000)
    parser.add_argument("--episodes", type=int, default=1_000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--root", default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        action, path, *rest = args.child
        if action == "create":
            out = create(path, int(rest[0]))
        elif action == "open":
            out = open_times(path)
        else:
            out = write(path, int(rest[0]), int(rest[1]))
        out["import_and_run_peak_rss_mib"] = peak_rss_mib()
        print(json.dumps(out))
        return

    root = args.root or tempfile.mkdtemp(prefix="replaybuf-scale-")
    results = {}
    try:
        for slots in (args.slots, args.small_slots):
            path = os.path.join(root, f"slots-{slots}")
            results[slots] = {
                **child(["create", path, str(slots)]),
                **child(["open", path]),
                **child(["write", path, str(args.episodes), str(args.steps)]),
                "open_after_write": child(["open", path]),
            }
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    big, small = results[args.slots], results[args.small_slots]
    print(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    print(f"\n{args.slots:,} slots vs {args.small_slots:,} slots ({args.episodes} episodes x {args.steps} steps):")
    for key in ("create_s", "open_read_only_s", "open_writable_s"):
        print(f"  {key:22s} {big[key] * 1e3:9.1f} ms  vs {small[key] * 1e3:9.1f} ms  ({big[key] / small[key]:.2f}x)")
    print(
        f"  {'objects after create':22s} {sum(big['objects'].values()):9d}     vs {sum(small['objects'].values()):9d}"
    )
    print(
        f"  {'write episodes/s':22s} {big['episodes_per_s']:9.1f}     vs {small['episodes_per_s']:9.1f}"
        f"     ({big['episodes_per_s'] / small['episodes_per_s']:.2f}x)"
    )
    print(
        f"  {'peak RSS while writing':22s} {big['peak_rss_while_writing_mib']:9.1f} MiB vs "
        f"{small['peak_rss_while_writing_mib']:9.1f} MiB (before writing: {big['rss_before_write_mib']:.1f} vs "
        f"{small['rss_before_write_mib']:.1f})"
    )
    print(
        f"  {'objects after writing':22s} {sum(big['objects_after'].values()):9d}     vs "
        f"{sum(small['objects_after'].values()):9d}"
    )


if __name__ == "__main__":
    main()
