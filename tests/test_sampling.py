"""The read path: datasets and loaders match memmap-replay-buffer batch for batch, workers,
freshness under a concurrent writer, the chunk cache, and bad input."""

from __future__ import annotations

import gc
import multiprocessing
import warnings

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import ReplayBuffer, StorageError
from replaybuf.sampling import (
    ReplayDataset,
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
    SnapshotOverwrittenError,
    chunk_cache,
    make_dataloader,
    make_dataset,
)
from tests._backends import BACKENDS, make_place
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_LENGTHS as LENGTHS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill
from tests._data import sampling_episode as episode

MAX_EPISODES, MAX_TIMESTEPS = 8, 10


def make_buffer(backend, tmp_path, lengths=LENGTHS, **kwargs):
    options = dict(max_episodes=MAX_EPISODES, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META_FIELDS)
    options.update(kwargs)
    place = make_place(backend, tmp_path)
    buffer = ReplayBuffer(place.location, **place.kwargs, **options)
    fill(buffer, lengths)
    return buffer


@pytest.fixture(scope="module", params=BACKENDS)
def shared_buffer(request, tmp_path_factory):
    """A buffer the read-only tests share (one per backend)."""
    buffer = make_buffer(request.param, tmp_path_factory.mktemp("shared"))
    yield buffer
    buffer.close()


@pytest.fixture
def buffer(backend, tmp_path):
    # closed here, not flushed by ``__del__`` when a later test's allocation runs the garbage
    # collector: a memory:// writer's flush there can deadlock on the thread pools' shutdown lock
    buffer = make_buffer(backend, tmp_path)
    yield buffer
    buffer.close()


@pytest.fixture(scope="module")
def seed_buffer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seed") / "buffer"
    reference = seed.ReplayBuffer(
        folder, max_episodes=MAX_EPISODES, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META_FIELDS
    )
    fill(reference)
    return reference


