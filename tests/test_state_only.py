"""Small fields held resident by read-only readers (issue 20): loaded once per process in one
pass, kept through ``refresh()`` except for the slots a writer changed, shared with DataLoader
workers, and left on disk above the size threshold."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import uuid
from functools import partial

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, get_worker_info

from replaybuf import ReplayBuffer
from replaybuf.sampling import chunk_cache, make_dataloader
from replaybuf.sampling.datasets import TimepointIndex
from replaybuf.sampling.loader import ShuffledSampler
from replaybuf.storage import GenerationMismatchError, _chunks

from ._data import fields, random_episode, uniform

pytest_plugins = ["tests._servers"]  # fixture: s3_server
SPAWN = multiprocessing.get_context("spawn")
# the writer children: forked, they start without importing torch again (~1.5 s a spawn)
FORK = multiprocessing.get_context("fork")
FIELDS = fields("state", "reward", "ident")
EPISODES, STEPS = 6, 5


def episode(index: int) -> dict[str, np.ndarray]:
    """``ident`` is 1000 * index + t: a sample names the episode it came from."""
    return random_episode(FIELDS, STEPS, index, reward=uniform)


def write(path, fields=FIELDS, count: int = EPISODES) -> None:
    buffer = ReplayBuffer(path, max_episodes=EPISODES, max_timesteps=STEPS, fields=fields, circular=True)
    for index in range(count):
        buffer.store_episode(**episode(index))
    buffer.close()


def expected(path) -> dict[str, np.ndarray]:
    """Every slot's values as the storage reads them, without the resident copies."""
    reader = ReplayBuffer.from_folder(path, read_only=True)
    return {name: reader.storage.read_rows(name, np.arange(EPISODES), 0, STEPS) for name in FIELDS}


def check_batch(batch: dict, values: dict[str, np.ndarray]) -> None:
    episodes, steps = batch["_indices"].numpy().T
    for name in FIELDS:
        assert np.array_equal(
            batch[name].numpy().reshape(len(episodes), -1), values[name][episodes, steps].reshape(len(episodes), -1)
        )


def sample_in_child(path: str, queue) -> None:
    reader = ReplayBuffer.from_folder(path, read_only=True)
    loader = make_dataloader(reader, EPISODES * STEPS, timestep_level=True, return_indices=True)
    batch = {k: v.numpy() for k, v in next(iter(loader)).items()}
    queue.put((batch, {n: reader.storage.array(n).resident_rows_read for n in FIELDS}))


def rewrite_in_child(path: str) -> None:
    """Another process: two new episodes into the circular buffer's oldest slots (0 and 1),
    and an in-place update of slot 3 (its generation stays)."""
    writer = ReplayBuffer.from_folder(path)
    for index in (EPISODES, EPISODES + 1):
        writer.store_episode(**episode(index))
    writer.update(3, reward=np.full(STEPS, 7.0, np.float32))
    writer.close()


def run(target, *args) -> None:
    process = FORK.Process(target=target, args=args)
    process.start()
    process.join(60)
    assert process.exitcode == 0


def test_reader_in_another_process_samples_the_stored_values(tmp_path):
    path = str(tmp_path / "buffer")
    write(path)
    queue = SPAWN.Queue()
    process = SPAWN.Process(target=sample_in_child, args=(path, queue))
    process.start()
    batch, rows_read = queue.get(timeout=60)
    process.join(60)
    check_batch({k: torch.from_numpy(v) for k, v in batch.items()}, expected(path))
    assert sorted(map(tuple, batch["_indices"])) == [(e, t) for e in range(EPISODES) for t in range(STEPS)]
    assert rows_read == dict.fromkeys(FIELDS, EPISODES)  # one load of every slot, nothing per batch


