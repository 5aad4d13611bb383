"""Peak RSS of ``replaybuf.importers`` on a diffusion_policy zarr and a LeRobot v3 folder (image
mode) of N episodes against the same of 10 x N episodes: an import streams one episode at a
time, so peak RSS should stay flat as the source grows.

Each import runs in a fresh subprocess so peak RSS is its own. Usage:

    python benchmarks/bench_import_rss.py [--episodes 10] [--steps 200] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HW = (64, 64)


def make_diffusion_policy(path: Path, episodes: int, steps: int) -> None:
    import zarr

    total = episodes * steps
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    img = root.create_array("data/img", shape=(total, *HW, 3), chunks=(steps, *HW, 3), dtype="uint8")
    state = root.create_array("data/state", shape=(total, 8), chunks=(steps, 8), dtype="float32")
    rng = np.random.default_rng(0)
    for e in range(episodes):
        img[e * steps : (e + 1) * steps] = rng.integers(0, 255, (steps, *HW, 3), dtype=np.uint8)
        state[e * steps : (e + 1) * steps] = rng.normal(size=(steps, 8))
    root.create_array("meta/episode_ends", data=np.arange(1, episodes + 1, dtype=np.int64) * steps)


def child(fmt: str, src: str, dst: str) -> None:
    from replaybuf import importers

    started = time.perf_counter()
    result = importers.load(fmt, src, dst, progress=False)
    seconds = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"frames": result.frames, "seconds": seconds, "peak_rss_mib": peak_mib}))


def measure(fmt: str, src: Path, dst: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", fmt, str(src), str(dst)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--root", default=None)
    parser.add_argument("--child", nargs=3, metavar=("FORMAT", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-import-"))
    try:
        for episodes in (args.episodes, 10 * args.episodes):
            dp = root / f"dp-{episodes}.zarr"
            make_diffusion_policy(dp, episodes, args.steps)
            row = measure("diffusion_policy", dp, root / f"dst-dp-{episodes}")
            mib = episodes * args.steps * (HW[0] * HW[1] * 3 + 32) / 2**20
            print(
                f"diffusion_policy {episodes:5d} episodes x {args.steps} steps ({mib:7.0f} MiB raw): "
                f"peak RSS {row['peak_rss_mib']:6.0f} MiB, {row['frames'] / row['seconds']:8.0f} frames/s"
            )
            lerobot = root / f"lerobot-{episodes}"
            from replaybuf.importers import export_lerobot

            export_lerobot(root / f"dst-dp-{episodes}", lerobot)
            row = measure("lerobot", lerobot, root / f"dst-lr-{episodes}")
            print(
                f"lerobot images   {episodes:5d} episodes x {args.steps} steps: "
                f"peak RSS {row['peak_rss_mib']:6.0f} MiB, {row['frames'] / row['seconds']:8.0f} frames/s"
            )
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