def assert_same(ours, theirs, where):
    if isinstance(theirs, dict):
        assert list(ours) == [k for k in ours if k in theirs] and set(ours) == set(theirs), where
        items = [(k, ours[k], theirs[k]) for k in theirs]
    else:
        assert type(ours).__name__ == type(theirs).__name__ and ours._fields == theirs._fields, where
        items = list(zip(theirs._fields, ours, theirs))
    for key, a, b in items:
        assert a.dtype == b.dtype and a.shape == b.shape, (where, key, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (where, key)


LOADER_CASES = [
    {},
    {"return_mask": True, "return_indices": True},
    {"fields": ("state", "ident"), "filter_meta": {"task": 1}},
    {"filter_meta": {"success": True}, "fieldname_map": {"state": "obs", "task": "goal"}},
    {"dataset_kwargs": {"slice_by_episode_len": False}},
    {"to_named_tuple": ("image", "_lens", "task")},
    {"timestep_level": True},
    {"timestep_level": True, "return_indices": True, "fields": ("ident", "reward")},
    {"timestep_level": True, "filter_fields": {"done": True}},
    {"timestep_level": True, "filter_fields": {"ident": 4003}, "filter_meta": {"task": 1}},
    {"n_steps": 1},
    {"n_steps": 3, "return_indices": True},
    {
        "n_steps": 4,
        "current_fields": ("state",),
        "next_fields": ("state", "done"),
        "sequence_fields": ("reward", "image"),
    },
    {"n_steps": 2, "fieldname_map": {"next_state": "next_obs", "n_step_lens": "k"}, "filter_meta": {"success": False}},
    {"n_steps": 2, "to_named_tuple": ("ident", "next_ident", "_indices"), "return_indices": True},
]


@pytest.mark.parametrize("case", LOADER_CASES, ids=lambda c: ",".join(c) or "trajectory")
@pytest.mark.parametrize("batch_size", [1, 3])
def test_loader_matches_seed(shared_buffer, seed_buffer, case, batch_size):
    ours = list(make_dataloader(shared_buffer, batch_size, **case))
    theirs = list(seed_buffer.dataloader(batch_size, **case))
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert_same(a, b, case)


@pytest.mark.parametrize("kind", [{}, {"timestep_level": True}, {"n_steps": 3, "sequence_fields": ("state",)}])
def test_dataset_items_match_seed(shared_buffer, seed_buffer, kind):
    ours, theirs = make_dataset(shared_buffer, **kind), seed_buffer.dataset(**kind)
    assert len(ours) == len(theirs)
    for i in (0, len(ours) // 2, len(ours) - 1, -1):
        assert_same(ours[i], theirs[i], (kind, i))
    with pytest.raises(IndexError):
        ours[len(ours)]


def test_getitems_reads_each_field_once_per_batch(buffer, monkeypatch):
    dataset = make_dataset(buffer, timestep_level=True)
    calls = []
    original = dataset.fetcher.gather
    monkeypatch.setattr(dataset.fetcher, "gather", lambda name, e, t: calls.append(name) or original(name, e, t))
    batch = dataset.__getitems__(list(range(len(dataset))))
    assert sorted(calls) == sorted(FIELDS)
    assert batch.batch["ident"].tolist() == [1000 * e + t for e, n in enumerate(LENGTHS) for t in range(n)]


def test_dataset_classes_from_a_path(tmp_path):
    buffer = make_buffer("zarr", tmp_path)
    folder = str(buffer.folder)
    assert ReplayDataset is ReplayDatasetTrajectory
    assert len(ReplayDatasetTrajectory(folder)) == len(LENGTHS)
    assert len(ReplayDatasetTimestep(folder)) == sum(LENGTHS)
    assert len(ReplayDatasetNStep(folder, n_steps=2)) == sum(n - 1 for n in LENGTHS if n >= 2)


def test_time_windows(buffer):
    dataset = ReplayDatasetTimeWindow(buffer, window_length=4, return_indices=True)
    torch.manual_seed(3)
    first = dataset.__getitems__(list(range(len(dataset)))).batch
    torch.manual_seed(3)
    again = dataset.__getitems__(list(range(len(dataset)))).batch
    assert torch.equal(first["_start"], again["_start"])
    for i, length in enumerate(LENGTHS):
        start, actual = int(first["_start"][i]), int(first["_lens"][i])
        assert actual == min(4, length) and 0 <= start <= length - actual
        assert bool(first["_reaches_episode_end"][i]) == (start + actual >= length)
        expected = episode(i, length)["ident"][start : start + actual]
        assert first["ident"][i, :actual].tolist() == expected.tolist()
        assert (first["ident"][i, actual:] == 0).all() and first["image"].shape[1:] == (4, 6, 5, 3)
    assert first["_lens"].dtype == torch.long and first["_reaches_episode_end"].dtype == torch.bool
    batches = list(make_dataloader(buffer, 4, dataset=dataset, return_mask=True))
    assert batches[0]["_mask"].shape == (4, 4)


def window_draws(loader) -> list[tuple[list[int], list[int]]]:
    return [(batch["_index"].tolist(), batch["_start"].tolist()) for batch in loader]


def test_a_seeded_loader_s_windows_repeat_with_workers_and_after_a_resume(tmp_path):
    """A loader given ``seed`` (or a rank) draws each window's start from its seed, epoch and
    the sample: torch's generator gave other windows to each loader of one seed, to workers, and
    to a loader resumed from ``state_dict()``."""
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=6, max_timesteps=20, fields={"ident": "int"})
    for e in range(6):
        buffer.store_episode(ident=np.arange(20) + 100 * e)

    def loader(seed=3, **kwargs):
        windows = ReplayDatasetTimeWindow(buffer, 5, return_indices=True)
        return make_dataloader(buffer, 2, dataset=windows, seed=seed, shuffle=True, **kwargs)

    first, second = loader(), loader()
    epochs = [window_draws(first), window_draws(first)]
    assert window_draws(second) == epochs[0] and window_draws(second) == epochs[1]
    assert epochs[0] != epochs[1]  # each epoch draws anew
    assert window_draws(loader(num_workers=1, multiprocessing_context="fork")) == epochs[0]
    interrupted = loader()
    received = next(iter(interrupted))
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    assert [(received["_index"].tolist(), received["_start"].tolist())] + window_draws(resumed) == epochs[0]
    assert window_draws(loader(seed=2**70)) == window_draws(loader(seed=2**70))  # any int, as numpy takes
    for batch in loader(rank=1, world_size=2):  # still the windows the texts define
        for index, start, ident in zip(batch["_index"].tolist(), batch["_start"].tolist(), batch["ident"]):
            assert 0 <= start <= 15 and ident.tolist() == list(range(100 * index + start, 100 * index + start + 5))
    buffer.close()


def reference_window(length: int, width: int, start: int, episode: int) -> dict[str, list]:
    """The README's window of ``episode`` (ident 100 * episode + t) from ``start``: ``min(width,
    length)`` steps, zero-padded to ``width``."""
    actual = min(width, length)
    assert 0 <= start <= length - actual
    ident = [100 * episode + t for t in range(start, start + actual)] + [0] * (width - actual)
    return {"ident": ident, "_lens": actual, "_reaches_episode_end": start + actual >= length}


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    width=st.integers(1, 8),
    batch_size=st.integers(1, 3),
    world_size=st.integers(1, 3),
    drop_last=st.booleans(),
    received=st.integers(1, 3),
)
def test_seeded_window_shares_match_the_reference_cover_the_ranks_and_resume(
    tmp_path_factory, lengths, width, batch_size, world_size, drop_last, received
):
    """Windows over episodes of any length (1 and max_timesteps included, windows longer than
    them), sharded across ranks that do not divide them: each sample is the reference's window at
    its ``_start``; ranks are disjoint (``drop_last``) or cover every episode; a loader resumed
    after ``received`` batches gives exactly the rest of the epoch."""
    buffer = ReplayBuffer(tmp_path_factory.mktemp("w") / "b", max_episodes=5, max_timesteps=6, fields={"ident": "int"})
    for e, length in enumerate(lengths):
        buffer.store_episode(ident=np.arange(length) + 100 * e)

    def loader(rank):
        windows = ReplayDatasetTimeWindow(buffer, width, return_indices=True)
        options = dict(seed=1, shuffle=True, drop_last=drop_last, rank=rank, world_size=world_size)
        with warnings.catch_warnings():  # drop_last with fewer samples than a batch: no batch, a warning
            warnings.simplefilter("ignore")
            return make_dataloader(buffer, batch_size, dataset=windows, **options)

    seen = []
    for rank in range(world_size):
        epoch = [{k: v.tolist() for k, v in batch.items()} for batch in loader(rank)]
        for batch in epoch:
            for i, e in enumerate(batch["_index"]):
                sample = {k: batch[k][i] for k in ("ident", "_lens", "_reaches_episode_end")}
                assert sample == reference_window(lengths[e], width, batch["_start"][i], e)
                seen.append(e)
        interrupted, resumed = loader(rank), loader(rank)
        batches = iter(interrupted)
        head = [{k: v.tolist() for k, v in next(batches).items()} for _ in range(min(received, len(epoch)))]
        resumed.load_state_dict(interrupted.state_dict())
        rest = [{k: v.tolist() for k, v in batch.items()} for batch in resumed]
        assert head + (rest if len(head) < len(epoch) else []) == epoch
    if drop_last:
        assert len(seen) == len(set(seen))
    else:
        assert set(seen) == set(range(len(lengths)))
    buffer.close()


