"""The read loaders attacked as a training user and a racing writer would: a writer process
reusing every slot of a small circular buffer while read-only loaders of every kind iterate,
a loader whose whole snapshot a writer overwrote, a buffer holding only empty episodes, the
optimistic read's last retry, and arguments torch only failed on at the first batch. Every
sample must be one whole committed episode's data, and every failure a clear error made when
the loader is, never a decode error the writer caused or an empty batch."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from replaybuf import ConcurrentWriteError, MetaChecksumError, ReplayBuffer
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.consistency import RETRIES, committed_generations, read_consistent
from replaybuf.maintenance import verify
from replaybuf.sampling import ReplayDatasetTimeWindow, SnapshotOverwrittenError, make_dataloader
from tests._backends import LOCAL_BACKENDS, make_place
from tests._data import SAMPLING_FIELDS, SAMPLING_META_FIELDS
from tests._data import fill_sampling_buffer as fill

# every step of episode k holds k (state, reward) and 1000 * k + t (ident): a sample names its episode
FIELDS = {"state": ("float", 3), "reward": "float", "ident": "int"}
META = {"task": "int"}
MAX_EPISODES, MAX_TIMESTEPS = 5, 12
N_STEPS, WINDOW = 3, 5
WRITTEN = 1500  # episodes the writer process commits: each slot reused 300 times
# hdf5 commits an episode ~8x slower than zarr and memmap: a third as many still race its readers
# for longer (~3 s) than the other backends' whole runs
WRITTEN_BY_BACKEND = {"hdf5": 500}


def length_of(k: int) -> int:
    """Episode k's length: 1 .. MAX_TIMESTEPS, neighbours differing."""
    return 1 + (7 * k) % MAX_TIMESTEPS


def episode(k: int) -> dict[str, np.ndarray]:
    n = length_of(k)
    return {
        "state": np.full((n, 3), k, np.float32),
        "reward": np.full(n, k, np.float32),
        "ident": 1000 * k + np.arange(n),
    }


def _write(folder: str, first: int, count: int) -> None:
    """The writer process: episodes first .. first + count - 1 into the circular buffer."""
    writer = ReplayBuffer.from_folder(folder)
    for k in range(first, first + count):
        writer.store_episode(**episode(k), task=k)
    writer.close()


def check_trajectories(batch) -> None:
    for ident, state, length, task in zip(
        batch["ident"].tolist(), batch["state"], batch["_lens"].tolist(), batch["task"].tolist()
    ):
        k = ident[0] // 1000
        assert (length, task) == (length_of(k), k)
        assert ident == [1000 * k + t for t in range(length)] + [0] * (len(ident) - length)
        assert (state[:length] == k).all() and (state[length:] == 0).all()


def check_timesteps(batch) -> None:
    for ident, state, reward, task in zip(
        batch["ident"].tolist(), batch["state"], batch["reward"].tolist(), batch["task"].tolist()
    ):
        k, t = divmod(ident, 1000)
        assert t < length_of(k) and (state == k).all() and reward == k and task == k


def check_transitions(batch) -> None:
    for ident, following, actual, sequence, task in zip(
        batch["ident"].tolist(),
        batch["next_ident"].tolist(),
        batch["n_step_lens"].tolist(),
        batch["seq_reward"].tolist(),
        batch["task"].tolist(),
    ):
        k, t = divmod(ident, 1000)
        assert actual == min(N_STEPS, length_of(k) - t - 1) >= 1
        assert following == ident + actual and task == k
        assert sequence == [k] * actual + [0] * (N_STEPS - actual)


def check_windows(batch) -> None:
    for ident, length, at_end, task in zip(
        batch["ident"].tolist(), batch["_lens"].tolist(), batch["_reaches_episode_end"].tolist(), batch["task"].tolist()
    ):
        k, start = divmod(ident[0], 1000)
        assert length == min(WINDOW, length_of(k)) and task == k
        assert ident == [ident[0] + j for j in range(length)] + [0] * (WINDOW - length)
        assert at_end == (start + length >= length_of(k))


