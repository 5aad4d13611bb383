"""LeRobot side by side (issue 17), outside CI: the same episodes as LeRobot datasets (video and
image mode, written by LeRobot itself) and as a replaybuf buffer (imported from the video
dataset with ``replaybuf.importers``), read as time-window batches by both.

    bash benchmarks/lerobot_env.sh                         # once: LeRobot's own venv
    PYTHONPATH=$PWD python benchmarks/bench_lerobot.py [--episodes 50] [--steps 250]

The driver (this repo's python) runs every step below as a subprocess, so each step's peak RSS
is its own; the LeRobot steps run in the venv's python (``--venv``, default /work/venvs/lerobot),
which has LeRobot but not replaybuf. Steps:

- ``make MODE``: ``LeRobotDataset.create`` + ``add_frame`` + ``save_episode`` + ``finalize``
  (LeRobot's default encoder, libsvtav1, in video mode; PNG frames in image mode).
- ``decode``: every mp4 of the video dataset decoded with PyAV alone (the decode bound).
- ``write``: ``store_episode`` of the same episodes from RAM into a zarr buffer (the write bound).
- ``import``: ``replaybuf.importers.lerobot`` of the video dataset into a zarr buffer.
- ``load-lerobot MODE W`` / ``load-replaybuf W``: batches of 32 shuffled samples, each 16 steps
  of both cameras and the action, with W DataLoader workers: ``LeRobotDataset`` with
  ``delta_timestamps`` (16 frames at 1/fps) against ``ReplayDatasetTimeWindow(16)``.
- ``check-reader``: LeRobot's own reader (``LeRobotDataset(repo_id, root=...)``) on the test
  fixture (``tests/_lerobot_fixture.py``) and on replaybuf's LeRobot exports, values compared.

Episodes: 2 cameras 96x96x3 (a smooth scene panning 0-1 or 1 pixel per step, with sensor noise
of sd 2 levels, so video and PNG compress about as camera footage does, not as pure noise or a
flat colour), state (8 float32) and action (7 float32).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

FPS = 30
HW = 96
CAMERAS = ("observation.images.cam_high", "observation.images.cam_wrist")
WINDOW = 16
BATCH = 32
REPO = Path(__file__).resolve().parent.parent


def _upsample(coarse: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear upsampling of (h, w, C) to (height, width, C): smooth shapes, not blocks."""

    def weights(size: int, out: int) -> np.ndarray:  # (out, size): linear interpolation
        return np.stack([np.interp(np.linspace(0, size - 1, out), np.arange(size), row) for row in np.eye(size)], 1)

    rows, cols = weights(coarse.shape[0], height), weights(coarse.shape[1], width)
    return (rows @ coarse.transpose(2, 0, 1).astype(np.float32) @ cols.T).transpose(1, 2, 0)