@pytest.mark.parametrize("cache", ["ram", "memmap"])
def test_decoded_caches_give_the_same_batches(buffer, cache):
    for case in ({}, {"timestep_level": True}, {"n_steps": 3, "sequence_fields": ("image",)}):
        plain = list(make_dataloader(buffer, 4, **case))
        cached = list(make_dataloader(buffer, 4, dataset_kwargs={"cache": cache}, **case))
        for a, b in zip(plain, cached):
            assert_same(b, a, case)


def test_a_dataset_cache_is_the_read_cache_shared_by_workers_and_kept(tmp_path, monkeypatch):
    """``cache='memmap'`` (or ``'ram'``) reads through the buffer's read cache: filled with the
    snapshot when the dataset is made, one raw file per (field, episode) that a spawned worker
    maps too, kept for the next dataset (which fills nothing)."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("REPLAYBUF_CACHE_DIR", str(cache_dir))
    buffer = make_buffer("zarr", tmp_path)
    context = multiprocessing.get_context("spawn")
    loader = make_dataloader(
        buffer, 4, timestep_level=True, cache="memmap", num_workers=1, multiprocessing_context=context
    )
    files = {p: p.stat().st_ino for p in cache_dir.rglob("*.rows")}
    assert len(files) == len(FIELDS) * sum(1 for n in LENGTHS if n > 0)
    for a, b in zip(loader, make_dataloader(buffer, 4, timestep_level=True)):
        assert_same(a, b, "read cache in a spawned worker")
    del loader
    gc.collect()
    again = make_dataloader(buffer, 4, timestep_level=True, cache="ram")
    assert {p: p.stat().st_ino for p in cache_dir.rglob("*.rows")} == files  # kept, not filled again
    for a, b in zip(again, make_dataloader(buffer, 4, timestep_level=True)):
        assert_same(a, b, "read cache again")


def test_device_and_loader_kwargs(buffer):
    batches = list(make_dataloader(buffer, 4, timestep_level=True, device="cpu", drop_last=True))
    assert len(batches) == sum(LENGTHS) // 4
    assert all(b["state"].device.type == "cpu" for b in batches)
    shuffled = list(make_dataloader(buffer, 100, timestep_level=True, shuffle=True))
    assert sorted(shuffled[0]["ident"].tolist()) == sorted(
        make_dataloader(buffer, 100, timestep_level=True)
        .dataset.__getitems__(range(sum(LENGTHS)))
        .batch["ident"]
        .tolist()
    )


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers(backend, tmp_path, start_method):
    buffer = make_buffer(backend, tmp_path)
    context = multiprocessing.get_context(start_method)
    if backend == "memory" and start_method == "spawn":  # it lives in this process: refused by name
        loader = make_dataloader(buffer, 2, num_workers=1, multiprocessing_context=context)
        with pytest.raises(StorageError, match="lives in the memory of the process that created it"):
            list(loader)
        return
    cases = [
        {"to_named_tuple": ("state", "_lens", "_mask"), "return_mask": True},
        {"n_steps": 2, "return_indices": True},
    ]
    # what a spawned worker adds is unpickling a dataset: one kind and one worker show it (each
    # spawned worker imports torch anew; two workers sharing the batches is the fork case's)
    workers = 2
    if start_method == "spawn":
        cases, workers = cases[1:], 1
    for case in cases:
        expected = list(make_dataloader(buffer, 2, **case))
        got = list(
            make_dataloader(
                buffer, 2, num_workers=workers, multiprocessing_context=context, persistent_workers=True, **case
            )
        )
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b, (start_method, case))


# ---- freshness ---------------------------------------------------------------------------------


def check_origin(batch, slots_to_episode):
    """Every sample's data comes from the episode its slot held when the loader was made."""
    for (slot, t), ident in zip(batch["_indices"].tolist(), batch["ident"].tolist()):
        assert ident == 1000 * slots_to_episode[slot] + t


