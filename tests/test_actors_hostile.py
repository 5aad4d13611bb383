"""Hostile parallel collection and training-side writes: actors killed while creating their
shards, readers listing a root meanwhile, runaway priorities, DDP arguments that would be lost."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import uuid

import numpy as np
import pytest

from replaybuf import BufferDamagedError, BufferNotFoundError, ConcatReplayBuffer, ReplayBuffer, UnfinishedCreateError
from replaybuf.actors import open_shard, shard_location

from ._workloads import buffer_kwargs, write_episode
from .test_crash import _create_killed_after_writes

FORK = multiprocessing.get_context("fork")

pytest_plugins = ["tests._servers"]

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
    for without_config in (dict(), dict(read_only=True)):  # nothing to create it again from
        with pytest.raises(UnfinishedCreateError, match="never fully created"):
            open_shard(root, 2, **without_config)
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


@pytest.mark.parametrize("garbage", [b"{garbage", b"\x00\x00\x00\x00", b""])
def test_a_shard_whose_root_document_is_garbage_is_damage_not_left_out(tmp_path, garbage):
    """A zarr shard holding episodes whose root ``zarr.json`` no longer parses read as "no
    buffer here": ``ConcatReplayBuffer(root)`` left it out silently and returned the other
    shards' episodes only (a memmap or hdf5 shard's garbage config is refused)."""
    for index in range(3):
        with open_shard(tmp_path, index, **SHARD) as shard:
            shard.store_episode(x=np.full(3, float(index)))
    (tmp_path / "actor-001" / "zarr.json").write_bytes(garbage)
    with pytest.raises(BufferDamagedError, match="zarr.json in .*actor-001: not valid JSON"):
        ConcatReplayBuffer(str(tmp_path))


def _prioritized_loader(buffer, **kwargs):
    return buffer.dataloader(
        batch_size=64, timestep_level=True, sampler="prioritized", priority_field="priority", seed=0, **kwargs
    )


@pytest.mark.parametrize(("dtype", "huge", "alpha"), [("float64", 1e308, 1.0), ("float32", 3e38, 12.0)])
def test_huge_finite_priorities_draw_by_their_ratios(tmp_path, dtype, huge, alpha):
    """Priorities whose powers or sum overflow float64 (1e308 twice; 3e38 ** 12) were accepted
    and then gave every weight NaN and every draw the last sample."""
    buffer = ReplayBuffer(
        str(tmp_path / "b"), max_episodes=2, max_timesteps=4, fields=dict(x="float", priority=(dtype, (), 1.0))
    )
    for _ in range(2):
        buffer.store_episode(x=np.zeros(4), priority=np.ones(4))
    loader = _prioritized_loader(buffer, alpha=alpha, beta=0.4)
    pairs = np.array([(e, t) for e in range(2) for t in range(4)])
    priorities = np.full(8, huge)
    priorities[0] = huge / 2
    assert buffer.update_priorities(pairs, priorities) == 8

    sampler = loader.batch_sampler
    expected = np.power(priorities / huge, alpha)
    np.testing.assert_allclose(sampler.probabilities(), expected / expected.sum())
    drawn = np.concatenate([batch["_indices"].numpy() for batch in loader])
    weights = np.concatenate([batch["_weights"].numpy() for batch in loader])
    assert np.isfinite(weights).all() and (weights > 0).all() and weights.max() <= 1.0
    assert len(np.unique(drawn[:, 0] * 4 + drawn[:, 1])) > 4, "draws spread over the samples"


@pytest.mark.parametrize("given", [dict(rank=1, world_size=2), dict(world_size=2), dict(seed=3)])
def test_ddp_arguments_beside_a_custom_sampler_are_refused_not_ignored(tmp_path, given):
    """Every rank read all of a custom sampler's positions: rank and world_size were dropped."""
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=4, max_timesteps=3, fields=dict(x="float"))
    for value in range(3):
        buffer.store_episode(x=np.full(2, float(value)))
    with pytest.raises(ValueError, match=f"{next(iter(given))}=.*cannot be combined with a custom sampler"):
        buffer.dataloader(batch_size=1, sampler=[0, 1, 2], **given)
    plain = buffer.dataloader(batch_size=1, sampler=[2, 0])
    assert [batch["x"][0, 0].item() for batch in plain] == [2.0, 0.0]


