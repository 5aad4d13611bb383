"""ResumableDistributedSampler / ResumableDataLoader: rank sharding, reproducibility, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.utils.data import Dataset

from replaybuf.sampling.distributed import ResumableDataLoader, ResumableDistributedSampler, resolve_rank


class Numbers(Dataset):
    """Item i is i: what a loader delivers is the indices it sampled."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def epoch_of(samplers: list[ResumableDistributedSampler]) -> list[list[int]]:
    return [list(s) for s in samplers]


@pytest.mark.parametrize("length", [0, 1, 7, 10, 33])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_disjoint_and_complete(length, world_size, shuffle):
    samplers = [
        ResumableDistributedSampler(length, rank=r, world_size=world_size, shuffle=shuffle, seed=3)
        for r in range(world_size)
    ]
    parts = epoch_of(samplers)
    per_rank = -(-length // world_size)
    assert all(len(p) == per_rank == len(s) for p, s in zip(parts, samplers))
    merged = [i for p in parts for i in p]
    assert set(merged) == set(range(length))
    # padding repeats only as many indices as needed to even out the ranks
    assert len(merged) - length == per_rank * world_size - length


def test_drop_last_gives_disjoint_equal_shares():
    samplers = [ResumableDistributedSampler(10, rank=r, world_size=3, drop_last=True) for r in range(3)]
    parts = epoch_of(samplers)
    merged = [i for p in parts for i in p]
    assert [len(p) for p in parts] == [3, 3, 3]
    assert len(set(merged)) == 9


def test_epochs_reshuffle_reproducibly():
    a = ResumableDistributedSampler(50, seed=1)
    b = ResumableDistributedSampler(50, seed=1)
    first, second = list(a), list(a)
    assert first != second, "a full pass moves to the next epoch"
    assert sorted(first) == sorted(second) == list(range(50))
    b.set_epoch(1)
    assert list(b) == second
    assert list(ResumableDistributedSampler(50, seed=2)) != first
    assert list(ResumableDistributedSampler(50, shuffle=False)) == list(range(50))


def test_seed_defaults():
    torch.manual_seed(5)
    first = ResumableDistributedSampler(30)
    torch.manual_seed(5)
    again = ResumableDistributedSampler(30)
    assert first.seed == again.seed and list(first) == list(again)
    assert ResumableDistributedSampler(30).seed != first.seed, "torch's generator moved on"
    assert ResumableDistributedSampler(30, rank=1, world_size=2).seed == 0, "ranks must agree without a seed"


def test_length_is_read_each_epoch():
    data = Numbers(4)
    sampler = ResumableDistributedSampler(data, shuffle=False)
    assert list(sampler) == [0, 1, 2, 3]
    data.n = 6
    assert len(sampler) == 6
    assert list(sampler) == list(range(6))


def test_resume_mid_epoch_exactly():
    reference = ResumableDistributedSampler(40, rank=1, world_size=2, seed=5)
    reference.set_epoch(2)
    expected = list(reference) + list(reference)

    interrupted = ResumableDistributedSampler(40, rank=1, world_size=2, seed=5)
    interrupted.set_epoch(2)
    iterator = iter(interrupted)
    got = [next(iterator) for _ in range(7)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 2 and state["position"] == 7

    resumed = ResumableDistributedSampler(40, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop calls set_epoch again: the loaded position stays
    assert len(resumed) == 20
    got += list(resumed) + list(resumed)
    assert got == expected


def test_resume_keeps_the_epoch_length_while_the_dataset_grows():
    data = Numbers(10)
    sampler = ResumableDistributedSampler(data, seed=0)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(4)]
    state = sampler.state_dict()
    data.n = 15
    resumed = ResumableDistributedSampler(data, seed=0)
    resumed.load_state_dict(state)
    assert sorted(head + list(resumed)) == list(range(10))
    assert sorted(resumed) == list(range(15))


def test_load_state_rejects_mismatches():
    state = ResumableDistributedSampler(10, world_size=2, rank=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="world_size: saved 2 vs this sampler's 4"):
        ResumableDistributedSampler(10, world_size=4, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ResumableDistributedSampler(10, world_size=2, rank=0, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        ResumableDistributedSampler(10).load_state_dict({"epoch": 0})
    with pytest.raises(TypeError, match=r"state must be a sampler's state_dict\(\) \(a dict\), got None"):
        ResumableDistributedSampler(10).load_state_dict(None)  # was: 'NoneType' object is not iterable
    grown = {**state, "epoch_length": 11}
    with pytest.raises(ValueError, match="now has 10"):
        ResumableDistributedSampler(10, world_size=2, rank=0, seed=1).load_state_dict(grown)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"rank": -1, "world_size": 2}, "rank must be an int"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"seed": -3}, "seed must be"),
        ({"seed": 1.5}, "seed must be"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResumableDistributedSampler(10, **kwargs)


def test_bad_data_source():
    with pytest.raises(TypeError, match="data_source"):
        ResumableDistributedSampler(object())
    with pytest.raises(ValueError, match="set_epoch|epoch"):
        ResumableDistributedSampler(3).set_epoch(-1)


def test_defaults_without_torch_distributed():
    assert not dist.is_initialized()
    assert resolve_rank() == (0, 1)
    assert resolve_rank(1, 3) == (1, 3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_counts_delivered_batches(num_workers):
    def loader():
        sampler = ResumableDistributedSampler(Numbers(23), seed=4)
        return ResumableDataLoader(Numbers(23), batch_size=4, sampler=sampler, num_workers=num_workers)

    reference = loader()
    expected = [b.tolist() for _ in range(2) for b in reference]

    first = loader()
    got = []
    for n, batch in enumerate(first):
        got.append(batch.tolist())
        if n == 2:  # workers have prefetched further than this
            break
    state = first.state_dict()
    assert state["position"] == 12
    second = loader()
    second.load_state_dict(state)
    got += [b.tolist() for _ in range(2) for b in second][: len(expected) - len(got)]
    assert got == expected


def test_dataloader_state_after_a_full_epoch_is_the_next_epoch():
    sampler = ResumableDistributedSampler(Numbers(8), seed=0)
    loader = ResumableDataLoader(Numbers(8), batch_size=3, sampler=sampler)
    assert len(list(loader)) == 3
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0


def test_dataloader_requires_the_resumable_sampler():
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        ResumableDataLoader(Numbers(3), batch_size=1, sampler=torch.utils.data.SequentialSampler(range(3)))


def _rank_main(rank: int, init_file: str, out_dir: str, length: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sampler = ResumableDistributedSampler(Numbers(length), seed=11)  # rank/world_size from torch.distributed
        seen = {}
        for epoch in range(2):
            sampler.set_epoch(epoch)
            loader = ResumableDataLoader(Numbers(length), batch_size=4, sampler=sampler)
            seen[epoch] = [i for batch in loader for i in batch.tolist()]
        gathered = [None, None]
        dist.all_gather_object(gathered, seen)
        if rank == 0:
            with open(f"{out_dir}/seen.json", "w") as f:
                json.dump({"ranks": [sampler.rank, sampler.world_size], "seen": gathered}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("length", [20, 21])
def test_two_gloo_ranks_cover_the_dataset_disjointly(tmp_path, length):
    torch_mp.start_processes(
        _rank_main, args=(str(tmp_path / "init"), str(tmp_path), length), nprocs=2, start_method="fork"
    )
    result = json.loads((tmp_path / "seen.json").read_text())
    rank0, rank1 = result["seen"]
    for epoch in ("0", "1"):
        a, b = rank0[epoch], rank1[epoch]
        assert len(a) == len(b) == -(-length // 2)
        assert set(a) | set(b) == set(range(length))
        padding = 2 * len(a) - length
        assert len(set(a) & set(b)) == padding
    assert rank0["0"] != rank0["1"]
    assert np.all(np.asarray(rank0["0"]) < length)


def test_buffer_dataloader_shards_across_ranks_and_resumes(tmp_path):
    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer(str(tmp_path / "b"), 4, 10, fields=dict(x="float"))
    for episode in range(3):
        buffer.store_episode(x=np.arange(10.0) + 100 * episode)
    seen = []
    for rank in range(2):
        loader = buffer.dataloader(batch_size=4, timestep_level=True, shuffle=True, rank=rank, world_size=2, seed=7)
        seen.append([float(v) for batch in loader for v in batch["x"]])
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == {float(e * 100 + t) for e in range(3) for t in range(10)}

    loader = buffer.dataloader(batch_size=4, timestep_level=True, shuffle=True, rank=0, world_size=2, seed=7)
    batches = iter(loader)
    first = next(batches)["x"].tolist()
    state = loader.state_dict()
    rest = [b["x"].tolist() for b in batches]
    resumed = buffer.dataloader(batch_size=4, timestep_level=True, shuffle=True, rank=0, world_size=2, seed=7)
    resumed.load_state_dict(state)
    assert [b["x"].tolist() for b in resumed] == rest
    assert first + [v for b in rest for v in b] == seen[0]
    with pytest.raises(ValueError, match="rank"):
        buffer.dataloader(batch_size=4, timestep_level=True, rank=2, world_size=2)


def test_buffer_dataloader_drop_last_shards_without_repeating_a_sample(tmp_path):
    """15 timesteps over 2 ranks: with drop_last each rank's share was still padded to 8 by
    repeating a sample, which then sat in both ranks' batches; the share is 7 now (the tail
    dropped as the sampler's drop_last does), 3 whole batches of 2 on each rank."""
    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer(str(tmp_path / "b"), 4, 5, fields=dict(x="int"))
    for episode, length in enumerate((3, 5, 5, 2)):
        buffer.store_episode(x=np.arange(length) + 100 * episode)
    seen = []
    for rank in range(2):
        loader = buffer.dataloader(
            batch_size=2, timestep_level=True, shuffle=True, rank=rank, world_size=2, seed=3, drop_last=True
        )
        batches = [batch["x"].tolist() for batch in loader]
        assert len(batches) == len(loader) == 3 and all(len(batch) == 2 for batch in batches)
        seen.append([value for batch in batches for value in batch])
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0] + seen[1])) == 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_redraw_samples_of_reused_slots_within_their_own_share(tmp_path, num_workers):
    """Before: a sample whose slot a writer reused after the loaders were made was redrawn from
    every live sample, so one rank could return another's within the epoch."""
    from replaybuf import ReplayBuffer

    path = str(tmp_path / "b")
    writer = ReplayBuffer(path, 12, 3, fields=dict(x="float"), circular=True, backend="memmap")
    for episode in range(12):
        writer.store_episode(x=np.full(3, float(episode)))
    reader = ReplayBuffer.from_folder(path, read_only=True)
    loaders = [
        reader.dataloader(batch_size=6, shuffle=True, rank=rank, world_size=2, seed=5, num_workers=num_workers)
        for rank in range(2)
    ]
    shares = [set(loader.sampler.epoch_indices(0, 12).tolist()) for loader in loaders]
    for episode in range(12, 17):  # slots 0-4 hold other episodes now
        writer.store_episode(x=np.full(3, float(episode)))
    torch.manual_seed(0)
    seen = [{int(row[0]) for batch in loader for row in batch["x"].tolist()} for loader in loaders]
    live = set(range(5, 12))
    for rank in range(2):
        assert seen[rank] and seen[rank] <= shares[rank] & live, (rank, seen[rank], shares[rank])
    assert not seen[0] & seen[1]


def test_a_rank_whose_share_is_all_reused_draws_the_live_samples_left(tmp_path):
    """A rank with no live sample left in its share draws the other ranks' rather than return
    batches of no samples."""
    from replaybuf import ReplayBuffer

    path = str(tmp_path / "b")
    writer = ReplayBuffer(path, 12, 3, fields=dict(x="float"), circular=True, backend="memmap")
    for episode in range(12):
        writer.store_episode(x=np.full(3, float(episode)))
    reader = ReplayBuffer.from_folder(path, read_only=True)
    loader = reader.dataloader(batch_size=6, shuffle=False, rank=0, world_size=2, seed=5)  # positions 0, 2, .., 10
    for episode in range(12, 23):  # slots 0-10: only slot 11 (rank 1's) holds its snapshot episode
        writer.store_episode(x=np.full(3, float(episode)))
    assert [batch["x"][:, 0].tolist() for batch in loader] == [[11.0] * 6]
