"""Deterministic episodes keyed by a meta id, writer loops for child processes, and content
checks, shared by the multi-process, crash and shard tests.

Episode ``uid`` has a length and every value derived from ``uid`` alone, so a reader can verify
any episode it sees without talking to the writer.
"""

from __future__ import annotations

import time

import numpy as np

MAX_TIMESTEPS = 24
PACED_S = 0.3  # a paced writer's pause after each episode (``writer_loop``)
# short time chunks so one episode spans several chunk objects and can tear between them
FIELDS = {
    "obs": {"dtype": "float32", "shape": [3], "chunks": 4},
    "step": {"dtype": "int32", "shape": [], "chunks": 4},
    "img": {"dtype": "uint8", "shape": [4, 4], "chunks": 2},
    "frame": {"dtype": "uint8", "shape": [32, 32, 4]},  # image-sized: one shard per episode
}
META_FIELDS = {"uid": "int", "score": "float"}


def episode_length(uid: int, max_timesteps: int = MAX_TIMESTEPS) -> int:
    return 1 + (uid * 7919 + 3) % max_timesteps


def episode(uid: int, max_timesteps: int = MAX_TIMESTEPS) -> dict[str, np.ndarray]:
    """The full data of episode ``uid``: (T, *shape) per field."""
    t = np.arange(episode_length(uid, max_timesteps))
    return {
        "obs": (uid * 1000 + t[:, None] + np.array([0.0, 0.25, 0.5])).astype(np.float32),
        "step": (uid * 100 + t).astype(np.int32),
        "img": ((uid * 31 + t[:, None, None] + np.arange(16).reshape(4, 4)) % 256).astype(np.uint8),
        "frame": ((uid * 17 + t[:, None, None, None] + np.arange(4096).reshape(32, 32, 4) // 64) % 256).astype(
            np.uint8
        ),
    }


def score(uid: int) -> float:
    return float(uid) / 4


def buffer_kwargs(max_episodes: int, circular: bool, flush_every_store_step: int = 1) -> dict:
    return dict(
        max_episodes=max_episodes,
        max_timesteps=MAX_TIMESTEPS,
        fields=FIELDS,
        meta_fields=META_FIELDS,
        circular=circular,
        flush_every_store_step=flush_every_store_step,
    )


def write_episode(buffer, uid: int, how: str) -> None:
    """Store episode ``uid`` step by step (``'steps'``) or whole (``'whole'``)."""
    data = episode(uid, buffer.max_timesteps)
    if how == "whole":
        buffer.store_episode(**data, uid=uid, score=score(uid))
        return
    with buffer.one_episode(uid=uid) as final:
        for t in range(len(data["step"])):
            buffer.store(**{name: values[t] for name, values in data.items()})
        final["score"] = score(uid)


def check_episode(
    uid: int, length: int, rows: dict[str, np.ndarray], full: bool = True, zeros_after: bool = True
) -> None:
    """Assert that ``rows`` (each (T, *shape), T >= length) are episode ``uid`` cut at ``length``
    (and zero beyond when ``zeros_after``); ``full`` also requires the whole episode."""
    expected = episode(uid)
    whole = len(expected["step"])
    assert 0 < length <= whole, f"uid {uid}: stored length {length}, episode has {whole}"
    if full:
        assert length == whole, f"uid {uid}: stored length {length}, expected {whole}"
    for name, values in rows.items():
        np.testing.assert_array_equal(values[:length], expected[name][:length], err_msg=f"uid {uid} field {name}")
        assert not zeros_after or not np.any(values[length:]), (
            f"uid {uid} field {name}: non-zero data past the length {length}"
        )


def writer_loop(
    location: str,
    uids: list[int],
    how: str,
    kwargs: dict,
    progress_path: str | None = None,
    span_bytes: int | None = None,
    storage_options: dict | None = None,
    stop=None,
    pace=None,
) -> None:
    """Child-process body: write ``uids`` into the buffer at ``location`` (reopened, not erased),
    appending each committed uid to ``progress_path``, until ``stop`` (an Event) is set; while
    ``pace`` (an Event) is set, it pauses ``PACED_S`` after each episode (still writing, but
    letting a slow reader finish a read before every slot it read is reused).
    ``how`` is 'steps', 'whole' or 'mixed'."""
    from replaybuf import ReplayBuffer, staging

    if span_bytes is not None:
        staging.WRITE_SPAN_BYTES = span_bytes  # small spans: slab writes mid-episode
    buffer = ReplayBuffer(location, **kwargs, overwrite=False, storage_options=storage_options)
    progress = open(progress_path, "a") if progress_path else None
    for n, uid in enumerate(uids):
        if stop is not None and stop.is_set():
            break
        write_episode(buffer, uid, how if how != "mixed" else ("steps", "whole")[n % 2])
        if progress:
            progress.write(f"{uid}\n")
            progress.flush()
        if pace is not None and pace.is_set():
            time.sleep(PACED_S)
    buffer.close()
    if progress:
        progress.close()
