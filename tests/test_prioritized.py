"""Prioritized sampling: draws follow the stored priorities, weights, write-back, workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer, verify
from replaybuf.sampling import SnapshotOverwrittenError, make_dataloader, update_priorities
from replaybuf.sampling.datasets import ReplayDatasetTimestep
from replaybuf.sampling.prioritized import WeightedIndices
from tests._backends import make_place
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill

LENGTHS = (5, 3, 6)


@pytest.fixture(params=["zarr", "memory"])
def buffer(request, tmp_path):
    fields = {**FIELDS, "priority": "float"}
    place = make_place(request.param, tmp_path)
    buffer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=4,
        max_timesteps=8,
        fields=fields,
        meta_fields=META_FIELDS,
    )
    fill(buffer, LENGTHS)
    return buffer


def set_priorities(buffer, values: dict[tuple[int, int], float]) -> None:
    rows = np.zeros((len(LENGTHS), max(LENGTHS)), np.float32)
    for (e, t), p in values.items():
        rows[e, t] = p
    buffer.update(np.arange(len(LENGTHS)), priority=rows)


def drawn(loader) -> list[tuple[int, int]]:
    return [tuple(pair) for batch in loader for pair in batch["_indices"].tolist()]


def test_draws_only_prioritized_timesteps_with_weights(buffer):
    set_priorities(buffer, {(0, 1): 1.0, (2, 4): 4.0})
    loader = make_dataloader(buffer, 64, timestep_level=True, sampler="prioritized", alpha=1.0, beta=1.0, num_batches=4)
    batches = list(loader)
    assert len(batches) == 4
    pairs = drawn(batches)
    assert set(pairs) == {(0, 1), (2, 4)}
    assert 0.6 < pairs.count((2, 4)) / len(pairs) < 0.95
    for batch in batches:
        for (e, t), w, ident in zip(batch["_indices"].tolist(), batch["_weights"].tolist(), batch["ident"].tolist()):
            assert ident == 1000 * e + t
            assert w == pytest.approx(1.0 if (e, t) == (0, 1) else 0.25)
    assert batches[0]["_weights"].dtype == torch.float32


def test_alpha_zero_is_uniform_and_weights_are_one(buffer):
    set_priorities(buffer, {(0, 0): 5.0, (1, 2): 0.5})
    batch = next(iter(make_dataloader(buffer, 256, timestep_level=True, sampler="prioritized", alpha=0.0)))
    assert len(set(map(tuple, batch["_indices"].tolist()))) > 8
    assert torch.allclose(batch["_weights"], torch.ones(256))


def test_update_priorities_writes_back_and_steers_the_next_batch(buffer):
    set_priorities(buffer, {(0, 0): 1.0})
    loader = make_dataloader(buffer, 8, n_steps=2, sampler="prioritized", num_batches=3)
    batches = iter(loader)
    first = next(batches)
    assert set(drawn([first])) == {(0, 0)}
    update_priorities(buffer, torch.tensor([[0, 0], [2, 3]]), torch.tensor([0.0, 2.0]))
    assert buffer.data["priority"][0, 0] == 0.0 and buffer.data["priority"][2, 3] == 2.0
    second = next(batches)
    assert set(drawn([second])) == {(2, 3)}
    assert second["next_ident"].tolist() == [2005] * 8 and second["n_step_lens"].tolist() == [2] * 8
    fresh = make_dataloader(buffer, 8, timestep_level=True, sampler="prioritized", num_batches=1)
    assert set(drawn(fresh)) == {(2, 3)}


@pytest.mark.parametrize("rate", [{}, {"samples_per_insert": float("inf")}], ids=["plain", "rate-limited"])
def test_a_prioritized_loader_resumes_its_pass_with_the_next_batch_not_received(buffer, rate):
    """``state_dict()`` / ``load_state_dict()`` as for every other seeded loader: the plain one
    had neither, and a rate-limited one's state drew the whole pass again."""
    set_priorities(buffer, {(0, 1): 1.0, (1, 2): 2.0, (2, 4): 3.0, (2, 5): 0.5})

    def loader():
        return make_dataloader(buffer, 4, timestep_level=True, sampler="prioritized", seed=7, num_batches=5, **rate)

    uninterrupted = loader()
    full = [batch["_indices"].tolist() for batch in uninterrupted]
    second_pass = [batch["_indices"].tolist() for batch in uninterrupted]
    interrupted, resumed = loader(), loader()
    batches = iter(interrupted)
    received = [next(batches)["_indices"].tolist() for _ in range(2)]
    resumed.load_state_dict(interrupted.state_dict())
    assert received + [batch["_indices"].tolist() for batch in resumed] == full
    assert [batch["_indices"].tolist() for batch in resumed] == second_pass