@pytest.mark.parametrize("record", ["header", "meta"])
def test_a_step_log_of_json_nested_too_deep_is_damage_not_a_crash(tmp_path, record):
    """A header or meta record (checksum valid) of JSON nested 200,000 deep raised RecursionError
    from every writable open: the buffer could not be opened for writing at all."""
    from replaybuf.staging import HEADER, META, StepLog

    location = tmp_path / "b"
    kwargs = dict(max_episodes=3, max_timesteps=4, fields=dict(x="float"), meta_fields=dict(score="float"))
    with ReplayBuffer(str(location), **kwargs) as buffer:
        buffer.store_episode(x=np.ones(3), score=1.0)
    deep = b"[" * 200_000 + b"]" * 200_000
    header = {"slots": [1], "generation_base": 1, "fields": ["x"], "meta": {}}
    log = (
        StepLog.record(
            HEADER, b'{"slots": [1], "generation_base": 1, "fields": ["x"], "meta": {"score": ' + deep + b"}}"
        )
        if record == "header"
        else StepLog.record(HEADER, json.dumps(header).encode()) + StepLog.record(META, b'{"score": ' + deep + b"}")
    )
    (location / "replaybuf" / "steplog" / "episode").mkdir(parents=True, exist_ok=True)
    (location / "replaybuf" / "steplog" / "episode" / "log").write_bytes(log)
    with pytest.warns(UserWarning, match="step log .* is damaged .*recursion.* copied to"):
        reopened = ReplayBuffer(str(location), **kwargs, overwrite=False)
    assert reopened.episode_lens.tolist() == [3, 0, 0]
    assert reopened.meta_data["score"][0] == 1.0
    reopened.close()
    assert list((location / "replaybuf").glob("steplog-damaged-*")), "the damaged log is kept aside"


def test_a_collector_refuses_complex_tensors_when_given_not_at_store(tmp_path):
    """Complex torch tensors were taken by append/extend (numpy ones were refused), so the
    rollout failed only at store."""
    import torch

    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=4, max_timesteps=3, fields=dict(x="float", a="int"))
    collector = buffer.create_collector(2)
    collector.append(x=torch.tensor([1.0, 2.0]), a=torch.tensor([1, 2]))
    calls = [
        lambda: collector.append(x=torch.tensor([1 + 2j, 3 + 0j]), a=torch.tensor([1, 2])),
        lambda: collector.append(x=[torch.tensor(1 + 1j), torch.tensor(2.0)], a=[1, 2]),
        lambda: collector.extend(x=torch.zeros(1, 2, dtype=torch.complex64), a=torch.zeros(1, 2, dtype=torch.int64)),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="field 'x': got a tensor of dtype torch.complex"):
            call()
    assert len(collector) == 1, "a refused call changes nothing"
    collector.store()
    assert buffer.episode_lens.tolist()[:2] == [1, 1]


@pytest.mark.parametrize("sampler", [None, "prioritized"])
def test_world_size_without_rank_outside_torch_distributed_is_refused(tmp_path, sampler):
    """Every process took rank 0 and read the same samples as every other."""
    buffer = ReplayBuffer(
        str(tmp_path / "b"), max_episodes=4, max_timesteps=3, fields=dict(x="float", priority=("float", (), 1.0))
    )
    for value in range(4):
        buffer.store_episode(x=np.full(2, float(value)))
    kwargs = dict(batch_size=1, timestep_level=True, sampler=sampler, seed=0, return_indices=True)
    with pytest.raises(ValueError, match=r"world_size=2 given without rank.*pass each process its own rank"):
        buffer.dataloader(**kwargs, world_size=2)
    seen = [
        {
            (int(e), int(t))
            for batch in buffer.dataloader(**kwargs, rank=rank, world_size=2)
            for e, t in batch["_indices"]
        }
        for rank in (0, 1)
    ]
    if sampler is None:
        assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 8, "ranks read disjoint halves"


def _collector_killed_in_store(location: str, kwargs: dict, shape: tuple, kill_at: int) -> None:
    """Child: an actor storing a 2-group rollout of 8 steps, SIGKILLed at its ``kill_at``-th
    ``store_batch`` (steps before it written: to the step log, and a full span to the store)."""
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    collector = buffer.create_collector(2)
    for t in range(8):
        collector.append(x=np.full((2, *shape), float(t + 1), np.float32))
    real, calls = buffer.store_batch, []

    def store_batch(**data):
        calls.append(None)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(**data)

    buffer.store_batch = store_batch
    collector.store(score=1.0)


@pytest.mark.parametrize("shape", [(), (64, 1024)], ids=["scalar", "span-written"])
def test_an_actor_killed_inside_collector_store_leaves_no_cut_episode(tmp_path, shape):
    """A kill after 6 of 8 steps of collector.store() left both episodes committed at 5 steps
    (replayed from the step log): episodes the caller never got stored."""
    location = str(tmp_path / "shard")
    kwargs = dict(max_episodes=6, max_timesteps=8, fields=dict(x=("float32", shape)), meta_fields=dict(score="float"))
    with ReplayBuffer(location, **kwargs) as buffer:
        buffer.store_episode(x=np.full((3, *shape), 9.0, np.float32), score=2.0)
    child = FORK.Process(target=_collector_killed_in_store, args=(location, kwargs, shape, 6))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    reopened = ReplayBuffer(location, **kwargs, overwrite=False)
    assert reopened.episode_lens.tolist() == [3, 0, 0, 0, 0, 0]
    assert (np.asarray(reopened.data["x"][0, :3]) == 9.0).all() and reopened.meta_data["score"][0] == 2.0
    assert not np.asarray(reopened.data["x"][1:3]).any(), "rows written before the kill are cleared"
    collector = reopened.create_collector(2)
    collector.append(x=np.ones((2, *shape), np.float32))
    collector.store(score=3.0)
    assert reopened.episode_lens.tolist()[:3] == [3, 1, 1]