def episode_arrays(episode: int, steps: int) -> dict[str, np.ndarray]:
    """The benchmark's episode ``episode``: the same arrays in every process. Each camera sees
    a smooth scene panning by a pixel or two per step, with sensor noise (sd 2 levels)."""
    rng = np.random.default_rng(episode)
    out = {}
    for k, camera in enumerate(CAMERAS):
        scene = _upsample(rng.uniform(0, 255, (HW // 12, (HW + 2 * steps) // 12 + 1, 3)), HW, HW + 2 * steps)
        offsets = np.arange(steps) * (k + 1) // 2
        noise = rng.normal(0, 2, (steps, HW, HW, 3)).astype(np.float32)
        frames = np.stack([scene[:, o : o + HW] for o in offsets]) + noise
        out[camera] = np.clip(frames, 0, 255).astype(np.uint8)
    out["observation.state"] = rng.normal(size=(steps, 8)).astype(np.float32)
    out["action"] = rng.normal(size=(steps, 7)).astype(np.float32)
    return out


def peak_rss_mb() -> dict[str, float]:
    """Peak RSS of this process and of its largest child (DataLoader workers), in MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"peak_rss_mb": round(own, 1), "worker_peak_rss_mb": round(children, 1)}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def time_batches(loader, keys: list[str], max_batches: int, budget_s: float) -> dict:
    """Samples/s over the batches after the first two (worker start-up and first reads), until
    ``max_batches`` or ``budget_s`` seconds, and the shapes of ``keys`` in the last batch."""
    iterator = iter(loader)
    for _ in range(2):
        next(iterator)
    samples, started = 0, time.perf_counter()
    for count, batch in enumerate(iterator, start=1):
        samples += len(batch[next(iter(batch))])
        if count >= max_batches or time.perf_counter() - started > budget_s:
            break
    elapsed = time.perf_counter() - started
    shapes = {key: list(batch[key].shape) for key in keys}
    return {
        "samples": samples,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(samples / elapsed, 1),
        "shapes": shapes,
    }


# ---- LeRobot steps (the venv's python) ------------------------------------------------------------


def make_lerobot(root: Path, mode: str, episodes: int, steps: int) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    image = {"dtype": mode, "shape": (HW, HW, 3), "names": ["height", "width", "channels"]}
    features = {
        **{camera: dict(image) for camera in CAMERAS},
        "observation.state": {"dtype": "float32", "shape": (8,), "names": None},
        "action": {"dtype": "float32", "shape": (7,), "names": None},
    }
    started = time.perf_counter()
    dataset = LeRobotDataset.create(
        f"bench/{mode}", FPS, features, root=root, robot_type="bench", use_videos=mode == "video"
    )
    for episode in range(episodes):
        arrays = episode_arrays(episode, steps)
        for t in range(steps):
            dataset.add_frame({**{k: v[t] for k, v in arrays.items()}, "task": f"task {episode % 3}"})
        dataset.save_episode()
    dataset.finalize()
    elapsed = time.perf_counter() - started
    emit({"step": f"make {mode}", "seconds": round(elapsed, 1), "bytes": folder_bytes(root), **peak_rss_mb()})


def load_lerobot(root: Path, mode: str, workers: int, max_batches: int, budget_s: float) -> None:
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    window = [t / FPS for t in range(WINDOW)]
    dataset = LeRobotDataset(
        f"bench/{mode}",
        root=root,
        delta_timestamps={**{camera: window for camera in CAMERAS}, "action": window},
        video_backend="pyav",
    )
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    timing = time_batches(loader, [*CAMERAS, "action"], max_batches, budget_s)
    emit({"step": f"load lerobot {mode} w{workers}", **timing, **peak_rss_mb()})


def check_reader(folders: Path) -> None:
    """LeRobot's reader on each dataset folder under ``folders``: every frame's numeric
    features and camera images, saved for the driver to compare with what was written."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    for folder in sorted(folders.iterdir()):
        if not (folder / "meta" / "info.json").exists():
            continue
        try:
            dataset = LeRobotDataset(f"check/{folder.name}", root=folder, video_backend="pyav")
            frames = [dataset[i] for i in range(len(dataset))]
            arrays = {key: np.stack([np.asarray(f[key]) for f in frames]) for key in frames[0] if key != "task"}
            arrays["task"] = np.array([f["task"] for f in frames])
            np.savez(folder.parent / f"{folder.name}.read.npz", **arrays)
            emit({"step": f"check {folder.name}", "ok": True, "frames": len(dataset), "episodes": dataset.num_episodes})
        except Exception as error:  # noqa: BLE001 - the check records why LeRobot refused the folder
            emit({"step": f"check {folder.name}", "ok": False, "error": f"{type(error).__name__}: {error}"})


# ---- replaybuf steps (this repo's python) -----------------------------------------------------------


def decode_bound(root: Path) -> None:
    import av

    started, frames = time.perf_counter(), 0
    for path in sorted((root / "videos").rglob("*.mp4")):
        with av.open(str(path)) as container:
            for frame in container.decode(container.streams.video[0]):
                frame.to_ndarray(format="rgb24")
                frames += 1
    elapsed = time.perf_counter() - started
    steps = frames / len(CAMERAS)
    emit({"step": "decode", "frames": frames, "seconds": round(elapsed, 2), "steps_per_s": round(steps / elapsed, 1)})


def write_bound(dst: Path, episodes: int, steps: int) -> None:
    """``store_episode`` of the same episodes, already in RAM, into a zarr buffer like the
    import's: the import's other half (it decodes, then writes, one episode at a time)."""
    from replaybuf import ReplayBuffer

    fields = {c.replace(".", "_"): ("uint8", (HW, HW, 3)) for c in CAMERAS}
    fields.update(observation_state=("float32", (8,)), action=("float32", (7,)))
    buffer = ReplayBuffer(dst, max_episodes=episodes, max_timesteps=steps, fields=fields)
    elapsed = 0.0
    for episode in range(episodes):
        arrays = {k.replace(".", "_"): v for k, v in episode_arrays(episode, steps).items()}
        started = time.perf_counter()
        buffer.store_episode(**arrays)
        elapsed += time.perf_counter() - started
    started = time.perf_counter()
    buffer.close()
    elapsed += time.perf_counter() - started
    emit({"step": "write", "seconds": round(elapsed, 2), "steps_per_s": round(episodes * steps / elapsed, 1)})


def import_replaybuf(src: Path, dst: Path) -> None:
    from replaybuf import importers

    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def watch() -> None:  # RSS over time: flat as episodes accumulate means memory bounded by one
        while not done.is_set():
            with open("/proc/self/status") as status:
                rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
            samples.append((time.perf_counter(), rss / 1024))
            done.wait(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    started = time.perf_counter()
    thread.start()
    result = importers.lerobot(src, dst, progress=False)
    elapsed = time.perf_counter() - started
    done.set()
    thread.join()
    first_fifth = max(rss for t, rss in samples if t - started <= elapsed / 5)
    emit(
        {
            "step": "import",
            "episodes": result.imported,
            "frames": result.frames,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(result.frames / elapsed, 1),
            "bytes": folder_bytes(dst),
            "rss_first_fifth_mb": round(first_fifth, 1),
            **peak_rss_mb(),
        }
    )


def load_replaybuf(location: Path, workers: int, max_batches: int, budget_s: float) -> None:
    import torch

    from replaybuf import ReplayBuffer, ReplayDatasetTimeWindow
    from replaybuf.sampling import make_dataloader

    buffer = ReplayBuffer.from_folder(location, read_only=True)
    cameras = [c.replace(".", "_") for c in CAMERAS]
    dataset = ReplayDatasetTimeWindow(buffer, WINDOW, fields=[*cameras, "action"], include_metadata=False)
    # one window per episode per pass: draw episodes with replacement, many passes' worth
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=BATCH * (max_batches + 10))
    torch.manual_seed(0)
    loader = make_dataloader(buffer, BATCH, dataset=dataset, sampler=sampler, num_workers=workers)
    timing = time_batches(loader, [*cameras, "action"], max_batches, budget_s)
    emit({"step": f"load replaybuf w{workers}", **timing, **peak_rss_mb()})


def export_for_check(buffer: Path, out: Path) -> None:
    """replaybuf's LeRobot exports (image and video mode) of ``buffer``, for ``check-reader``."""
    from replaybuf import importers

    importers.export_lerobot(buffer, out / "export-image")
    importers.export_lerobot(buffer, out / "export-video", video=True)


def write_fixtures(out: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests._lerobot_fixture import write_lerobot

    write_lerobot(out / "fixture-image", video=False)
    write_lerobot(out / "fixture-video", video=True)


def compare_reads(work: Path) -> list[dict]:
    """What LeRobot read from each checked folder against what was written (fixtures) or
    exported (replaybuf's buffer of the fixture): exact for numbers and PNG frames, mean
    absolute difference for video frames."""
    sys.path.insert(0, str(REPO))
    from replaybuf import ReplayBuffer
    from tests._lerobot_fixture import LENGTHS, episode_values

    out = []
    for name in ("fixture-image", "fixture-video", "export-image", "export-video"):
        path = work / "check" / f"{name}.read.npz"
        if not path.exists():
            continue
        read = np.load(path)
        if name.startswith("fixture"):
            written = [episode_values(e, n) for e, n in enumerate(LENGTHS)]
            expected = {k: np.concatenate([w[k] for w in written]) for k in written[0]}
        else:
            buffer = ReplayBuffer.from_folder(work / "check" / "buffer", read_only=True)
            slots = buffer.valid_episodes()
            lens = buffer.episode_lens[slots]
            fields = {"observation.images.top": "observation_images_top", "observation.state": "observation_state"}
            fields.update({"action": "action", "next.reward": "next_reward", "next.done": "next_done"})
            expected = {
                k: np.concatenate([buffer.data[f][s, :n] for s, n in zip(slots, lens)]) for k, f in fields.items()
            }
        report = {"folder": name}
        for key, values in expected.items():
            got = read[key]
            if key.startswith("observation.images"):
                got = np.round(got.transpose(0, 2, 3, 1) * 255).astype(int)  # LeRobot gives CHW floats
                report[f"{key} mean abs diff"] = round(float(np.abs(got - values.astype(int)).mean()), 3)
            else:
                report[f"{key} equal"] = bool(np.array_equal(got.reshape(values.shape), values))
        report["tasks"] = sorted(set(read["task"].tolist()))
        out.append(report)
    return out


# ---- driver ----------------------------------------------------------------------------------------


def run(python: str, *args: str, timeout: float = 1800) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    done = subprocess.run(
        [python, __file__, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"  {' '.join(args[:3])}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", nargs="*", help="a step (run by the driver); none: the whole benchmark")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batches", type=int, default=30, help="batches timed per loader (after 2 warm-up)")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds at most per timed loader")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-lerobot"))
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/lerobot"))
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    work = args.work
    if args.step:
        step, *rest = args.step
        steps = {
            "make": lambda: make_lerobot(work / rest[0], rest[0], args.episodes, args.steps),
            "decode": lambda: decode_bound(work / "video"),
            "write": lambda: write_bound(work / "write-bound", args.episodes, args.steps),
            "import": lambda: import_replaybuf(work / "video", work / "replaybuf"),
            "load-lerobot": lambda: load_lerobot(work / rest[0], rest[0], int(rest[1]), args.batches, args.budget),
            "load-replaybuf": lambda: load_replaybuf(work / "replaybuf", int(rest[0]), args.batches, args.budget),
            "check-reader": lambda: check_reader(work / "check"),
        }
        steps[step]()
        return

    import shutil

    venv_python = str(args.venv / "bin" / "python")
    if not Path(venv_python).exists():
        sys.exit(f"no LeRobot venv at {args.venv}: run bash benchmarks/lerobot_env.sh first")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    common = ["--episodes", str(args.episodes), "--steps", str(args.steps), "--work", str(work)]
    timing = ["--batches", str(args.batches), "--budget", str(args.budget)]
    results: list[dict] = []
    for mode in ("video", "image"):
        results += run(venv_python, "make", mode, *common)
    results += run(sys.executable, "decode", *common)
    results += run(sys.executable, "write", *common)
    results += run(sys.executable, "import", *common)
    for workers in args.workers.split(","):
        results += run(sys.executable, "load-replaybuf", workers, *common, *timing)
        for mode in ("video", "image"):
            results += run(venv_python, "load-lerobot", mode, workers, *common, *timing)
    # LeRobot's reader on the test fixture and on replaybuf's exports of its import
    write_fixtures(work / "check")
    from replaybuf import importers

    importers.lerobot(work / "check" / "fixture-image", work / "check" / "buffer", progress=False)
    export_for_check(work / "check" / "buffer", work / "check")
    results += run(venv_python, "check-reader", *common)
    results.append({"step": "compare", "reads": compare_reads(work)})
    for result in results:
        print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