@pytest.mark.parametrize("reader", ["same", "read_only"])
def test_loader_never_mixes_a_reused_slot(backend, tmp_path, reader):
    writer = make_buffer(backend, tmp_path, lengths=(6,) * MAX_EPISODES, circular=True)
    source = (
        writer
        if reader == "same"
        else ReplayBuffer.from_folder(writer.storage.location, read_only=True, backend=writer.storage.backend_name)
    )
    loader = make_dataloader(source, 16, timestep_level=True, return_indices=True)
    origin = {slot: slot for slot in range(MAX_EPISODES)}
    first = next(iter(loader))
    check_origin(first, origin)
    fill(writer, lengths=(6, 6, 6), start=MAX_EPISODES)  # reuses slots 0, 1, 2
    seen = set()
    for batch in loader:
        check_origin(batch, origin)
        seen.update(s for s, _ in batch["_indices"].tolist())
    if reader == "read_only" and loader.dataset.fetcher.verified():
        # served from copies checked for the snapshot's generations when loaded (a read-only
        # zarr reader's resident fields): the reused slots' old episodes, as the snapshot named
        assert seen == set(range(MAX_EPISODES))
    else:  # the reused slots are dropped: their stored rows (and the writer's copies) are new
        assert seen and not seen & {0, 1, 2}
    fresh = make_dataloader(source, 64, timestep_level=True, return_indices=True)
    origin.update({0: MAX_EPISODES, 1: MAX_EPISODES + 1, 2: MAX_EPISODES + 2})
    for batch in fresh:
        check_origin(batch, origin)
    assert len(fresh.dataset) == 6 * MAX_EPISODES
    writer.close()