def test_prioritized_with_workers(buffer):
    if buffer.storage.location.startswith("memory://"):
        pytest.skip("fork workers of a memory:// store are covered in test_sampling")
    set_priorities(buffer, {(1, 1): 1.0, (2, 5): 1.0})
    loader = make_dataloader(buffer, 16, timestep_level=True, sampler="prioritized", num_batches=4, num_workers=2)
    assert set(drawn(loader)) == {(1, 1), (2, 5)}


def test_bad_input(buffer):
    with pytest.raises(ValueError, match="shuffle cannot be combined"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", shuffle=True)
    with pytest.raises(ValueError, match="priority_field 'state' must hold one value per timestep"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", priority_field="state")
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", alpha=-1)
    set_priorities(buffer, {})
    with pytest.raises(ValueError, match="every priority in 'priority' is 0"):
        next(iter(make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized")))
    with pytest.raises(ValueError, match="shape \\(B, 2\\)"):
        update_priorities(buffer, [0, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 values for 1 indices"):
        update_priorities(buffer, [[0, 1]], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"finite and >= 0, got \[-1.0\] for \(episode, timestep\) \[\[0, 1\]\]"):
        update_priorities(buffer, [[0, 1]], [-1.0])
    with pytest.raises(ValueError, match=r"got \[nan\] for \(episode, timestep\) \[\[0, 2\]\]"):
        update_priorities(buffer, [[0, 1], [0, 2]], [1.0, float("nan")])
    with pytest.raises(ValueError, match="outside the committed episodes"):
        update_priorities(buffer, [[1, 3]], [1.0])


# ---- the write-back: scattered step edits in place ------------------------------------------

SCATTER_LENGTHS = [6, 3, 6, 1, 5, 6, 2, 6, 4, 6, 6, 3, 6, 5, 6, 6, 1, 6, 6, 2]


def _scatter_buffer(backend: str, tmp_path) -> ReplayBuffer:
    place = make_place(backend, tmp_path)
    buffer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=24,
        max_timesteps=6,
        fields={"state": ("float", 2), "priority": "float"},
    )
    for slot, n in enumerate(SCATTER_LENGTHS):
        buffer.store_episode(state=np.full((n, 2), slot, np.float32), priority=100.0 * slot + np.arange(n))
    return buffer


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5", "memory"])
def test_scattered_updates_land_where_asked_last_one_wins_and_stay_checked(backend, tmp_path, monkeypatch):
    """Pairs in any order, repeated ones included (the last value wins, as numpy assignment does
    and as the whole-episode rewrite this replaced did): exactly those steps change, the touched
    slots move to a new even revision, the others keep theirs, and whole-episode reads (checked against their crc32c)
    and ``verify`` agree. Zarr packs 8 priority rows a chunk and merges rows 1 apart only, so the
    edit spans several chunks and several spans within one."""
    from replaybuf.storage import _chunks, _zarr

    monkeypatch.setattr(_zarr, "PACKED_CHUNK_BYTES", 8 * 6 * 4)
    monkeypatch.setattr(_chunks, "_GAP_BYTES", 6 * 4)
    buffer = _scatter_buffer(backend, tmp_path)
    if backend == "zarr":
        assert buffer.storage.array("priority").chunks[0] == 8 and buffer.storage.array("priority").packed
    rng = np.random.default_rng(5)
    slots = rng.choice(len(SCATTER_LENGTHS), 60)
    pairs = np.stack([slots, rng.integers(0, np.array(SCATTER_LENGTHS)[slots])], 1)
    pairs = np.concatenate([pairs, pairs[[3, 7, 3]]])  # (3) and (7) named again, (3) twice more
    values = rng.random(len(pairs)) * 10
    revisions = buffer._meta["_revision"].copy()
    expected = np.zeros((len(SCATTER_LENGTHS), 6))
    for slot, n in enumerate(SCATTER_LENGTHS):
        expected[slot, :n] = 100.0 * slot + np.arange(n)
    for (slot, step), value in zip(pairs.tolist(), values.tolist()):
        expected[slot, step] = value
    update_priorities(buffer, torch.from_numpy(pairs), values)
    data = buffer.get_all_data()
    np.testing.assert_allclose(np.asarray(data["priority"]).reshape(len(SCATTER_LENGTHS), 6), expected, rtol=1e-6)
    assert np.asarray(data["state"])[:, :, 0].tolist() == [
        [slot if t < n else 0 for t in range(6)] for slot, n in enumerate(SCATTER_LENGTHS)
    ]
    touched = np.zeros(24, bool)
    touched[pairs[:, 0]] = True
    now = buffer._meta["_revision"]
    assert (now[touched] != revisions[touched]).all() and (now % 2 == 0).all()
    assert (now[~touched] == revisions[~touched]).all()
    if backend != "memory":
        buffer.close()
        assert verify(buffer.storage.location) == []
        again = ReplayBuffer.from_folder(buffer.storage.location, read_only=True, cache=False).get_all_data()
        np.testing.assert_allclose(np.asarray(again["priority"]).reshape(len(SCATTER_LENGTHS), 6), expected, rtol=1e-6)


def test_an_update_of_scattered_pairs_reads_and_writes_each_span_once(tmp_path, monkeypatch):
    """256 pairs over 100 packed episodes: two revision writes, one pwrite of the priority rows
    and one of their checksums (the whole-episode rewrite made one of each per run of slots)."""
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=100, max_timesteps=10, fields={"priority": "float"})
    for _ in range(100):
        buffer.store_episode(priority=np.ones(10))
    update_priorities(buffer, [[0, 0]], [1.0])  # the writes counted are of a second edit
    kv, writes = buffer.storage.kv, []
    write_at = kv.write_at
    monkeypatch.setattr(kv, "write_at", lambda key, *args: writes.append(key) or write_at(key, *args))
    rng = np.random.default_rng(0)
    update_priorities(buffer, np.stack([rng.integers(0, 100, 256), rng.integers(0, 10, 256)], 1), rng.random(256))
    assert sorted(writes) == sorted(
        ["meta/_revision/c.0", "data/priority/c.0.0", "replaybuf/checksums", "meta/_revision/c.0"]
    ), writes
    assert verify(str(tmp_path / "b")) == []


def test_update_steps_refuses_bad_input_before_writing(tmp_path):
    buffer = _scatter_buffer("zarr", tmp_path)
    before = {n: np.asarray(v).copy() for n, v in buffer.get_all_data().items()}
    one = np.array([0])
    cases = {
        "unknown field": (ValueError, "speed", lambda: buffer.update_steps(one, one, speed=[1.0])),
        "no data": (ValueError, "no data provided", lambda: buffer.update_steps(one, one)),
        "lengths differ": (ValueError, "of one length", lambda: buffer.update_steps([0, 1], one, priority=[1, 2])),
        "float indices": (ValueError, "int arrays", lambda: buffer.update_steps([0.5], one, priority=[1.0])),
        "step past the length": (
            ValueError,
            r"pairs \[\[1, 3\]\] are outside the committed episodes \(their episode_lens: \[3\]\)",
            lambda: buffer.update_steps([0, 1], [5, 3], priority=[1.0, 2.0]),
        ),
        "empty slot": (ValueError, "outside", lambda: buffer.update_steps([22], [0], priority=[1.0])),
        "negative step": (ValueError, "outside", lambda: buffer.update_steps([0], [-1], priority=[1.0])),
        "slot past the end": (
            ValueError,
            r"episodes \[24\] out of range - must be in \[0, 24\)",
            lambda: buffer.update_steps([24], [0], priority=[1.0]),
        ),
        "shape": (
            ValueError,
            r"does not broadcast to \(2, 2\)",
            lambda: buffer.update_steps([0, 2], [0, 1], state=np.ones((3, 2))),
        ),
        "strings": (TypeError, "field 'priority'", lambda: buffer.update_steps(one, one, priority=["x"])),
    }
    revisions = buffer._meta["_revision"].copy()
    for label, (error, message, call) in cases.items():
        with pytest.raises(error, match=message):
            call()
        assert (buffer._meta["_revision"] == revisions).all(), label
    after = buffer.get_all_data()
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[name]), value)
    buffer.update_steps(np.zeros(0, np.int64), np.zeros(0, np.int64), priority=np.zeros(0))  # nothing to do
    buffer.update_steps([4, 4], [0, 4], state=[[7.0], [8.0]], priority=np.float32(-1))  # broadcast
    assert np.asarray(buffer.data["state"][4, [0, 4]]).tolist() == [[7.0, 7.0], [8.0, 8.0]]
    assert np.asarray(buffer.data["priority"][4, :5]).tolist() == [-1.0, 401.0, 402.0, 403.0, -1.0]
    moved = buffer._meta["_revision"] != revisions
    assert moved.tolist() == [slot == 4 for slot in range(len(moved))] and buffer._meta["_revision"][4] % 2 == 0


def _damage_step(backend: str, location: str, slot: int, step: int) -> None:
    """Overwrite one stored priority of a closed buffer behind replaybuf's back."""
    if backend == "zarr":
        with open(f"{location}/data/priority/c.0.0", "r+b") as f:
            f.seek((slot * 6 + step) * 4)
            f.write(np.float32(999).tobytes())
    elif backend == "memmap":
        mapped = np.load(f"{location}/priority.data.npy", mmap_mode="r+")
        mapped[slot, step] = 999
        mapped.flush()
    else:
        import h5py

        with h5py.File(f"{location}/data.h5", "r+") as f:
            f["data/priority"][slot, step] = 999


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_an_edit_of_a_damaged_episode_is_refused_not_sealed(backend, tmp_path):
    """Other steps of an edited row are rewritten as read: a row failing its crc32c is refused
    (CorruptChunkError, nothing written) rather than sealed with new checksums over the damage."""
    from replaybuf import CorruptChunkError

    buffer = _scatter_buffer(backend, tmp_path)
    location = buffer.storage.location
    buffer.close()
    _damage_step(backend, location, 2, 4)
    assert any("slot 2" in p or "slots [2]" in p for p in verify(location))
    buffer = ReplayBuffer.from_folder(location)
    with pytest.raises(CorruptChunkError, match="slot 2"):
        update_priorities(buffer, [[0, 1], [2, 0]], [5.0, 6.0])
    assert np.asarray(buffer.data["priority"][0]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "nothing written"
    buffer.close()
    assert any("slot 2" in p or "slots [2]" in p for p in verify(location))


def test_a_slot_reused_after_the_loader_was_made_is_never_drawn(tmp_path):
    """A cached reader's loader whose snapshot slot a writer reuses before the first batch reads
    the priorities as of the snapshot: the reused slot's samples get priority 0 and are never
    drawn, nothing raises (the read cache refuses that slot's read, GenerationMismatchError,
    which reached the caller unhandled before), and the other samples keep their weights. Once
    every slot was reused, it raises SnapshotOverwrittenError, as a uniform loader's batch does
    (not "every priority is 0"; it gave batches of no samples, every pass)."""
    fields = {"ident": "int", "priority": "float"}
    writer = ReplayBuffer(tmp_path / "b", max_episodes=3, max_timesteps=4, fields=fields, circular=True)
    for index in range(3):
        writer.store_episode(ident=np.arange(4) + 10 * index, priority=np.ones(4))
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    loader = make_dataloader(reader, 8, timestep_level=True, sampler="prioritized", num_batches=4)
    # a second reader's, whose cache holds no file yet (the first's keeps serving the snapshot's
    # episodes it cached, after their slots are reused)
    other = ReplayBuffer.from_folder(tmp_path / "b", read_only=True, cache="disk", cache_dir=tmp_path / "other")
    gone = make_dataloader(other, 8, timestep_level=True, sampler="prioritized", num_batches=2)
    writer.store_episode(ident=np.arange(4) + 30, priority=np.full(4, 100.0))  # reuses slot 0
    batches = list(loader)
    pairs = drawn(batches)
    assert len(pairs) == 32 and {slot for slot, _ in pairs} == {1, 2}
    for batch in batches:
        assert (batch["ident"] == batch["_indices"][:, 0] * 10 + batch["_indices"][:, 1]).all()
        assert torch.allclose(batch["_weights"], torch.ones(8))
    for index in (4, 5):  # slots 1 and 2: every slot of the snapshot is reused
        writer.store_episode(ident=np.arange(4) + 10 * index, priority=np.ones(4))
    with pytest.raises(SnapshotOverwrittenError, match="make a new loader"):
        list(gone)


def test_a_prioritized_sample_whose_slot_is_reused_during_its_batch_is_left_out_not_replaced(tmp_path):
    """A sample of a prioritized batch whose slot a writer reuses while the batch is read is left
    out: one drawn in its place (uniformly) carried its importance weight, and could be a sample
    of priority 0. (memmap: zarr's in-RAM copies of the snapshot would serve the batch as of the
    snapshot, reading nothing again.)"""
    fields = {"ident": "int", "priority": "float"}
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=3, max_timesteps=4, fields=fields, circular=True, backend="memmap"
    )
    for index in range(3):
        writer.store_episode(ident=np.arange(2) + 10 * index, priority=np.full(2, 2.0**index))
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    dataset = ReplayDatasetTimestep(reader, return_indices=True)
    writer.store_episode(ident=np.arange(2) + 30, priority=np.zeros(2))  # reuses slot 0
    # positions 0 and 2: steps (0, 0) and (1, 0), drawn with these weights
    batch = dataset.__getitems__(WeightedIndices([0, 2], np.array([0.25, 1.0], np.float32))).batch
    assert batch["_indices"].tolist() == [[1, 0]] and batch["ident"].tolist() == [10]
    assert batch["_weights"].tolist() == [1.0] and batch["_generations"].tolist() == [2]
    again = dataset.__getitems__(WeightedIndices([1, 3], np.array([0.25, 1.0], np.float32))).batch
    assert again["_indices"].tolist() == [[1, 1]], "a slot found reused is left out of later batches too"
