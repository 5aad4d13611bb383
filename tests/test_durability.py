"""Episodes in progress survive a killed writer through the step log; commits are ordered."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from replaybuf import ReplayBuffer

WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from replaybuf import ReplayBuffer
    path, flush, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    buffer = ReplayBuffer(path, 4, 50, fields=dict(x=("float", 3), frame=("uint8", (32, 32, 3))),
                          meta_fields=dict(seed="int"), flush_every_store_step=flush, overwrite=False)
    buffer.store_episode(x=np.ones((5, 3)), frame=np.ones((5, 32, 32, 3), np.uint8), seed=1)
    with buffer.one_episode(seed=2):
        for t in range(steps):
            buffer.store(x=[t, t, t], frame=np.full((32, 32, 3), t, np.uint8))
        os._exit(0)
""")


def run_writer(path, flush, steps):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", WRITER, str(path), str(flush), str(steps)], check=True, env=env)


def create(path, **kwargs):
    return ReplayBuffer(
        str(path),
        4,
        50,
        fields=dict(x=("float", 3), frame=("uint8", (32, 32, 3))),
        meta_fields=dict(seed="int"),
        **kwargs,
    )


@pytest.mark.parametrize("flush, kept", [(1, 7), (3, 6), (0, 0)])
def test_killed_writer_keeps_flushed_steps(tmp_path, flush, kept):
    path = tmp_path / "b"
    create(path).close()
    run_writer(path, flush, 7)

    reader = ReplayBuffer.from_folder(str(path), read_only=True)
    assert reader.num_episodes == 1, "a reader never sees an episode in progress"

    buffer = ReplayBuffer.from_folder(str(path))
    assert buffer.num_episodes == (2 if kept else 1)
    if kept:
        assert buffer.episode_lens[:2].tolist() == [5, kept]
        assert buffer.meta_data["seed"][1] == 2
        np.testing.assert_array_equal(buffer.data["x"][1, :kept, 0], np.arange(kept))
        assert buffer.data["frame"][1, kept - 1, 0, 0, 0] == kept - 1
        assert not buffer.data["x"][1, kept:].any()
    buffer.store_episode(x=np.full((2, 3), 9.0), frame=np.zeros((2, 32, 32, 3), np.uint8), seed=3)
    slot = buffer.num_episodes - 1
    assert buffer.episode_lens[slot] == 2 and buffer.data["x"][slot, :3, 0].tolist() == [9, 9, 0]
    assert buffer.storage.log_names() == []


def test_torn_log_tail_is_dropped(tmp_path):
    path = tmp_path / "b"
    create(path).close()
    run_writer(path, 1, 4)
    log = next(path.rglob("steplog/*/log"))
    log.write_bytes(log.read_bytes()[:-10])
    buffer = ReplayBuffer.from_folder(str(path))
    assert buffer.episode_lens[:2].tolist() == [5, 3]


def test_commit_interrupted_before_counters_rolls_forward(tmp_path):
    path = tmp_path / "b"
    buffer = create(path)
    buffer.store_episode(x=np.ones((3, 3)), frame=np.zeros((3, 32, 32, 3), np.uint8))
    state = buffer.storage.read_blob("replaybuf/state.json")
    buffer.store_episode(x=np.ones((4, 3)), frame=np.zeros((4, 32, 32, 3), np.uint8))
    buffer.storage.write_blob("replaybuf/state.json", state)
    buffer.close()  # the writer stops there, as if killed before its last counter commit

    again = ReplayBuffer.from_folder(str(path))
    assert again.num_episodes == 2 and again.episode_index == 2
    again.store_episode(x=np.ones((2, 3)), frame=np.zeros((2, 32, 32, 3), np.uint8))
    assert again.episode_lens[:3].tolist() == [3, 4, 2]


def test_reused_slot_is_invalidated_before_data_is_written(tmp_path):
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 1, 8, fields=dict(x="float"), circular=True)
    buffer.store_episode(x=np.arange(8.0))
    with buffer.one_episode():
        for _ in range(8):
            buffer.store(x=-1.0)
        reader = ReplayBuffer.from_folder(str(path), read_only=True)
        assert reader.episode_lens[0] in (0, 8)
        if reader.episode_lens[0]:
            assert reader.data["x"][0, :8].tolist() == list(range(8))
    assert ReplayBuffer.from_folder(str(path), read_only=True).data["x"][0, :8].tolist() == [-1] * 8


def test_partial_temp_files_are_cleaned_on_open(tmp_path):
    path = tmp_path / "b"
    with create(path) as writer:
        writer.store_episode(x=np.ones((3, 3)), frame=np.zeros((3, 32, 32, 3), np.uint8))
    stray = path / "data" / "x" / ".abc.partial"
    stray.write_bytes(b"junk")
    ReplayBuffer.from_folder(str(path), read_only=True)
    assert stray.exists(), "read-only opens change nothing"
    ReplayBuffer.from_folder(str(path))
    assert not stray.exists()


LEFT_OPEN_AT_EXIT = textwrap.dedent("""
    import sys
    import numpy as np
    import replaybuf.buffer
    from replaybuf import ReplayBuffer
    buffer = ReplayBuffer(sys.argv[1], 4, 5, fields=dict(x="int"), overwrite=True)
    buffer.store_episode(x=np.arange(3))
    # what interpreter exit does to a module's globals before a buffer it holds is freed
    for name in ("contextlib", "collecting", "sys"):
        setattr(replaybuf.buffer, name, None)
    del buffer
""")


def test_a_buffer_freed_after_its_modules_globals_at_exit_closes_quietly(tmp_path):
    """A buffer left open in a module's globals is freed at exit, possibly after replaybuf's own
    module globals were set to None: ``__del__`` printed "Exception ignored in ... 'NoneType'
    object has no attribute 'suppress'" and gave nothing back."""
    path = tmp_path / "left-open"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run([sys.executable, "-c", LEFT_OPEN_AT_EXIT, str(path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "Exception ignored" not in run.stderr, run.stderr
    with ReplayBuffer.from_folder(str(path), read_only=True) as reopened:
        assert reopened.num_episodes == 1 and reopened.data["x"][0, :3].tolist() == [0, 1, 2]