def test_episode_in_progress_is_not_visible(backend, tmp_path):
    writer = make_buffer(backend, tmp_path)
    for t in range(3):
        writer.store(**{k: v[t] for k, v in episode(99, 3).items()})
    writer.flush()
    reader = ReplayBuffer.from_folder(writer.storage.location, read_only=True, backend=writer.storage.backend_name)
    assert len(make_dataset(reader, timestep_level=True)) == sum(LENGTHS)
    assert len(make_dataset(writer, timestep_level=True)) == sum(LENGTHS)
    writer.advance_episode()
    assert len(make_dataset(reader, timestep_level=True)) == sum(LENGTHS) + 3
    writer.close()


@pytest.mark.parametrize("resident_bytes", [0, 64 << 20], ids=["lru", "resident"])
def test_reader_sees_in_place_updates_after_refresh(backend, tmp_path, resident_bytes, monkeypatch):
    """update() keeps a slot's generation, so a reader's cached reads (chunk cache, shard
    indexes, resident rows, open files) cannot notice it by version: refresh() drops them."""
    monkeypatch.setattr(chunk_cache(), "resident_bytes", resident_bytes)
    fields = {**FIELDS, "image": ("uint8", (40, 40, 3))}
    writer = make_buffer(backend, tmp_path, fields=fields)
    reader = ReplayBuffer.from_folder(writer.storage.location, read_only=True, backend=writer.storage.backend_name)
    for _ in range(2):  # twice: frames enter the chunk cache on their second miss
        before = next(iter(make_dataloader(reader, sum(LENGTHS), timestep_level=True, shuffle=False)))
    assert not (before["image"] == 7).all()
    writer.update(
        None,
        image=np.full((1, MAX_TIMESTEPS, 40, 40, 3), 7, np.uint8),
        state=np.full((1, MAX_TIMESTEPS, 4), 2.5, np.float32),
    )
    reader.refresh()
    after = next(iter(make_dataloader(reader, sum(LENGTHS), timestep_level=True, shuffle=False)))
    assert (after["image"] == 7).all() and (after["state"] == 2.5).all()
    trajectories = next(iter(make_dataloader(reader, len(LENGTHS), shuffle=False, return_mask=True)))
    assert (trajectories["image"][trajectories["_mask"]] == 7).all()
    writer.close()


