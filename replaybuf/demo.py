"""The README's first command: write a small buffer with an image field, sample it, report.

python -m replaybuf.demo [FOLDER]

The buffer is kept in FOLDER (default ``./replaybuf-demo``) for ``replaybuf view``,
``replaybuf info``, dask, xarray or ``examples/analysis.ipynb``; the demo ends by printing those
commands. A rerun replaces its own earlier buffer, and refuses a folder holding anything else.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from replaybuf import BufferLockedError, ReplayBuffer
from replaybuf.schema import Schema

DEFAULT_FOLDER = "./replaybuf-demo"
CONFIG: dict[str, Any] = dict(
    max_episodes=64,
    max_timesteps=100,
    fields=dict(frame=("uint8", (64, 64, 3)), state=("float", 8), action=("int", 2), reward="float"),
    meta_fields=dict(task_id="int"),
    circular=True,
)
# what a zarr buffer's folder holds: a rerun may replace a folder with nothing else in it
BUFFER_ENTRIES = {"zarr.json", "data", "meta", "replaybuf"}


def rendered_frame(t: int, episode: int, size: int = 64) -> np.ndarray:
    """A cheap rendered-looking RGB frame: a gradient background and a moving square."""
    y, x = np.mgrid[0:size, 0:size]
    frame = np.stack([x * 4 % 256, y * 4 % 256, np.full_like(x, 40 * episode % 256)], axis=-1).astype(np.uint8)
    cx, cy = (5 + 2 * t) % (size - 8), (10 + t + 7 * episode) % (size - 8)
    frame[cy : cy + 8, cx : cx + 8] = (255, 220, 0)
    return frame


def foreign_content(folder: Path) -> str | None:
    """What in ``folder`` is not an earlier demo buffer (None when it is free to write)."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "it is a file, not a folder"
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return None
    others = [e for e in entries if e not in BUFFER_ENTRIES]
    if others:
        return f"it holds {others[:5]}, which no replaybuf buffer writes"
    try:
        stored = ReplayBuffer.from_folder(str(folder), read_only=True)
    except (OSError, ValueError, KeyError) as e:
        return f"it holds no readable replaybuf buffer ({e})"
    differences = stored.schema.differences(Schema.build(**CONFIG))
    stored.close()
    if differences:
        return "it holds a replaybuf buffer that is not the demo's:\n" + "\n".join(differences)
    return None


def next_steps(folder: str) -> str:
    """The commands to look at the demo buffer next, for ``folder`` as the user named it."""
    quoted = shlex.quote(folder)
    return "\n".join(
        [
            "next, look at it:",
            f"  replaybuf view {quoted}",
            f"  replaybuf info {quoted}",
            "  # in Python, as dask arrays (or .to_xarray(); examples/analysis.ipynb does more):",
            "  from replaybuf import ReplayBuffer",
            f"  arrays = ReplayBuffer.from_folder({folder!r}, read_only=True).to_dask()",
        ]
    )


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The demo's one optional argument, the folder; ``--help`` and anything else are the
    parser's (a folder named "--help" was written)."""
    parser = argparse.ArgumentParser(
        prog="python -m replaybuf.demo",
        description="Write a small buffer with an image field, sample it, and print what it did and "
        "the commands to look at it next.",
    )
    parser.add_argument(
        "folder",
        nargs="?",
        default=DEFAULT_FOLDER,
        help=f"where the buffer is kept (default {DEFAULT_FOLDER}); a rerun replaces its own earlier buffer "
        "and refuses a folder holding anything else",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from replaybuf.cli import output_never_fails_to_encode

    name = parse_arguments(argv).folder
    try:
        with output_never_fails_to_encode():
            status = _write_and_sample(name)
        sys.stdout.flush()  # here, so that a reader that stopped early is seen below, not at exit
    except KeyboardInterrupt:  # Ctrl-C: a line saying what is left, not a traceback from numpy or zarr
        print(
            f"\nreplaybuf.demo: interrupted; {name!r} keeps the episodes committed before it (one in "
            f"progress is dropped). Run it again to start over: python -m replaybuf.demo {shlex.quote(name)}",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:
        from replaybuf.cli import _discard_stdout, _stdout_reader_gone

        if not _stdout_reader_gone():
            raise
        _discard_stdout()  # `python -m replaybuf.demo | head`: the reader stopped, as the CLI's
        return 141
    return status


def _write_and_sample(name: str) -> int:
    """The demo itself: refuse a folder holding anything else, write, reopen, sample, report."""
    folder = Path(name)
    problem = foreign_content(folder)
    if problem is not None:
        print(
            f"replaybuf.demo: not writing to {name!r}: {problem}\nName another folder: python -m replaybuf.demo FOLDER",
            file=sys.stderr,
        )
        return 2
    try:
        buffer = ReplayBuffer(str(folder), **CONFIG, flush_every_store_step=0)
    except (OSError, BufferLockedError) as e:  # a path under a file, a read-only file system, another writer
        print(
            f"replaybuf.demo: cannot write to {name!r}: {e}\nName another folder: python -m replaybuf.demo FOLDER",
            file=sys.stderr,
        )
        return 2
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    steps = 0
    for episode in range(16):
        with buffer.one_episode(task_id=episode % 4) as final:
            length = int(rng.integers(40, 100))
            for t in range(length):
                buffer.store(
                    frame=rendered_frame(t, episode),
                    state=rng.normal(size=8),
                    action=rng.integers(0, 4, 2),
                    reward=float(rng.random()),
                )
            final["task_id"] = episode % 4
            steps += length
    write_s = time.perf_counter() - start
    buffer.close()
    print(
        f"wrote {buffer.num_episodes} episodes / {steps} steps to {folder} in {write_s:.2f}s "
        f"({steps / write_s:,.0f} steps/s)"
    )

    reopened = ReplayBuffer.from_folder(str(folder), read_only=True)
    print(f"reopened read-only: {len(reopened)} episodes, lengths {reopened.episode_lens[:8].tolist()}...")
    sample = _sample(reopened)
    for line in sample:
        print(line)
    info = reopened.storage.describe()
    frame_chunks = info.get("arrays", {}).get("data/frame", {}).get("chunks")
    print(f"storage: backend={info['backend']}, frame chunks={frame_chunks}")
    reopened.close()
    print(next_steps(name))
    return 0


def _sample(buffer: ReplayBuffer) -> list[str]:
    """Sample timesteps and n-step transitions through the buffer's DataLoaders."""
    lines = []
    if hasattr(buffer, "dataloader"):
        loader = buffer.dataloader(
            batch_size=32, timestep_level=True, shuffle=True, to_named_tuple=("frame", "action", "task_id")
        )
        frame, action, task_id = next(iter(loader))
        lines.append(
            f"timestep batch: frame {tuple(frame.shape)} {frame.dtype}, action {tuple(action.shape)}, "
            f"task_id {tuple(task_id.shape)}"
        )
        loader = buffer.dataloader(
            batch_size=16,
            n_steps=5,
            current_fields=("frame",),
            next_fields=("frame",),
            sequence_fields=("reward",),
            shuffle=True,
        )
        batch = next(iter(loader))
        lines.append("n-step batch: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items()))
    data = buffer.get_all_data(fields=("reward",), meta_fields=("task_id",))
    lines.append(
        f"get_all_data: reward {tuple(data['reward'].shape)}, mean episode return "
        f"{data['reward'].sum(1).mean().item():.2f}"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