def read_every_kind(reader: ReplayBuffer) -> int:
    """One pass of each loader kind over ``reader``, every sample checked; the samples read.
    A loader whose whole snapshot the writer overwrote meanwhile says so and is left."""
    loaders = [
        (lambda: make_dataloader(reader, 4, shuffle=True), check_trajectories),
        (lambda: make_dataloader(reader, 16, timestep_level=True, shuffle=True), check_timesteps),
        (lambda: make_dataloader(reader, 16, n_steps=N_STEPS, sequence_fields=["reward"]), check_transitions),
    ]
    samples = 0
    for make, check in loaders:
        try:
            for batch in make():
                assert len(batch["task"]) > 0
                check(batch)
                samples += len(batch["task"])
        except SnapshotOverwrittenError:
            pass
    windows = ReplayDatasetTimeWindow(reader, WINDOW)
    try:
        batch = windows.__getitems__(list(range(len(windows)))).batch
    except SnapshotOverwrittenError:
        return samples
    check_windows(batch)
    return samples + len(batch["task"])


def test_a_snapshot_missing_every_long_enough_episode_to_a_writer_is_taken_again(tmp_path, monkeypatch):
    """A reader's refresh leaves out the slots a writer changes while it loads them. When that
    leaves a dataset none of the episodes it needs (an n-step one needs 2 steps, the buffer
    lists only a 1-step one although its counters count more), the snapshot is loaded again,
    not refused as if the buffer held no long enough episode (the writer-beside race of the
    test above, once in a few thousand snapshots)."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(
        location, max_episodes=MAX_EPISODES, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META
    )
    for k in (0, 1):  # 1 and 8 steps
        writer.store_episode(**episode(k), task=k)
    writer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    refresh, loads = reader.refresh, []

    def slot_1_in_flux_at_first(*args, **kwargs):  # as a writer rewriting slot 1 during the load leaves it
        out = refresh(*args, **kwargs)
        loads.append(len(loads))
        if len(loads) == 1:
            reader._meta["episode_lens"][1] = 0
        return out

    monkeypatch.setattr(reader, "refresh", slot_1_in_flux_at_first)
    batch = next(iter(make_dataloader(reader, 4, n_steps=N_STEPS, return_indices=True)))
    assert len(loads) == 2 and set(batch["_indices"][:, 0].tolist()) == {1}
    monkeypatch.setattr(reader, "refresh", lambda *args, **kwargs: None)  # a buffer that holds no such episode
    reader._meta["episode_lens"][1] = 0
    with pytest.raises(ValueError, match="no episode has at least 2 timesteps"):
        make_dataloader(reader, 4, n_steps=N_STEPS)


def filled_circular(place, first: int) -> None:
    """A full circular buffer at ``place``: episodes ``first ..`` with ``task`` their number."""
    writer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=MAX_EPISODES,
        max_timesteps=MAX_TIMESTEPS,
        fields=FIELDS,
        meta_fields=META,
        circular=True,
    )
    for k in range(first, first + MAX_EPISODES):
        writer.store_episode(**episode(k), task=k)
    writer.close()


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_loaders_beside_a_writer_reusing_every_slot_read_whole_episodes_and_never_fail(tmp_path, backend):
    """A writer process cycles a 5-slot circular buffer thousands of times while read-only
    loaders of every kind iterate. Before: the memmap backend raised EpisodeLengthError
    ("slot 1 holds 0 steps ... the length is damaged") for a slot the writer was reusing, or
    ConcurrentWriteError naming no slot ("slots []") on the batch read's last retry; every
    backend raised "replay buffer is empty" when a snapshot found every slot being rewritten."""
    place = make_place(backend, tmp_path)
    filled_circular(place, first=0)
    written = WRITTEN_BY_BACKEND.get(backend, WRITTEN)
    process = multiprocessing.get_context("fork").Process(target=_write, args=(place.location, MAX_EPISODES, written))
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    process.start()
    samples = 0
    try:
        while process.is_alive():
            samples += read_every_kind(reader)
    finally:
        process.join(timeout=120)
    assert process.exitcode == 0 and samples > 0
    reader.refresh()
    assert sorted(reader.meta_data["task"][:]) == list(range(written, written + MAX_EPISODES))
    assert read_every_kind(reader) > 0


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_a_weighted_mixture_beside_a_writer_reusing_every_slot_of_one_member_is_made_every_time(tmp_path, backend):
    """Before: a snapshot that found every slot of the live member being rewritten left that
    member without samples (the refresh was retried only for a whole buffer found empty), and
    a weighted loader was refused: "weights: buffers [0] have a weight > 0 but no sample to
    draw (after filter_meta)"."""
    folders = []
    for name, first in (("live", 0), ("static", 100)):
        place = make_place(backend, tmp_path, name)
        filled_circular(place, first)
        folders.append(place.location)
    process = multiprocessing.get_context("fork").Process(target=_write, args=(folders[0], MAX_EPISODES, 2 * WRITTEN))
    readers = [ReplayBuffer.from_folder(folder, read_only=True) for folder in folders]
    process.start()
    loaders = 0
    try:
        while process.is_alive():
            mixture = ConcatReplayBuffer(readers, weights=[0.5, 0.5])
            try:
                for batch in make_dataloader(mixture, 8, timestep_level=True, num_batches=2):
                    check_timesteps(batch)
            # a batch whose redraws within the live member (its share) land on slots the writer
            # is rewriting, read after read, is retryable; seen once in ~10 runs under load
            except (SnapshotOverwrittenError, ConcurrentWriteError):
                pass
            loaders += 1
    finally:
        process.join(timeout=120)
    assert process.exitcode == 0 and loaders > 0