# ---- the chunk cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("resident_bytes", [0, 64 << 20], ids=["lru", "resident"])
def test_chunk_cache_hits_and_sees_writes_of_this_process(tmp_path, resident_bytes, monkeypatch):
    cache = chunk_cache()
    monkeypatch.setattr(cache, "resident_bytes", resident_bytes)
    buffer = make_buffer("zarr", tmp_path, fields={**FIELDS, "image": ("uint8", (40, 40, 3))})
    cache.clear()
    loader = make_dataloader(buffer, 8, timestep_level=True)
    first = [b["image"] for b in loader]
    first = [b["image"] for b in loader]  # frames are cached on their second miss
    misses = cache.misses
    again = [b["image"] for b in loader]
    assert cache.misses == misses and cache.hits >= misses * (resident_bytes == 0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    buffer.update(1, image=np.full((4, 40, 40, 3), 7, np.uint8), state=np.full((4, 4), 2.5, np.float32))
    batch = make_dataloader(buffer, 64, timestep_level=True).dataset.__getitems__([1, 2]).batch
    assert (batch["image"] == 7).all() and (batch["state"] == 2.5).all()
    batch = loader.dataset.__getitems__([1, 2]).batch
    assert (batch["image"] == 7).all() and (batch["state"] == 2.5).all()
    cache.resize(max_bytes=0)
    try:
        assert cache.nbytes == 0
        assert torch.equal(
            next(iter(loader))["image"], next(iter(make_dataloader(buffer, 8, timestep_level=True)))["image"]
        )
    finally:
        cache.resize(max_bytes=128 << 20)


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, message",
    [
        ({"fields": ("nope",)}, "fields: invalid field names \\['nope'\\]"),
        ({"n_steps": 2, "current_fields": ("state", "nope")}, "current_fields"),
        ({"n_steps": 2, "next_fields": ("x",)}, "next_fields"),
        ({"n_steps": 2, "sequence_fields": ("x",)}, "sequence_fields"),
        ({"to_named_tuple": ("state", "_nope")}, "to_named_tuple: invalid field names \\['_nope'\\]"),
        ({"to_named_tuple": ("state",), "fields": ("state",)}, "both fields and to_named_tuple"),
        ({"n_steps": 0}, "n_steps must be an int >= 1"),
        ({"n_steps": 2, "timestep_level": True}, "both n_steps and timestep_level"),
        ({"timestep_level": True, "return_mask": True}, "return_mask is only supported"),
        ({"n_steps": 2, "return_mask": True}, "return_mask is only supported"),
        ({"filter_meta": {"nope": 1}}, "filter_meta: invalid field names"),
        ({"filter_meta": {"task": 17}}, "matches no episode"),
        ({"timestep_level": True, "filter_fields": {"image": 0}}, "only supports scalar fields"),
        ({"timestep_level": True, "filter_fields": {"ident": -5}}, "matches no timestep"),
        ({"filter_fields": {"done": True}}, "only supported for timestep-level"),
        ({"sampler": "lifo"}, "sampler must be one of"),
        ({"sampler": "prioritized"}, "use timestep_level=True or n_steps"),
        ({"sampler": "prioritized", "timestep_level": True}, "priority_field 'priority' is not a field"),
        ({"dataset_kwargs": {"cache": "gpu"}}, "cache must be one of"),
    ],
)
def test_bad_input(shared_buffer, case, message):
    with pytest.raises(ValueError, match=message):
        make_dataloader(shared_buffer, 2, **case)


def test_filter_fields_matching_only_episodes_overwritten_while_filtered_says_so(tmp_path):
    """Before: "matches no timestep", though the matching episode was overwritten by a writer
    during the filter's read (it is left out, as a batch would drop it)."""
    path = tmp_path / "b"
    writer = ReplayBuffer(path, 2, 3, fields={"flag": "int"}, circular=True, backend="memmap")
    writer.store_episode(flag=np.ones(3, np.int64))
    writer.store_episode(flag=np.zeros(3, np.int64))
    reader = ReplayBuffer.from_folder(path, read_only=True)
    gather, calls = reader.storage.gather, []

    def overwrite_then_gather(*args, **kwargs):
        if not calls:
            writer.store_episode(flag=np.ones(3, np.int64))  # into slot 0, matching too
        calls.append(args)
        return gather(*args, **kwargs)

    reader.storage.gather = overwrite_then_gather
    with pytest.raises(ValueError, match=r"matches no timestep of the episodes left \(1 of the snapshot's"):
        make_dataloader(reader, 2, timestep_level=True, filter_fields={"flag": 1})
    reader.storage.gather = gather
    reader.refresh()
    assert len(make_dataloader(reader, 2, timestep_level=True, filter_fields={"flag": 1}).dataset) == 3


