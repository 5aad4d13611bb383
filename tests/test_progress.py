"""tqdm progress on convert, verify, get_all_data and stats: shown when asked, silent otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.maintenance import convert, verify

from ._data import fields

FIELDS = fields("obs", "reward")


@pytest.fixture
def buffer(tmp_path) -> ReplayBuffer:
    buffer = ReplayBuffer(str(tmp_path / "src"), max_episodes=8, max_timesteps=10, fields=FIELDS)
    for length in (3, 10, 6, 4):
        buffer.store_episode(obs=np.ones((length, 3)), reward=np.ones(length))
    buffer.flush()
    return buffer


def test_convert_and_verify_progress(buffer, tmp_path, capsys):
    convert(buffer.storage.location, tmp_path / "shown", progress=True)
    err = capsys.readouterr().err
    assert "convert -> zarr: 100%" in err and "4/4" in err and "episode/s" in err
    assert verify(tmp_path / "shown", progress=True) == []
    err = capsys.readouterr().err
    assert "verify: 100%" in err and "3/3" in err  # the episodes shorter than max_timesteps
    convert(buffer.storage.location, tmp_path / "quiet", progress=False)
    assert verify(tmp_path / "quiet", progress=False) == []
    # the default: a bar only on a terminal, and pytest's captured stderr is not one
    convert(buffer.storage.location, tmp_path / "default")
    assert verify(tmp_path / "default") == []
    assert capsys.readouterr().err == ""


def test_dask_reads_progress(buffer, capsys):
    buffer.get_all_data(progress=True)
    err = capsys.readouterr().err
    assert "get_all_data: 100%" in err and "B/s" in err
    buffer.stats(progress=True, exact=True)  # the bar is the dask read's: sketches read no data
    assert "stats: 100%" in capsys.readouterr().err
    buffer.get_all_data(progress=False)
    buffer.stats()
    assert capsys.readouterr().err == ""


def test_progress_argument_is_checked(buffer, tmp_path):
    with pytest.raises(TypeError, match="progress must be True, False or None, got 'yes'"):
        convert(buffer.storage.location, tmp_path / "dst", progress="yes")
    assert not (tmp_path / "dst").exists()
    with pytest.raises(TypeError, match="got 1"):
        verify(buffer.storage.location, progress=1)