class ReusedDuringTheCopy(np.ndarray):
    """A field's mapped file whose slot ``reused`` a writer starts reusing (its first step:
    the slot's length zeroed in the live map ``lengths``, its generation and data still the
    old episode's) while a reader copies every committed row of the field at once."""

    lengths: np.ndarray
    reused: int

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.ndim == 1 and len(key) > 1:
            self.lengths[self.reused] = 0
        return super().__getitem__(key)


def test_a_slot_a_writer_starts_reusing_while_its_field_is_copied_is_not_reported_damaged(tmp_path):
    """Before: the memmap reader's check of a field's committed rows looked at the live lengths
    twice and checked slot 1's old episode at the length 0 the writer had just written:
    EpisodeLengthError "slot 1 holds 0 steps ... the length is damaged", while the slot's
    generation still read unchanged, so the batch raised it instead of reading again."""
    place = make_place("memmap", tmp_path)
    writer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META
    )
    for k in range(3):
        writer.store_episode(**episode(k), task=k)
    writer.close()
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    storage = reader.storage
    lengths = np.array(reader.episode_lens)
    mapped = storage.array("reward").plain.view(ReusedDuringTheCopy)
    mapped.lengths, mapped.reused = lengths, 1
    rows = storage._checksums.gather("reward", mapped, np.array([1, 2]), np.array([0, 0]), lengths)
    assert lengths[1] == 0  # the writer's first step happened during the read
    assert rows.tolist() == [1.0, 2.0]  # the old episode, whose generation and data are still stored


