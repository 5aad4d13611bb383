"""The shared benchmark workload: rendered-like 84x84x3 frames plus small vectors.

Every benchmark in this folder stores and samples the same data, so their figures compare.
Frames look like a simple simulator's render (smooth background gradient, a few moving
filled sprites with hard edges and outlines, sparse sensor noise), not white noise, so
compression ratios are realistic. Everything is deterministic from ``seed``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata

import numpy as np

FRAME_SHAPE = (84, 84, 3)

# Field specs in the seed's (and replaybuf's) format.
FIELDS = {
    "frame": ("uint8", FRAME_SHAPE),
    "state": ("float", 32),
    "action": ("float", 6),
    "reward": "float",
    "done": "bool",
}
FIELD_NAMES = tuple(FIELDS)

DEFAULT_EPISODES = 200
DEFAULT_STEPS = 250
QUICK_EPISODES = 16
QUICK_STEPS = 100


@dataclass(frozen=True)
class WorkloadSize:
    """How many episodes of how many steps a run uses."""

    episodes: int
    steps: int
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.episodes * self.steps


def _sprite_masks(rng: np.random.Generator, steps: int, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (filled mask, outline mask), each (steps, 84, 84) bool, for ``count`` bouncing sprites."""
    height, width = FRAME_SHAPE[:2]
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    time = np.arange(steps, dtype=np.float32)
    for _ in range(count):
        size = rng.uniform(4, 12)
        start = rng.uniform(size, [height - size, width - size])
        velocity = rng.uniform(-1.5, 1.5, size=2)
        span = np.array([height - 2 * size, width - 2 * size])
        # Bounce inside the frame: a triangle wave of the unbounded position.
        raw = (start - size)[None] + velocity[None] * time[:, None]
        folded = np.abs((raw % (2 * span)) - span)
        center = (span - folded + size).astype(np.float32)
        cy = center[:, 0, None, None]
        cx = center[:, 1, None, None]
        if rng.random() < 0.5:
            distance = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        else:
            distance = np.maximum(np.abs(yy - cy), np.abs(xx - cx))
        yield distance <= size, (distance > size - 1.5) & (distance <= size)


