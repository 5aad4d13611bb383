"""Hostile parallel collection and training-side writes: actors killed while creating their
shards, readers listing a root meanwhile, runaway priorities, DDP arguments that would be lost."""

from __future__ import annotations

import multiprocessing
import os
import shutil

import numpy as np
import pytest

from replaybuf import BufferNotFoundError, ConcatReplayBuffer, ReplayBuffer
from replaybuf.actors import open_shard, shard_location
from replaybuf.storage import UnfinishedCreateError

from ._workloads import buffer_kwargs, write_episode
from .test_crash import _create_killed_after_writes

FORK = multiprocessing.get_context("fork")

SHARD = dict(max_episodes=4, max_timesteps=6, fields=dict(x="float"))


def _create_killed_after_its_first_write(root, index: int) -> None:
    """A shard as an actor killed inside its create leaves it: the root ``zarr.json`` (the
    create's first write) and nothing else."""
    scratch = root / "scratch"
    ReplayBuffer(str(scratch), **SHARD).close()
    location = shard_location(root, index)
    os.makedirs(location)
    shutil.copy(scratch / "zarr.json", location)
    shutil.rmtree(scratch)


def test_a_reader_of_the_root_leaves_out_a_shard_whose_create_never_finished(tmp_path):
    with open_shard(tmp_path, 0, **SHARD) as shard:
        shard.store_episode(x=np.arange(3.0))
    _create_killed_after_its_first_write(tmp_path, 1)
    with pytest.raises(UnfinishedCreateError, match="actor-001.*never fully created"):
        ReplayBuffer.from_folder(shard_location(tmp_path, 1), read_only=True)

    together = ConcatReplayBuffer(str(tmp_path))
    assert together.get_all_data()["x"][:, :3].tolist() == [[0.0, 1.0, 2.0]]


@pytest.mark.parametrize("writes", [1, 3])
def test_an_actor_killed_while_creating_its_shard_restarts(tmp_path, writes):
    root = tmp_path / "root"
    location = shard_location(root, 2)
    child = FORK.Process(target=_create_killed_after_writes, args=(location, writes))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    with pytest.raises(BufferNotFoundError, match="no shard under .* holds a finished buffer"):
        ConcatReplayBuffer(str(root))
    kwargs = buffer_kwargs(3, circular=False)
    with open_shard(root, 2, **kwargs) as shard:  # the default overwrite=False
        write_episode(shard, 5, "whole")
    together = ConcatReplayBuffer(str(root))
    assert together.num_episodes == 1 and together.meta_data["uid"][0] == 5


def test_a_shard_that_lost_an_array_is_damage_not_an_unfinished_create(tmp_path):
    with open_shard(tmp_path, 0, **SHARD) as shard:
        shard.store_episode(x=np.arange(3.0))
    location = tmp_path / "actor-000"
    (location / "data" / "x" / "zarr.json").unlink()
    (location / "replaybuf" / "state.json").unlink()
    chunks = sorted(p.name for p in (location / "data" / "x").rglob("*"))
    for open_it in (
        lambda: open_shard(tmp_path, 0, **SHARD),
        lambda: ConcatReplayBuffer(str(tmp_path)),
    ):
        with pytest.raises(BufferNotFoundError, match="missing the array 'data/x'") as raised:
            open_it()
        assert not isinstance(raised.value, UnfinishedCreateError)
    assert chunks and sorted(p.name for p in (location / "data" / "x").rglob("*")) == chunks, "nothing erased"