def test_the_last_retry_dropping_every_item_returns_them_dropped_not_an_error(tmp_path):
    """Before: when the read of the last retry failed and every item's slot had moved (a
    loader's batch whose snapshot slots a writer had all reused), read_consistent raised
    ConcurrentWriteError naming no slot ("slots []") instead of returning them dropped."""
    place = make_place("memmap", tmp_path)
    writer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META
    )
    writer.store_episode(**episode(0), task=0)
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    stored = int(committed_generations(reader, np.array([0]))[0])

    def read(items: np.ndarray) -> None:
        raise OSError("a decode error of a slot being rewritten")

    for exhausted in ("drop", "raise"):
        # the slot moves under every read (a planned generation it no longer holds); the re-plan
        # after the last read has no episode left to draw
        plans = iter([stored + 1] * RETRIES + [-1])

        def replan(items: np.ndarray, plans=plans) -> tuple[np.ndarray, np.ndarray]:
            return np.zeros(len(items), np.int64), np.full(len(items), next(plans))

        kept = read_consistent(
            reader, np.array([0]), np.array([stored + 1]), read, replan, whole=True, exhausted=exhausted
        )
        assert kept.tolist() == [False] and next(plans, None) is None  # every retry was made
    writer.close()


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_whose_whole_snapshot_was_overwritten_says_so_instead_of_empty_batches(tmp_path, backend, workers):
    """Before: once a writer had reused every slot of a loader's snapshot, the memmap and hdf5
    loaders returned batches of no samples for the rest of every pass (a training loop's loss
    over them is NaN). A backend keeping checked copies of the snapshot (zarr's small fields,
    loaded before the writer reused the slots) may still serve its episodes; never others."""
    place = make_place(backend, tmp_path)
    writer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=4,
        max_timesteps=10,
        fields=SAMPLING_FIELDS,
        meta_fields=SAMPLING_META_FIELDS,
        circular=True,
    )
    fill(writer, (3, 4, 5, 6))
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    # a spawned worker, a batch in flight: the batches after the first two are read after the
    # reuse (one worker: each spawned one imports torch anew, and each checks its snapshot alone)
    options = {"num_workers": workers, "multiprocessing_context": "spawn", "prefetch_factor": 1} if workers else {}
    kinds = [{"timestep_level": True}] if workers else [{}, {"timestep_level": True}, {"n_steps": 2}]
    for first, kind in enumerate(kinds):
        snapshot = set(range(10 * first, 10 * first + 4))  # the episodes stored when the loader is made
        batches = iter(make_dataloader(reader, 1, **kind, **options))
        next(batches)
        fill(writer, (3, 4, 5, 6), start=10 * (first + 1))  # every slot reused
        writer.flush()
        try:
            for batch in batches:
                assert len(batch["ident"]) == 1
                assert set((batch["ident"].flatten() // 1000).tolist()) <= snapshot
        except SnapshotOverwrittenError as error:
            assert "episodes this loader's snapshot" in str(error) and "make a new loader" in str(error)
        else:
            assert backend == "zarr"
    writer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_prioritized_loader_whose_whole_snapshot_was_overwritten_says_so_instead_of_empty_batches(tmp_path, backend):
    """Before: the prioritized sampler of a loader whose every slot a writer had reused yielded
    batches of no samples, for the rest of the pass and every pass after, where a uniform loader
    raises SnapshotOverwrittenError."""
    place = make_place(backend, tmp_path)
    writer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=2,
        max_timesteps=MAX_TIMESTEPS,
        fields={**FIELDS, "priority": ("float", (), 1.0)},
        circular=True,
    )
    for k in range(2):
        writer.store_episode(**episode(k))
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    loader = make_dataloader(reader, 1, timestep_level=True, sampler="prioritized", num_batches=2, seed=0)
    batches = iter(loader)
    assert len(next(batches)["ident"]) == 1
    for k in range(2, 4):  # every slot reused
        writer.store_episode(**episode(k))
    writer.flush()
    # the pass's last batch finds its one slot reused: left out (the other slot is not known reused yet)
    assert [len(batch["ident"]) for batch in batches] == [0]
    with pytest.raises(SnapshotOverwrittenError, match="episodes this loader's snapshot .* make a new loader"):
        next(iter(loader))  # the next pass
    writer.close()


def test_a_buffer_of_empty_episodes_says_what_it_holds(tmp_path):
    """A buffer whose committed episodes have no step: the error says how many it counts,
    which a writer rewriting every slot while a loader loads can also cause."""
    place = make_place("zarr", tmp_path)
    writer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=6, fields=FIELDS, meta_fields=META
    )
    writer.store_meta_batch(task=np.array([7, 8]))
    writer.advance_episode(2)
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    for source, why in ((writer, "each empty"), (reader, "each empty, or rewritten by a writer")):
        assert source.num_episodes == 2
        with pytest.raises(
            ValueError, match=rf"replay buffer is empty: of its 2 committed episodes none has a step \({why}"
        ):
            make_dataloader(source, 2)
    empty = ReplayBuffer(str(tmp_path / "empty"), max_episodes=2, max_timesteps=3, fields=FIELDS)
    with pytest.raises(ValueError, match=r"^replay buffer is empty: .* holds no committed episode; store episodes"):
        make_dataloader(empty, 2)
    writer.close()


