"""Damaged bookkeeping never costs intact episodes: a zarr buffer's per-episode checksums file
holding more than its config gives it is read no further than that, reported by ``verify`` and
cut back by ``verify --repair``, dropping nothing."""

from __future__ import annotations

import os

import numpy as np

from replaybuf import ReplayBuffer, verify

from .test_packed_hostile import CHECKSUMS, FIELDS, SLOTS, check_all, make


def test_junk_appended_to_the_checksums_is_cut_not_the_episodes_dropped(tmp_path):
    """Junk appended to ``replaybuf/checksums`` made every read of many slots raise "hold more
    than N bytes", and ``verify --repair`` dropped all 8 intact episodes: the rows the config
    gives are read as they are, verify names the file and its excess, repair removes it."""
    make(tmp_path)
    sums = str(tmp_path / CHECKSUMS)
    expected = os.path.getsize(sums)
    assert expected == 8 * len(FIELDS) * SLOTS
    with open(sums, "ab") as f:
        f.write(b"junk" * 10)
    reader = ReplayBuffer.from_folder(tmp_path, read_only=True)
    values = reader.get_all_data()  # every slot at once: the table read whole
    assert values["episode_lens"].tolist() == [int(n) for n in reader.episode_lens]
    reader.close()
    assert check_all(tmp_path) == list(range(SLOTS))
    excess = (
        f"{sums}: the checksums of packed fields hold {expected + 40} bytes, more than the {expected} bytes the "
        "config gives them; the 40 bytes past them are not read"
    )
    assert verify(tmp_path) == [excess]
    assert verify(tmp_path, repair=True) == [
        excess,
        f"repaired: cut {sums} to the {expected} bytes the config gives it (removed 40)",
    ]
    assert os.path.getsize(sums) == expected
    assert verify(tmp_path) == []
    assert check_all(tmp_path) == list(range(SLOTS))
    assert np.asarray(ReplayBuffer.from_folder(tmp_path, read_only=True).valid_episodes()).tolist() == list(
        range(SLOTS)
    )
