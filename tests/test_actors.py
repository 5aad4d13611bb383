"""Parallel writers: one shard per actor under a root, discovered again by readers."""

from __future__ import annotations

import multiprocessing
import os
import uuid

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.actors import discover_shards, open_shard, shard_location
from replaybuf.consistency import read_episodes_consistent

from ._workloads import buffer_kwargs, check_episode, write_episode, writer_loop

pytest_plugins = ["tests._servers"]

FORK = multiprocessing.get_context("fork")


def test_shard_locations(tmp_path):
    assert shard_location(tmp_path, 7) == os.path.join(str(tmp_path), "actor-007")
    assert shard_location("s3://bucket/run/", 12) == "s3://bucket/run/actor-012"
    assert shard_location("memory://r", 1234) == "memory://r/actor-1234"
    for bad in (-1, 1.0, "3", True):
        with pytest.raises(ValueError, match="shard index must be an int >= 0"):
            shard_location(tmp_path, bad)


def test_open_shard_creates_then_reopens(tmp_path):
    kwargs = buffer_kwargs(4, circular=False)
    with open_shard(tmp_path, 2, **kwargs) as shard:
        shard.store_episode(obs=np.ones((2, 3)), uid=1)
    reopened = open_shard(tmp_path, 2, **kwargs)
    assert len(reopened) == 1, "a shard is reopened, not erased, by default"
    assert str(reopened.folder) == str(tmp_path / "actor-002")
    reopened.close()
    with pytest.raises(ValueError, match="different config"):
        open_shard(tmp_path, 2, **buffer_kwargs(5, circular=False))


@pytest.mark.parametrize("root", ["local", "memory"])
def test_discover_skips_foreign_and_unfinished_entries(tmp_path, root):
    base = str(tmp_path) if root == "local" else f"memory://discover-{os.getpid()}"
    kwargs = buffer_kwargs(2, circular=False)
    for index in (10, 0, 2):
        open_shard(base, index, **kwargs).close()
    if root == "local":
        (tmp_path / "actor-003").mkdir()  # an actor that has not created its buffer yet
        (tmp_path / "notes.txt").write_text("x")
        (tmp_path / "actor-x").mkdir()
    assert discover_shards(base) == [shard_location(base, i) for i in (0, 2, 10)]


def test_shards_on_s3(s3_server):
    root = s3_server.url(f"shards/{uuid.uuid4().hex[:12]}")
    options = s3_server.storage_options
    kwargs = buffer_kwargs(3, circular=False)
    for index in (1, 0):
        with open_shard(root, index, **kwargs, storage_options=options) as shard:
            write_episode(shard, 10 + index, "whole")
    ReplayBuffer(f"{root}/notes", **kwargs, storage_options=options).close()  # not a shard name
    found = discover_shards(root, storage_options=options)
    assert found == [f"{root}/actor-000", f"{root}/actor-001"]
    uids = [ReplayBuffer.from_folder(url, read_only=True, storage_options=options).meta_data["uid"][0] for url in found]
    assert uids == [10, 11]
    assert discover_shards(s3_server.url("shards/absent"), storage_options=options) == []


def test_discover_empty_or_missing_root(tmp_path):
    assert discover_shards(tmp_path) == []
    assert discover_shards(tmp_path / "absent") == []


@pytest.mark.slow
def test_four_writer_processes_lose_and_duplicate_nothing(tmp_path):
    kwargs = buffer_kwargs(40, circular=False, flush_every_store_step=1)
    per_actor = 12
    for index in range(4):  # each actor's shard exists before any writes (as a launcher would do)
        open_shard(tmp_path, index, **kwargs).close()
    writers = [
        FORK.Process(
            target=writer_loop,
            args=(
                shard_location(tmp_path, index),
                list(range(index * 1000, index * 1000 + per_actor)),
                "mixed",
                kwargs,
            ),
        )
        for index in range(4)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [w.exitcode for w in writers] == [0, 0, 0, 0]

    seen = []
    for location in discover_shards(tmp_path):
        shard = ReplayBuffer.from_folder(location, read_only=True)
        got = read_episodes_consistent(shard, shard.valid_episodes())
        assert len(got.dropped) == 0
        for row, uid in enumerate(got.meta["uid"].tolist()):
            check_episode(uid, int(got.lens[row]), {n: v[row] for n, v in got.data.items()})
            assert got.meta["score"][row] == uid / 4
            seen.append(uid)
    expected = [index * 1000 + k for index in range(4) for k in range(per_actor)]
    assert sorted(seen) == expected


def test_buffer_shard_and_concat_of_a_shard_root(tmp_path):
    from replaybuf import ConcatReplayBuffer

    for index in range(3):
        shard = ReplayBuffer.shard(
            str(tmp_path / "root"), index, max_episodes=2, max_timesteps=4, fields=dict(x="float")
        )
        shard.store_episode(x=np.full(index + 1, float(index)))
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["actor-000", "actor-001", "actor-002"]
    together = ConcatReplayBuffer(str(tmp_path / "root"))
    assert together.num_episodes == 3
    assert together.get_all_data()["x"].tolist() == [[0, 0, 0], [1, 1, 0], [2, 2, 2]]
    with pytest.raises(FileNotFoundError, match="no replaybuf buffer"):
        ConcatReplayBuffer(str(tmp_path / "empty"))


def test_a_root_of_shards_opened_as_one_buffer_names_its_shards(tmp_path, capsys):
    """`replaybuf view root` (info, verify, export, from_folder) of the layout the README
    documents for parallel actors said only "no replaybuf buffer found"."""
    from replaybuf.cli import main

    for i in range(2):
        with ReplayBuffer.shard(tmp_path, i, max_episodes=2, max_timesteps=2, fields={"x": "float"}) as shard:
            shard.store_episode(x=np.zeros(2))
    hint = rf"it holds the shards \['actor-000', 'actor-001'\].*ConcatReplayBuffer\({str(tmp_path)!r}\)"
    with pytest.raises(FileNotFoundError, match=hint):
        ReplayBuffer.from_folder(tmp_path)
    for command in ("info", "view", "inspect"):
        with pytest.raises(SystemExit):
            main([command, str(tmp_path), "--no-browser"] if command == "view" else [command, str(tmp_path)])
        assert "it holds the shards ['actor-000', 'actor-001']" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["actor-000", "actor-001"]