def test_a_shard_whose_overwrite_was_killed_is_left_out_then_created_again(tmp_path):
    """An overwrite=True marks the root document "replacing" before it erases: killed there,
    the shard made ConcatReplayBuffer(root) and a restarted open_shard raise for ever."""
    for index in (0, 1):
        with open_shard(tmp_path, index, **SHARD) as shard:
            shard.store_episode(x=np.full(2, float(index)))
    root_document = tmp_path / "actor-001" / "zarr.json"
    document = json.loads(root_document.read_text())
    document["attributes"]["replacing"] = True
    root_document.write_text(json.dumps(document))
    assert ConcatReplayBuffer(str(tmp_path)).get_all_data()["x"][:, :2].tolist() == [[0.0, 0.0]]
    with open_shard(tmp_path, 1, **SHARD) as shard:
        assert len(shard) == 0
        shard.store_episode(x=np.full(3, 5.0))
    assert ConcatReplayBuffer(str(tmp_path)).num_episodes == 2


def _memmap_create_killed_at_allocation(location: str, kwargs: dict, allocations: int) -> None:
    """Child: create a memmap shard and die (as under SIGKILL) before its allocation number
    ``allocations`` of an array file."""
    from replaybuf.storage import _memmap

    real, done = _memmap.MemmapStorage._allocate, []

    def allocate(self, *args):
        if len(done) == allocations:
            os._exit(9)
        done.append(args)
        return real(self, *args)

    _memmap.MemmapStorage._allocate = allocate
    ReplayBuffer(location, **kwargs)


@pytest.mark.parametrize("allocations", [0, 2])
def test_a_memmap_actor_killed_while_creating_its_shard_restarts(tmp_path, allocations):
    """The array files a killed memmap create left (no config yet) were refused as a user's
    own (ForeignEntriesError) by every later open_shard: the actor could never restart."""
    kwargs = dict(SHARD, backend="memmap", fields=dict(x="float", y="int"))
    child = FORK.Process(
        target=_memmap_create_killed_at_allocation, args=(shard_location(tmp_path, 0), kwargs, allocations)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 9
    with open_shard(tmp_path, 0, **kwargs) as shard:
        shard.store_episode(x=np.ones(2), y=np.arange(2))
    assert ConcatReplayBuffer(str(tmp_path)).get_all_data()["y"][:, :2].tolist() == [[0, 1]]


def test_a_collector_over_a_concatenation_is_refused_as_read_only_at_store(tmp_path):
    from replaybuf import EpisodeCollector

    with open_shard(tmp_path, 0, **SHARD) as shard:
        shard.store_episode(x=np.ones(2))
    collector = EpisodeCollector(ConcatReplayBuffer(str(tmp_path)), 1)
    collector.append(x=np.ones(1))
    with pytest.raises(NotImplementedError, match="read-only: `batched_episode` is not allowed"):
        collector.store()


def test_an_unfinished_shard_on_s3_is_left_out_then_created_again(s3_server):
    root = s3_server.url(f"unfinished/{uuid.uuid4().hex[:12]}")
    options = s3_server.storage_options
    for index in (0, 1):
        with open_shard(root, index, **SHARD, storage_options=options) as shard:
            shard.store_episode(x=np.full(2, float(index)))
    kv = shard.storage.kv  # shard 1's, its lease given back
    kv.delete_many([key for key in kv.list_prefix("") if key != "zarr.json"])  # a create killed after its first PUT

    together = ConcatReplayBuffer(root, storage_options=options)
    assert together.get_all_data()["x"][:, :2].tolist() == [[0.0, 0.0]]
    with open_shard(root, 1, **SHARD, storage_options=options) as shard:
        assert len(shard) == 0
        shard.store_episode(x=np.full(2, 7.0))
    assert ConcatReplayBuffer(root, storage_options=options).num_episodes == 2


def test_a_rate_limited_loader_refuses_lost_ddp_arguments_when_made(tmp_path):
    """A rate-limited loader makes its loaders pass by pass: the refusals came only at the
    first iteration (after waiting for min_size steps)."""
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=4, max_timesteps=3, fields=dict(x="float"))
    buffer.store_episode(x=np.ones(2))
    rate = dict(batch_size=1, timestep_level=True, samples_per_insert=4.0)
    with pytest.raises(ValueError, match="world_size=2 given without rank"):
        buffer.dataloader(**rate, world_size=2)
    with pytest.raises(ValueError, match="rank=0, world_size=2 cannot be combined with a custom sampler"):
        buffer.dataloader(**rate, sampler=[0, 1], rank=0, world_size=2)