def render_frames(rng: np.random.Generator, steps: int) -> np.ndarray:
    """Render ``steps`` frames (steps, 84, 84, 3) uint8 of one episode."""
    height, width, channels = FRAME_SHAPE
    corner_colors = rng.uniform(30, 220, size=(2, channels)).astype(np.float32)
    blend = (np.linspace(0, 1, height)[:, None] * 0.7 + np.linspace(0, 1, width)[None, :] * 0.3).astype(np.float32)
    background = corner_colors[0] + blend[..., None] * (corner_colors[1] - corner_colors[0])
    # A static floor band with a checker texture, like a simple arena.
    floor = np.zeros((height, width), dtype=bool)
    floor[int(height * 0.75) :] = True
    checker = ((np.arange(height)[:, None] // 6 + np.arange(width)[None, :] // 6) % 2).astype(bool)
    background[floor & checker] *= 0.8
    # Sprites become a label image per frame, then one palette lookup paints them all.
    count = int(rng.integers(3, 6))
    palette = np.zeros((2 * count + 1, channels), dtype=np.uint8)
    labels = np.zeros((steps, height, width), dtype=np.uint8)
    for index, (filled, outline) in enumerate(_sprite_masks(rng, steps, count)):
        color = rng.integers(0, 256, size=channels, dtype=np.uint8)
        palette[2 * index + 1], palette[2 * index + 2] = color, color // 3
        labels[filled] = 2 * index + 1
        labels[outline] = 2 * index + 2
    frames = np.where((labels > 0)[..., None], palette[labels], np.round(background).astype(np.uint8))
    # Sparse sensor noise: ~5% of pixels off by -2..+2 levels (one uint8 draw gives both).
    draw = rng.integers(0, 256, size=frames.shape, dtype=np.uint8)
    delta = np.where(draw < 13, (draw % 5).astype(np.int16) - 2, 0)
    frames = np.clip(frames + delta, 0, 255).astype(np.uint8)
    return frames


def make_episode(size: WorkloadSize, episode: int, frames: bool = True) -> dict[str, np.ndarray]:
    """One episode of the workload as numpy arrays with a leading time axis.

    ``frames=False`` skips rendering (the vectors are identical either way), for benchmarks
    that only need the small fields.
    """
    rng = np.random.default_rng([size.seed, episode])
    steps = size.steps
    time = np.arange(steps, dtype=np.float32)[:, None]
    frequencies = rng.uniform(0.01, 0.2, size=(1, 32)).astype(np.float32)
    phases = rng.uniform(0, 2 * np.pi, size=(1, 32)).astype(np.float32)
    state = np.sin(time * frequencies + phases) + 0.01 * rng.standard_normal((steps, 32), dtype=np.float32)
    action = np.tanh(np.cumsum(rng.standard_normal((steps, 6), dtype=np.float32) * 0.3, axis=0))
    reward = np.where(rng.random(steps) < 0.1, rng.uniform(0, 1, steps), 0.0).astype(np.float32)
    done = np.zeros(steps, dtype=bool)
    done[-1] = True
    episode_data = {
        "state": state.astype(np.float32),
        "action": action.astype(np.float32),
        "reward": reward,
        "done": done,
    }
    if frames:
        episode_data = {"frame": render_frames(rng, steps), **episode_data}
    return episode_data


def add_size_arguments(
    parser: argparse.ArgumentParser, episodes: int = DEFAULT_EPISODES, steps: int = DEFAULT_STEPS
) -> None:
    """The size flags every benchmark script shares."""
    parser.add_argument("--episodes", type=int, default=None, help=f"episodes in the workload (default {episodes})")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per episode (default {steps})")
    parser.add_argument(
        "--quick", action="store_true", help=f"small run: {QUICK_EPISODES} episodes x {QUICK_STEPS} steps"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.set_defaults(default_episodes=episodes, default_steps=steps)


def size_from_arguments(arguments: argparse.Namespace) -> WorkloadSize:
    """Resolve --episodes/--steps/--quick into a WorkloadSize (explicit flags win over --quick)."""
    episodes = QUICK_EPISODES if arguments.quick else arguments.default_episodes
    steps = QUICK_STEPS if arguments.quick else arguments.default_steps
    return WorkloadSize(
        episodes=arguments.episodes if arguments.episodes is not None else episodes,
        steps=arguments.steps if arguments.steps is not None else steps,
        seed=arguments.seed,
    )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def print_header(title: str, size: WorkloadSize | None = None) -> None:
    """Print the command, the machine and the package versions, so a result can be reproduced."""
    print(f"# {title}\n")
    print("command: `python " + " ".join(shlex.quote(part) for part in sys.argv) + "`")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}".rstrip()
        + f", {os.cpu_count()} cores visible, {len(os.sched_getaffinity(0))} usable, load {os.getloadavg()[0]:.2f}"
    )
    packages = ("numpy", "torch", "zarr", "numcodecs", "imagecodecs", "memmap-replay-buffer", "torchrl", "tensordict")
    print(f"python {platform.python_version()}; " + ", ".join(f"{name} {_version(name)}" for name in packages))
    if size is not None:
        print(
            f"workload: {size.episodes} episodes x {size.steps} steps = {size.total_steps} steps, "
            f"frame {FRAME_SHAPE} uint8 + state f32[32] + action f32[6] + reward f32 + done bool, seed {size.seed}"
        )
    print()


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """Render rows as a GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_rate(value: float) -> str:
    """A throughput with thousands separators, or '-' when not measured."""
    return "-" if value is None or value != value else f"{value:,.0f}"
