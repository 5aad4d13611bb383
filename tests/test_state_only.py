"""Small fields held resident by read-only readers (issue 20): loaded once per process in one
pass, kept through ``refresh()`` except for the slots a writer changed, shared with DataLoader
workers, and left on disk above the size threshold."""

from __future__ import annotations

import multiprocessing
import uuid

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from replaybuf import ReplayBuffer
from replaybuf.sampling import chunk_cache, make_dataloader
from replaybuf.storage import _chunks

pytest_plugins = ["tests._servers"]  # fixture: s3_server
SPAWN = multiprocessing.get_context("spawn")
FIELDS = {"state": ("float", 4), "reward": "float", "ident": "int"}
EPISODES, STEPS = 6, 5


def episode(index: int) -> dict[str, np.ndarray]:
    """``ident`` is 1000 * index + t: a sample names the episode it came from."""
    rng = np.random.default_rng(index)
    return {
        "state": rng.standard_normal((STEPS, 4)).astype(np.float32),
        "reward": rng.random(STEPS).astype(np.float32),
        "ident": 1000 * index + np.arange(STEPS, dtype=np.int32),
    }


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
    process = SPAWN.Process(target=target, args=args)
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