def test_bad_input_outside_the_loader(buffer, tmp_path):
    with pytest.raises(ValueError, match="window_length must be an int >= 1"):
        ReplayDatasetTimeWindow(buffer, window_length=0)
    with pytest.raises(ValueError, match="cannot turn off return_episode_lens"):
        make_dataset(buffer, slice_by_episode_len=False, return_episode_lens=False)
    empty = ReplayBuffer(
        make_place("zarr", tmp_path / "empty").location, max_episodes=2, max_timesteps=3, fields={"x": "float"}
    )
    with pytest.raises(ValueError, match="replay buffer is empty"):
        make_dataloader(empty, 2)
    with pytest.raises(ValueError, match="replay buffer is empty"):
        ReplayDatasetTimestep(empty)
    short = make_buffer("zarr", tmp_path / "short", lengths=(1, 1))
    with pytest.raises(ValueError, match="no episode has at least 2 timesteps"):
        make_dataset(short, n_steps=3)
    with pytest.raises(TypeError, match="must be a ReplayBuffer"):
        ReplayDatasetTimestep(42)


def _write_circular(folder: str, first: int, count: int) -> None:
    writer = ReplayBuffer.from_folder(folder)
    fill(writer, lengths=[3 + (first + i) % 6 for i in range(count)], start=first)
    writer.close()


def test_reader_beside_a_writer_process_sees_only_whole_episodes(tmp_path):
    writer = make_buffer("zarr", tmp_path, lengths=[3 + i % 6 for i in range(MAX_EPISODES)], circular=True)
    folder = str(writer.folder)
    writer.close()
    process = multiprocessing.get_context("fork").Process(target=_write_circular, args=(folder, MAX_EPISODES, 40))
    reader = ReplayBuffer.from_folder(folder, read_only=True)
    process.start()
    checked = 0
    try:
        while process.is_alive() or checked == 0:
            try:
                for batch in make_dataloader(reader, 4):
                    for idents, length in zip(batch["ident"].tolist(), batch["_lens"].tolist()):
                        index = idents[0] // 1000
                        assert length == 3 + index % 6
                        assert idents[:length] == [1000 * index + t for t in range(length)]
                        checked += 1
            except SnapshotOverwrittenError:  # the writer reused every slot of the pass's snapshot: a new pass
                pass
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0 and checked > 0
    assert sorted(
        make_dataset(reader).__getitems__(range(MAX_EPISODES)).batch["ident"][:, 0].floor_divide(1000).tolist()
    ) == list(range(40, 40 + MAX_EPISODES))


def test_an_empty_buffer_says_what_to_do_to_every_loader(tmp_path):
    """Every loader and dataset of an empty buffer, and of a writer whose steps were stored but
    never ended (a newcomer's first loop without advance_episode): the seed's "replay buffer is
    empty", then which buffer and what to do (it said no more)."""
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=2, max_timesteps=4, fields={"x": "float"})
    kinds = {
        "trajectory": lambda: buffer.dataloader(batch_size=2),
        "timestep": lambda: buffer.dataloader(batch_size=2, timestep_level=True),
        "n-step": lambda: buffer.dataloader(batch_size=2, n_steps=2),
        "prioritized": lambda: buffer.dataloader(batch_size=2, sampler="prioritized", priority_field="x"),
        "dataset": lambda: ReplayDataset(buffer),
        "n-step dataset": lambda: ReplayDatasetNStep(buffer, n_steps=2),
        "window dataset": lambda: ReplayDatasetTimeWindow(buffer, window_length=2),
    }
    for steps, what in ((0, "store episodes first (store_episode, or store() steps and advance_episode())"), (3, "")):
        for _ in range(steps):
            buffer.store(x=1.0)
        what = what or "its 3 steps stored are an episode in progress: end it with advance_episode()"
        for kind, make in kinds.items():
            with pytest.raises(ValueError, match=r"^replay buffer is empty: ReplayBuffer\('.*/b'.* holds no") as error:
                make()
            assert what in str(error.value), kind
    buffer.advance_episode()
    assert len(next(iter(buffer.dataloader(batch_size=2)))["x"]) == 1