@pytest.mark.parametrize("damaged", [2, MAX_TIMESTEPS])
def test_a_damaged_length_on_zarr_is_named_and_restored_not_blamed_on_the_data(tmp_path, damaged):
    """Before: on zarr, a length changed within [1, max_timesteps] made the loader raise
    CorruptChunkError "data/reward: slot 1 ... episode fails its crc32c", and `verify --repair`
    dropped the sound episode; memmap and hdf5 named the length and restored it. From format 5
    the open refuses it first, naming the length the slot's meta checksum matches."""
    import zarr

    place = make_place("zarr", tmp_path)
    writer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META
    )
    for k in (1, 2, 3):  # lengths 8, 3, 10: slot 1 holds 3 steps
        writer.store_episode(**episode(k), task=k)
    writer.close()
    zarr.open_group(place.location, mode="r+")["meta/episode_lens"][1] = damaged
    with pytest.raises(MetaChecksumError, match=rf"meta/episode_lens: slot 1: holds {damaged}, but .* matches 3") as e:
        ReplayBuffer.from_folder(place.location, read_only=True)
    assert (e.value.slot, e.value.restore, e.value.field) == (1, ("episode_lens", length_of(2)), "meta/episode_lens")
    problems = verify(place.location, repair=True)
    assert problems[-1].startswith(f"repaired: restored meta/episode_lens of slot 1 to {length_of(2)}, which its")
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    batch = next(iter(make_dataloader(reader, 4)))
    check_trajectories(batch)
    assert sorted(batch["task"].tolist()) == [1, 2, 3]


@pytest.fixture
def small(tmp_path):
    place = make_place("zarr", tmp_path)
    buffer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields=META
    )
    for k in range(3):
        buffer.store_episode(**episode(k), task=k)
    yield buffer
    buffer.close()


def test_a_numpy_batch_size_is_taken(small):
    """Before: ValueError "batch_size must be an int >= 1, got np.int64(2)"."""
    batch = next(iter(make_dataloader(small, np.int64(2), timestep_level=True)))
    assert len(batch["ident"]) == 2
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got np.int64\(0\)"):
        make_dataloader(small, np.int64(0))


def test_a_cuda_device_this_machine_lacks_is_refused_when_the_loader_is_made(small):
    """Before: the loader was made, and its first batch failed inside torch (an AssertionError
    "Torch not compiled with CUDA enabled", or an invalid device ordinal)."""
    with pytest.raises(ValueError, match=r"device: 'cuda:99', but (no CUDA device is available|this machine has)"):
        make_dataloader(small, 2, device="cuda:99")


def test_a_sampler_that_is_not_iterable_is_refused_when_the_loader_is_made(small):
    """Before: TypeError "'object' object is not iterable" from inside torch at the first batch."""
    with pytest.raises(TypeError, match=r"sampler must be one of \['uniform', 'prioritized'\] or a torch Sampler"):
        make_dataloader(small, 2, sampler=object())


def test_a_sampler_of_numpy_positions_is_taken_as_torch_takes_it(small):
    """Before: ValueError "The truth value of an array with more than one element is ambiguous"
    from comparing the array with the sampler names."""
    order = [2, 0, 1]
    for positions in (np.array(order), torch.tensor(order), order):
        batches = make_dataloader(small, 2, sampler=positions)
        assert [batch["task"].tolist() for batch in batches] == [[2, 0], [1]]
