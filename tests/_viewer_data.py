"""Small buffers with recognisable frames for the video, CLI and viewer tests.

Frame t of episode e of the ``front`` field is a flat gray of ``gray_level(e, t)``, so a test
can tell from a decoded pixel which frame a video (or a browser) is showing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from replaybuf import ReplayBuffer

SIZE = 32
STEPS = (20, 19, 18)


def gray_level(episode: int, timestep: int) -> int:
    """The flat gray value of ``front`` frame ``timestep`` of ``episode`` (distinct within an episode)."""
    return 10 + 5 * timestep + 60 * episode


def reward_value(episode: int, timestep: int) -> float:
    return float(np.sin(timestep / 3.0) + episode)


def make_image_buffer(folder: Path | str, steps: tuple[int, ...] = STEPS, **buffer_kwargs) -> ReplayBuffer:
    """Episodes with a channel-last uint8 field, a channel-first float field, a grayscale field and plots."""
    buffer = ReplayBuffer(
        folder,
        max_episodes=len(steps) + 2,
        max_timesteps=max(steps),
        fields={
            "front": ("uint8", (SIZE, SIZE, 3)),
            "wrist": ("float", (3, SIZE, SIZE)),
            "depth": ("float", (SIZE, SIZE)),
            "reward": "float",
            "action": ("float", 4),
            "done": "bool",
        },
        meta_fields={"task_id": "int", "success": "bool"},
        overwrite=True,
        **buffer_kwargs,
    )
    rng = np.random.default_rng(0)
    for episode, length in enumerate(steps):
        t = np.arange(length)
        front = np.empty((length, SIZE, SIZE, 3), np.uint8)
        front[:] = np.array([gray_level(episode, step) for step in t], np.uint8)[:, None, None, None]
        wrist = np.zeros((length, 3, SIZE, SIZE), np.float32)
        wrist[:, 0] = (t / max(length - 1, 1))[:, None, None]
        buffer.store_episode(
            front=front,
            wrist=wrist,
            depth=rng.random((length, SIZE, SIZE)).astype(np.float32),
            reward=np.array([reward_value(episode, step) for step in t], np.float32),
            action=rng.standard_normal((length, 4)).astype(np.float32),
            done=t == length - 1,
            task_id=episode,
            success=episode % 2 == 0,
        )
    buffer.flush()
    return buffer


def make_plot_only_buffer(folder: Path, steps: tuple[int, ...] = (12, 9)) -> ReplayBuffer:
    """A buffer without image fields: only a scalar and a small vector per step."""
    buffer = ReplayBuffer(
        folder,
        max_episodes=len(steps),
        max_timesteps=max(steps),
        fields={"reward": "float", "state": ("float", 3)},
        overwrite=True,
    )
    for length in steps:
        buffer.store_episode(reward=np.linspace(0, 1, length, dtype=np.float32), state=np.ones((length, 3), np.float32))
    buffer.flush()
    return buffer
