"""Hostile cases for packed (state-only) zarr buffers: damaged files of the packed layout, killed
writers and readers racing reuse of circular slots. Every committed episode reads back exactly or
raises an error naming the file and slot, and ``verify --repair`` keeps what can be kept."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replaybuf import ChecksumEntryError, ReplayBuffer, verify

from ._workloads import check_episode, episode

MAX_TIMESTEPS = 24  # as _workloads: episode(uid) fits
FIELDS = {"obs": ("float32", 3), "step": "int32"}  # no chunks/compressor spec: packed
SLOTS = 8
CHECKSUMS = os.path.join("replaybuf", "checksums")


def make(path, count: int = SLOTS) -> None:
    buffer = ReplayBuffer(
        path, max_episodes=SLOTS, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields={"uid": "int"}
    )
    for uid in range(count):
        data = episode(uid)
        buffer.store_episode(obs=data["obs"], step=data["step"], uid=uid)
    buffer.close()


def check_all(path) -> list[int]:
    """The uids of the committed episodes, each checked whole against the episode it names."""
    reader = ReplayBuffer.from_folder(path, read_only=True)
    uids = []
    for slot in reader.valid_episodes().tolist():
        uid = int(reader.meta_data["uid"][slot])
        check_episode(uid, int(reader.episode_lens[slot]), {n: np.asarray(reader.data[n][slot]) for n in FIELDS})
        uids.append(uid)
    return sorted(uids)


def truncate_half(file: str) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


@pytest.mark.parametrize("damage", [os.remove, truncate_half], ids=["missing", "truncated"])
def test_lost_checksum_entries_are_resealed_not_the_episodes_dropped(tmp_path, damage):
    """The per-episode checksums file missing or cut short: reads of the episodes it no longer
    covers raise ChecksumEntryError naming the file, field and slot (the data is not blamed),
    and ``verify --repair`` re-seals them from the data as stored, dropping none (it dropped
    all 8 episodes of intact data)."""
    make(tmp_path)
    damage(str(tmp_path / CHECKSUMS))
    reader = ReplayBuffer.from_folder(tmp_path, read_only=True)
    with pytest.raises(
        ChecksumEntryError, match=r"data/obs: slot 7: its checksum entry in .*checksums is damaged"
    ) as e:
        np.asarray(reader.data["obs"][7])
    assert e.value.slot == 7 and "missing" in str(e.value)
    report = verify(tmp_path, repair=True)
    assert any("re-sealed the damaged checksum entries of data/obs" in line for line in report), report
    assert not any("dropped" in line for line in report), report
    assert check_all(tmp_path) == list(range(SLOTS))
    assert verify(tmp_path) == []