def test_refresh_rereads_only_the_slots_another_process_changed(tmp_path):
    path = str(tmp_path / "buffer")
    write(path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    arrays = {name: reader.storage.array(name) for name in FIELDS}
    for _ in range(2):  # a second dataset of the same snapshot reads nothing
        next(iter(make_dataloader(reader, 8, timestep_level=True)))
        assert {n: a.resident_rows_read for n, a in arrays.items()} == dict.fromkeys(FIELDS, EPISODES)
    run(rewrite_in_child, path)
    reader.refresh()
    loader = make_dataloader(reader, EPISODES * STEPS, timestep_level=True, return_indices=True)
    batch = next(iter(loader))
    # slots 0 and 1 hold new episodes in every field; slot 3's reward was rewritten in place
    assert {n: a.resident_rows_read for n, a in arrays.items()} == {"state": 8, "reward": 9, "ident": 8}
    values = expected(path)
    check_batch(batch, values)
    assert set(values["ident"][:2, 0]) == {EPISODES * 1000, (EPISODES + 1) * 1000}
    assert (values["reward"][3] == 7).all()


def update_reward_in_child(path: str, slot: int, value: float) -> None:
    """Another process: slot ``slot``'s reward rewritten in place (its generation stays)."""
    writer = ReplayBuffer.from_folder(path)
    writer.update(slot, reward=np.full(STEPS, value, np.float32))
    writer.close()


def test_every_refresh_rechecks_the_rows_kept(tmp_path):
    """Rows are compared with their stored objects after each ``refresh()``, not only the
    first: an update in place after a second refresh is read too."""
    path = str(tmp_path / "buffer")
    write(path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    every_step = partial(make_dataloader, reader, EPISODES * STEPS, timestep_level=True, return_indices=True)
    next(iter(every_step()))  # every row loaded
    for slot, value in ((3, 7.0), (2, 9.0), (3, 11.0)):
        run(update_reward_in_child, path, slot, value)
        reader.refresh()
        batch = next(iter(every_step()))
        values = expected(path)
        assert (values["reward"][slot] == value).all()
        check_batch(batch, values)
    assert reader.storage.array("reward").resident_rows_read == EPISODES + 3  # one row per update


def probe(samples):
    """collate_fn run in the worker: the batch and what the worker's resident copy holds."""
    array = get_worker_info().dataset.fetcher.storage.array("state")
    return samples.batch, array.resident_rows_read, array._resident is not None


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_loader_workers_get_the_resident_fields(tmp_path, context):
    path = str(tmp_path / "buffer")
    write(path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    dataset = make_dataloader(reader, 8, timestep_level=True, return_indices=True).dataset
    assert reader.storage.array("state").resident_rows_read == EPISODES
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=1, multiprocessing_context=context, collate_fn=probe
    )
    values = expected(path)
    batches = list(loader)
    assert len(batches) == -(-EPISODES * STEPS // 8)
    for batch, rows_read, resident in batches:
        check_batch(batch, values)
        # fork: the parent's rows, shared, none read again; spawn: one load when unpickled
        assert resident and rows_read == EPISODES


def test_fields_over_the_threshold_are_not_loaded_into_ram(tmp_path, monkeypatch):
    path = str(tmp_path / "buffer")
    fields = {**FIELDS, "frame": ("uint8", (48, 48, 3))}  # 6.9 KB a step: above RESIDENT_STEP_BYTES
    buffer = ReplayBuffer(path, max_episodes=EPISODES, max_timesteps=STEPS, fields=fields)
    for index in range(EPISODES):
        buffer.store_episode(**episode(index), frame=np.full((STEPS, 48, 48, 3), index, np.uint8))
    buffer.close()
    state_bytes = EPISODES * STEPS * 4 * 4
    monkeypatch.setattr(chunk_cache(), "resident_bytes", chunk_cache().resident_nbytes + state_bytes - 1)
    monkeypatch.setattr(_chunks, "SMALL_ARRAY_BYTES", 0)  # this frame array is small, not its steps
    reader = ReplayBuffer.from_folder(path, read_only=True)
    batch = next(iter(make_dataloader(reader, EPISODES * STEPS, timestep_level=True, return_indices=True)))
    for name in ("frame", "state"):  # too large a step; over the process's budget
        array = reader.storage.array(name)
        assert array._resident is None and array.resident_rows_read == 0
    assert reader.storage.array("reward")._resident is not None  # within the budget still
    check_batch(batch, expected(path))
    assert (batch["frame"].flatten(1) == batch["_indices"][:, :1]).all()


def test_object_store_reader_loads_resident_fields_with_concurrent_requests(s3_server, monkeypatch):
    """On S3 the one load is a batch of concurrent GETs (on any number of cores), batches read
    no chunk, and refresh() (no cheap way to see an in-place update there) reloads the rows."""
    url, options = s3_server.url(f"state-{uuid.uuid4().hex[:8]}"), s3_server.storage_options
    writer = ReplayBuffer(url, max_episodes=EPISODES, max_timesteps=STEPS, fields=FIELDS, storage_options=options)
    for index in range(EPISODES):
        writer.store_episode(**episode(index))
    reader = ReplayBuffer.from_folder(url, read_only=True, storage_options=options, cache=False)  # the bare path
    monkeypatch.setattr(s3_server, "latency", 0.02)  # requests overlap, as over a real network
    with s3_server.record() as requests:
        loader = make_dataloader(reader, 8, timestep_level=True)
    assert requests.peak_in_flight["GET"] > 1
    monkeypatch.setattr(s3_server, "latency", 0.0)
    with s3_server.record() as requests:
        batches = list(loader)
    chunk_gets = [path for method, path in requests.requests if method == "GET" and "/data/" in path]
    assert len(batches) == -(-EPISODES * STEPS // 8) and chunk_gets == []
    writer.update(2, reward=np.full(STEPS, 5.0, np.float32))
    reader.refresh()
    batch = next(iter(make_dataloader(reader, EPISODES * STEPS, timestep_level=True, return_indices=True)))
    assert reader.storage.array("reward").resident_rows_read == 2 * EPISODES
    assert (batch["reward"][batch["_indices"][:, 0] == 2] == 5).all()
    writer.close()


# ---- many episodes: per-batch cost and memory (issue 20 at 100,000 episodes) -------------------


def test_batches_of_resident_fields_read_no_generations(tmp_path, monkeypatch):
    """Resident rows were checked against their slots' stored generations when loaded, so a
    batch served from them skips the re-check of its slots (a read of the _generation array
    whose cost grew with the buffer: 3x slower batches at 100,000 episodes); a field that is
    not resident is checked by its gathers, once per batch."""
    path = str(tmp_path / "buffer")
    fields = {**FIELDS, "frame": ("uint8", (48, 48, 3))}
    buffer = ReplayBuffer(path, max_episodes=EPISODES, max_timesteps=STEPS, fields=fields)
    for index in range(EPISODES):
        buffer.store_episode(**episode(index), frame=np.full((STEPS, 48, 48, 3), index, np.uint8))
    buffer.close()
    monkeypatch.setattr(_chunks, "SMALL_ARRAY_BYTES", 0)  # frames stay on disk
    reader = ReplayBuffer.from_folder(path, read_only=True)
    rechecks = []
    read_meta_rows = reader.storage.read_meta_rows
    monkeypatch.setattr(
        reader.storage, "read_meta_rows", lambda name, slots: rechecks.append(name) or read_meta_rows(name, slots)
    )
    frame = reader.storage.array("frame")
    generations_of = frame.generations_of
    monkeypatch.setattr(frame, "generations_of", lambda slots: rechecks.append("frame") or generations_of(slots))
    resident = make_dataloader(reader, 8, timestep_level=True, return_indices=True, fields=list(FIELDS))
    batches = list(resident)
    assert rechecks == [] and resident.dataset.fetcher.verified()
    values = expected(path)
    for batch in batches:
        check_batch(batch, values)
    # a field on disk: its gathers check the slots' generations after reading them, so the
    # batch is verified without a re-check of its own (``verifies_gathers``)
    on_disk = make_dataloader(reader, 8, timestep_level=True, fields=["state", "frame"])
    next(iter(on_disk))
    assert rechecks == ["frame"] and not on_disk.dataset.fetcher.verified()
    assert on_disk.dataset.fetcher.verified(gathers_only=True)


def test_resident_rows_of_a_reused_slot_are_not_kept(tmp_path):
    """A row loaded for a generation its slot no longer holds (a writer reused the slot since
    the reader's snapshot) raises GenerationMismatchError naming the slot; the other rows are
    kept and served without reading them again."""
    path = str(tmp_path / "buffer")
    write(path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    old = np.array(reader.generations)
    writer = ReplayBuffer.from_folder(path)
    writer.store_episode(**episode(EPISODES))  # the circular buffer's oldest slot: 0
    writer.close()
    storage, array = reader.storage, reader.storage.array("ident")
    slots = np.arange(EPISODES)
    with pytest.raises(GenerationMismatchError) as caught:
        storage.gather("ident", slots, np.zeros(EPISODES, np.int64), old[slots])
    assert caught.value.slots == [0] and array.resident_rows_read == EPISODES
    kept = storage.gather("ident", slots[1:], np.ones(EPISODES - 1, np.int64), old[1:])
    assert kept.tolist() == [1000 * s + 1 for s in range(1, EPISODES)] and array.resident_rows_read == EPISODES
    with pytest.raises(GenerationMismatchError):  # read again, still not the named generation
        storage.gather("ident", slots[:1], np.zeros(1, np.int64), old[:1])
    reader.refresh()
    assert storage.gather("ident", slots[:1], np.zeros(1, np.int64), np.array(reader.generations)[:1]).tolist() == [
        1000 * EPISODES
    ]


def test_timepoint_index_maps_positions_as_the_pairs_it_replaces():
    slots = np.array([4, 0, 7, 2, 9])
    counts = np.array([0, 3, 0, 2, 1])  # empty episodes first, between and never last-only
    reference = [(int(s), t) for s, n in zip(slots, counts) for t in range(n)]
    index = TimepointIndex(slots, counts)
    assert len(index) == len(reference) == 6
    episodes, timesteps = index.pairs()
    assert list(zip(episodes.tolist(), timesteps.tolist())) == reference
    positions = np.array([5, 0, 3, 3])
    assert [tuple(map(int, p)) for p in zip(*index.pairs(positions))] == [reference[p] for p in positions]
    index.keep(np.array([True, False, True, True, False, True]))
    index.keep(np.array([False, True, True, True]))  # a second filter applies to what the first kept
    assert index.kept is not None and index.kept.dtype == np.int32
    assert list(zip(*(a.tolist() for a in index.pairs()))) == [reference[i] for i in (2, 3, 5)]


def test_timestep_dataset_keeps_no_per_step_arrays(tmp_path):
    """The dataset's index takes memory per episode; ``timepoints`` (the seed's attribute) is
    built on access, with the pairs the batches use."""
    path = str(tmp_path / "buffer")
    write(path)
    dataset = make_dataloader(ReplayBuffer.from_folder(path, read_only=True), 8, timestep_level=True).dataset
    big = [k for k, v in vars(dataset).items() if isinstance(v, (np.ndarray, torch.Tensor)) and len(v) > EPISODES]
    assert big == [] and len(dataset) == EPISODES * STEPS
    assert dataset.timepoints.tolist() == [[e, t] for e in range(EPISODES) for t in range(STEPS)]
    batch = dataset.__getitems__([7, 29])
    assert batch.batch["ident"].reshape(-1).tolist() == [1000 * 1 + 2, 1000 * 5 + 4]


@pytest.mark.parametrize("replacement", [False, True])
def test_shuffled_sampler_draws_torchs_order(replacement):
    """``shuffle=True`` keeps torch's RandomSampler order for a seed, from a tensor, not a list."""
    data = range(10_000)
    torch.manual_seed(3)
    expected_order = list(RandomSampler(data, replacement=replacement))
    torch.manual_seed(3)
    assert list(ShuffledSampler(data, replacement=replacement)) == expected_order
    generator = torch.Generator().manual_seed(5)
    again = torch.Generator().manual_seed(5)
    assert list(ShuffledSampler(data, generator=generator)) == list(RandomSampler(data, generator=again))


def test_shuffled_loader_covers_every_sample_once(tmp_path):
    path = str(tmp_path / "buffer")
    write(path)
    loader = make_dataloader(ReplayBuffer.from_folder(path, read_only=True), 7, timestep_level=True, shuffle=True)
    assert isinstance(loader.sampler, ShuffledSampler)
    seen = sorted(v for batch in loader for v in batch["ident"].reshape(-1).tolist())
    assert seen == sorted(1000 * e + t for e in range(EPISODES) for t in range(STEPS))


def test_making_a_loader_does_not_import_dask(tmp_path):
    """dask and xarray (``analysis``) load on first use: a reader process that samples pays
    neither their import time (~1 s) nor their memory (~100 MB)."""
    path = str(tmp_path / "buffer")
    write(path)
    code = (
        "import sys, replaybuf\n"
        f"loader = replaybuf.ReplayBuffer.from_folder({path!r}, read_only=True).dataloader(batch_size=4, shuffle=True)\n"
        "next(iter(loader))\n"
        "print(sorted(m for m in ('dask', 'xarray', 'replaybuf.analysis') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_resident_gather_indexes_as_numpy(tmp_path):
    """Steps counted from the end read as numpy reads them, a step past the rows is refused,
    from the resident copy as from the chunks."""
    path = str(tmp_path / "buffer")
    write(path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    storage, values = reader.storage, expected(path)
    generations = storage.read_meta_rows("_generation", np.arange(EPISODES))
    slots = np.array([0, 2, 5])
    for steps in ([-1, 0, -STEPS], [4, 3, 2]):
        got = storage.gather("state", slots, np.array(steps), generations[slots])
        assert np.array_equal(got, values["state"][slots, steps])
    assert storage.array("state")._resident is not None
    with pytest.raises(IndexError):
        storage.gather("state", slots, np.array([0, STEPS, 1]), generations[slots])
