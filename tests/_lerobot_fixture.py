"""A small LeRobot v3 dataset written in LeRobot's documented layout with pyarrow, pandas and PyAV
(LeRobot itself cannot be installed beside our torch): as ``LeRobotDataset.save_episode`` lays
it out, every episode's frames go to one data file (a row group each) and, in video mode, every
camera's episodes are concatenated in one mp4, each at its own ``from_timestamp``."""

from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path

import numpy as np

FPS = 10
LENGTHS = (6, 4, 5)
HW = (16, 16)


def episode_values(episode: int, length: int) -> dict[str, np.ndarray]:
    """Deterministic per-episode arrays: camera frames (smooth, so video codecs keep them close)."""
    rng = np.random.default_rng(episode)
    steps = np.arange(length)
    ys, xs = np.mgrid[: HW[0], : HW[1]]
    frames = np.stack([(ys * 8 + xs * 4 + 20 * t + 40 * episode) % 200 + 20 for t in steps]).astype(np.uint8)
    return {
        "observation.images.top": np.repeat(frames[..., None], 3, axis=-1),
        "observation.state": rng.normal(size=(length, 3)).astype(np.float32),
        "action": rng.normal(size=(length, 2)).astype(np.float32),
        "next.reward": rng.normal(size=length).astype(np.float32),
        "next.done": steps == length - 1,
    }


def write_lerobot(root: Path, video: bool, lengths: tuple[int, ...] = LENGTHS) -> dict[int, dict[str, np.ndarray]]:
    """Write the dataset at ``root``; returns each episode's arrays as written."""
    import av
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    camera = "observation.images.top"
    features = {
        camera: {"dtype": "video" if video else "image", "shape": [*HW, 3], "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": [3], "names": ["x", "y", "z"]},
        "action": {"dtype": "float32", "shape": [2], "names": ["a", "b"]},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    info = {
        "codebase_version": "v3.0",
        "robot_type": "fixture",
        "total_episodes": len(lengths),
        "total_frames": sum(lengths),
        "total_tasks": 2,
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": FPS,
        "splits": {"train": f"0:{len(lengths)}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if video else None,
        "features": features,
    }
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    (root / "data" / "chunk-000").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    pd.DataFrame({"task_index": [0, 1]}, index=pd.Index(["pick", "place"], name="task")).to_parquet(
        root / "meta" / "tasks.parquet"
    )

    written, episodes, start = {}, [], 0
    writer = None
    container = stream = None
    if video:
        path = root / "videos" / camera / "chunk-000" / "file-000.mp4"
        path.parent.mkdir(parents=True)
        container = av.open(str(path), "w")
        stream = container.add_stream("libx264", rate=Fraction(FPS))
        stream.height, stream.width = HW
        stream.pix_fmt = "yuv420p"
    for episode, length in enumerate(lengths):
        values = episode_values(episode, length)
        written[episode] = values
        steps = np.arange(length)
        columns = {
            "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(values["observation.state"].ravel()), 3),
            "action": pa.FixedSizeListArray.from_arrays(pa.array(values["action"].ravel()), 2),
            "next.reward": pa.array(values["next.reward"]),
            "next.done": pa.array(values["next.done"]),
            "timestamp": pa.array((steps / FPS).astype(np.float32)),
            "frame_index": pa.array(steps.astype(np.int64)),
            "episode_index": pa.array(np.full(length, episode, np.int64)),
            "index": pa.array((start + steps).astype(np.int64)),
            "task_index": pa.array(np.full(length, episode % 2, np.int64)),
        }
        if not video:
            cells = []
            for frame in values[camera]:
                out = io.BytesIO()
                Image.fromarray(frame).save(out, format="PNG")
                cells.append({"bytes": out.getvalue(), "path": f"frame-{len(cells):06d}.png"})
            columns = {camera: pa.array(cells), **columns}
        table = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(root / "data" / "chunk-000" / "file-000.parquet", table.schema)
        writer.write_table(table)
        row = {
            "episode_index": episode,
            "tasks": [["pick", "place"][episode % 2]],
            "length": length,
            "data/chunk_index": 0,
            "data/file_index": 0,
            "dataset_from_index": start,
            "dataset_to_index": start + length,
        }
        if video:
            for frame in values[camera]:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            row.update(
                {
                    f"videos/{camera}/chunk_index": 0,
                    f"videos/{camera}/file_index": 0,
                    f"videos/{camera}/from_timestamp": start / FPS,
                    f"videos/{camera}/to_timestamp": (start + length) / FPS,
                }
            )
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        episodes.append(row)
        start += length
    writer.close()
    if video:
        container.mux(stream.encode())
        container.close()
    pq.write_table(pa.Table.from_pylist(episodes), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    return written
