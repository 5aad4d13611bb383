"""Call-for-call parity with memmap-replay-buffer 0.2.3 beyond the state machine of
test_differential.py: the seed's lesser-used calls and arguments (store()'s return value and
None values, the batched datapoint writes, ``reset_``, ``internal_meta_fieldnames``,
``min_episode_len`` of the datasets, ReplayBufferH5PY's attributes and folders, numpy methods
and operators on ``data`` / ``meta_data``, the next slot after a reopen), each run on both
libraries and compared."""

from __future__ import annotations

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch

import replaybuf

from ._backends import LOCAL_BACKENDS, require, snapshot
from ._compare import assert_same
from ._h5outside import KINDS as OUTSIDE_KINDS
from ._h5outside import replace_with_outside

FIELDS = {"obs": ("float", 2, 1.5), "act": "int", "done": "bool"}
META = {"label": ("int", (), 3)}


def pair(tmp_path, **kwargs):
    """The seed's buffer and replaybuf's, same arguments, two folders, three episodes of 2, 3, 4 steps."""
    args = dict(max_episodes=4, max_timesteps=5, fields=FIELDS, meta_fields=META, **kwargs)
    buffers = seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)
    for buffer in buffers:
        for e in range(3):
            for t in range(e + 2):
                buffer.store(obs=[float(e), float(t)], act=10 * e + t, done=t == e + 1)
            buffer.advance_episode()
    return buffers


def test_store_returns_values_as_given_and_none_means_the_default(tmp_path):
    theirs, ours = pair(tmp_path)
    for given in (
        dict(obs=torch.ones(2), act=torch.tensor(3)),  # tensors come back as tensors
        dict(obs=[1.0, 2.0], act=np.int64(4), done=True),  # a list as given, scalars as arrays
        dict(obs=None, act=None),  # None: the field's default, as a missing field
        dict(),
    ):
        assert_same(ours.store(**given), theirs.store(**given), f"store({given})")
    assert ours.store().obs.flags.writeable and theirs.store().obs.flags.writeable  # fresh, not the default's
    for buffer in (theirs, ours):
        buffer.advance_episode()
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    assert ours.get_all_data()["obs"][3, 2].tolist() == [1.5, 1.5]


def test_batched_datapoint_writes_match_the_seed(tmp_path):
    theirs, ours = pair(tmp_path)
    for buffer in (theirs, ours):
        buffer.store_batch_datapoint(np.array([0, 2]), 1, "act", np.array([7, 8]))
        buffer.store_batch_datapoint(np.array([1, 2]), 0, "obs", np.array([5.0, 6.0]))  # broadcast as numpy does
        buffer.store_batch_datapoint(np.array([1, 1]), 2, "act", np.array([3, 4]))  # a repeated slot: last wins
        buffer.store_batch_meta_datapoint(np.array([0, 2]), "label", torch.tensor([1, 2]))
        buffer.store_batch_meta_datapoint(np.array([1]), "label", 9)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: b.store_batch_datapoint(np.array([0, 4]), 0, "act", 1), "episode_index 4"),
        (lambda b: b.store_batch_datapoint(np.array([0]), 5, "act", 1), "timestep_index 5"),
        (lambda b: b.store_batch_datapoint(np.array([0, 1]), 0, "obs", np.ones(3)), "'obs'.*broadcast"),
        (lambda b: b.store_batch_datapoint(np.array([0, 1]), 0, "label", 1), r"invalid field names \['label'\]"),
        (lambda b: b.store_batch_meta_datapoint(np.array([0.5]), "label", 1), "ints"),
        (lambda b: b.store_batch_meta_datapoint(np.array([0, 1]), "act", 1), r"invalid meta field names \['act'\]"),
    ],
)
def test_batched_datapoint_writes_refuse_bad_input_and_change_nothing(tmp_path, call, match):
    _, ours = pair(tmp_path)
    before = ours.get_all_data()
    with pytest.raises(ValueError, match=match):
        call(ours)
    assert_same(ours.get_all_data(), before, "after a refused write")


def test_reset_is_clear_and_internal_meta_fieldnames_names_the_bookkeeping(tmp_path):
    theirs, ours = pair(tmp_path)
    assert {n for n in ours.meta_data if n not in ours.internal_meta_fieldnames} == {"label"}
    assert {n for n in theirs.meta_data if n not in theirs.internal_meta_fieldnames} == {"label"}
    for buffer in (theirs, ours):
        buffer.reset_()
        buffer.store(act=1)
        buffer.advance_episode()
    assert (ours.num_episodes, ours.episode_index, len(ours)) == (theirs.num_episodes, theirs.episode_index, 1)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data after reset_")
    ours.close()
    reader = replaybuf.ReplayBuffer.from_folder(ours.folder, read_only=True)
    with pytest.raises(ValueError, match="cannot call `reset_` on a buffer opened read-only"):  # not `clear`
        reader.reset_()
    collector = reader.create_collector(1)
    collector.append(act=[1])
    with pytest.raises(ValueError, match="cannot call `EpisodeCollector.store` on a buffer opened read-only"):
        collector.store()  # it named the batched_episode it writes through
    assert len(collector) == 1  # the rollout is kept


@pytest.mark.parametrize("every", [0, 1, 2, True, False])
def test_store_step_and_should_flush_count_as_the_seed(tmp_path, every):
    """``store_step`` counts the ``store()`` calls made through the object (not batches, whole
    episodes or a clear); ``should_flush`` says whether stores are flushed at all (True / False
    for ``flush_every_store_step`` are the seed's 1 / 0)."""
    theirs, ours = pair(tmp_path, flush_every_store_step=every, circular=True)
    seen = []
    for buffer in (theirs, ours):
        counts = [buffer.store_step, buffer.should_flush, buffer.flush_every_store_step]
        buffer.store_episode(act=np.arange(2))
        buffer.store_batch(act=np.array([1, 2]))
        buffer.advance_episode(2)
        counts.append(buffer.store_step)
        buffer.clear()
        buffer.store(act=3)
        counts.append(buffer.store_step)
        seen.append(counts)
    assert seen[1] == seen[0] == [9, every > 0, every, 9, 10]


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """One pair for the tests that only read."""
    return pair(tmp_path_factory.mktemp("filled"))


def items(dataset) -> list:
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize(
    "make",
    [
        lambda lib, b: items(lib.ReplayDatasetTrajectory(b, min_episode_len=3)),
        lambda lib, b: items(lib.ReplayDatasetTimestep(b, min_episode_len=4, return_indices=True)),
        lambda lib, b: len(lib.ReplayDatasetTimeWindow(b, window_length=2, min_episode_len=3)),
        lambda lib, b: items(b.dataset(min_episode_len=3, fields=("act",))),
        lambda lib, b: list(b.dataloader(2, dataset_kwargs=dict(min_episode_len=3))),
        lambda lib, b: list(b.dataloader(2, timestep_level=True, dataset_kwargs=dict(min_episode_len=4))),
    ],
)
def test_min_episode_len_of_the_datasets(filled, make):
    theirs, ours = filled
    assert_same(make(replaybuf, ours), make(seed, theirs), "dataset")


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_min_episode_len_must_be_a_positive_int(filled, value):
    _, ours = filled
    with pytest.raises(ValueError, match=f"min_episode_len must be an int >= 1, got {value!r}"):
        ours.dataset(min_episode_len=value)


@pytest.mark.parametrize(
    "make",
    [
        lambda lib, b: b.dataset(),
        lambda lib, b: b.dataset(timestep_level=True, fieldname_map={"label": "task"}),
        lambda lib, b: lib.ReplayDatasetNStep(b, n_steps=1, include_metadata=False),
        lambda lib, b: lib.ReplayDatasetTimeWindow(b, window_length=2),
    ],
)
def test_datasets_meta_data_holds_the_meta_fields_they_return(filled, make):
    theirs, ours = filled
    expected = {name: np.asarray(values) for name, values in make(seed, theirs).meta_data.items()}
    assert_same({name: np.asarray(values) for name, values in make(replaybuf, ours).meta_data.items()}, expected)


def test_collector_step_count_counts_the_steps_as_the_seed(tmp_path):
    counts = []
    for lib in (seed, replaybuf):
        buffer = lib.ReplayBuffer(tmp_path / lib.__name__, max_episodes=4, max_timesteps=5, fields=FIELDS)
        collector = buffer.create_collector(2)
        seen = [collector.step_count]
        collector.append(act=torch.tensor([1, 2]))
        collector.append(act=torch.tensor([3, 4]))
        seen.append(collector.step_count)
        collector.store()
        seen.append(collector.step_count)
        collector.extend(act=torch.zeros(3, 2))
        seen.append(collector.step_count)
        counts.append(seen)
    assert counts[1] == counts[0] == [0, 2, 0, 3]


def test_a_dataset_reads_its_snapshot_where_the_seed_reads_its_slots_live(tmp_path):
    """README: a sample whose slot was reused after the dataset was made is another episode of
    the snapshot (``_index`` names it); the seed's gives the slot's new episode."""
    args = dict(max_episodes=3, max_timesteps=5, fields=FIELDS, circular=True)
    read = {}
    for lib in (seed, replaybuf):
        buffer = lib.ReplayBuffer(tmp_path / lib.__name__, **args)
        for e in range(3):
            buffer.store_episode(act=np.full(e + 1, e))
        dataset = buffer.dataset(fields=("act",), return_indices=True)
        buffer.store_episode(act=np.full(5, 9))  # into slot 0
        read[lib] = [(int(item["_index"]), item["act"].tolist()) for item in items(dataset)]
    assert read[seed] == [(0, [9] * 5), (1, [1, 1]), (2, [2, 2, 2])]
    assert read[replaybuf][1:] == read[seed][1:]
    assert read[replaybuf][0] in read[seed][1:]


def test_h5py_buffer_attributes_match_the_seed(tmp_path):
    require("h5py")
    import h5py

    args = dict(
        max_episodes=2, max_timesteps=3, fields={"x": "float"}, h5py_compression="gzip", h5py_compression_opts=4
    )
    theirs = seed.ReplayBufferH5PY(tmp_path / "seed", **args)
    ours = replaybuf.ReplayBufferH5PY(tmp_path / "ours", **args)
    for buffer in (theirs, ours):
        buffer.store(x=1.0)
        buffer.advance_episode()
        assert (buffer.h5py_compression, buffer.h5py_compression_opts) == ("gzip", 4)
        assert buffer.h5_path == buffer.folder / "data.h5"
        with h5py.File(buffer.h5_path, "r") as file:  # the file opens next to the buffer
            assert len(file) > 0
    reopened = replaybuf.ReplayBufferH5PY.from_folder(tmp_path / "ours", read_only=True)
    assert (reopened.h5py_compression, reopened.h5py_compression_opts) == ("gzip", 4)  # as created
    plain = replaybuf.ReplayBufferH5PY(tmp_path / "plain", 2, 3, fields={"x": "float"})
    assert (plain.h5py_compression, plain.h5py_compression_opts) == (None, None)


@pytest.mark.parametrize(
    "created, reopened",
    [
        (dict(h5py_compression="gzip"), dict(h5py_compression="gzip")),
        (dict(h5py_compression="lzf"), dict(h5py_compression="lzf", read_only=True)),
        (dict(h5py_compression="gzip"), dict()),
        (dict(), dict(h5py_compression="lzf")),
        (
            dict(h5py_compression="gzip", h5py_compression_opts=4),
            dict(h5py_compression="gzip", h5py_compression_opts=5),
        ),
        (dict(h5py_compression="lzf"), dict(h5py_compression="gzip", read_only=True)),
    ],
)
def test_a_reopen_with_another_h5py_compression_raises_as_the_seed(tmp_path, created, reopened):
    """The seed's config holds the compression: ``ReplayBufferH5PY(path, ..., overwrite=False)``
    with another one raises its ValueError; here it opened, silently keeping the stored one.
    A refused reopen changes no file."""
    require("h5py")
    args = dict(max_episodes=2, max_timesteps=3, fields={"x": "float"})
    outcomes = []
    for lib in (seed, replaybuf):
        path = tmp_path / lib.__name__
        lib.ReplayBufferH5PY(path, **args, **created).store_episode(x=np.ones(2))
        before = snapshot(str(path))
        try:
            buffer = lib.ReplayBufferH5PY(path, **args, **reopened, overwrite=False)
        except ValueError as error:
            outcomes.append(str(error).splitlines()[1])
            assert snapshot(str(path)) == before
        else:
            outcomes.append(buffer.num_episodes)
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize("call", ["reset_", "store_batch_datapoint", "store_batch_meta_datapoint"])
def test_concat_refuses_the_seed_write_calls_as_the_seed(filled, call):
    _, ours = filled
    concat = replaybuf.ConcatReplayBuffer([ours.folder])
    with pytest.raises(NotImplementedError, match=f"`{call}`"):
        getattr(concat, call)()


VIEW_EXPRESSIONS = [
    "d.size",
    "d.copy()",
    "d.sum()",
    "d.max()",
    "d.astype(np.float64)",
    "d.reshape(-1)",
    "d.T.shape",
    "d + 1",
    "-d",
    "d[1] * 2 == 2 * d[1]",
    "m == 3",
    "3 == m",
    "m > 2",
    "m.sum()",
    "m.tolist()",
    "d[m > 2].shape",
    "np.add(d, m[:, None, None])",
]


@pytest.mark.parametrize("expression", VIEW_EXPRESSIONS)
def test_data_and_meta_views_answer_like_the_seed_memmaps(filled, expression):
    """``buffer.data[name]`` / ``meta_data[name]`` take numpy's methods and operators as the
    seed's memmaps do: ``meta_data['label'] == 3`` was an identity comparison (False)."""
    theirs, ours = filled
    results = [
        eval(expression, {"np": np, "d": b.data["obs"], "m": b.meta_data["label"]})  # noqa: S307 - fixed texts
        for b in (ours, theirs)
    ]
    ours_value, seed_value = (np.asarray(r) if isinstance(r, np.ndarray) else r for r in results)
    assert_same(ours_value, seed_value, expression)


def test_views_refuse_in_place_operators_and_unknown_attributes(filled):
    _, ours = filled
    view = ours.data["act"]
    before = ours.get_all_data()
    with pytest.raises(TypeError, match=r"<data act .*in-place operator \(add into the view\).*nothing was written"):
        view += 1
    with pytest.raises(TypeError, match=r"<meta label .*in-place operator \(multiply into the view\)"):
        label = ours.meta_data["label"]
        label *= 2
    with pytest.raises(AttributeError, match="'DataView' object has no attribute 'nope'"):
        view.nope  # noqa: B018
    assert_same(ours.get_all_data(), before, "after a refused in-place add")
    assert hash(view) == hash(view) and view in {view}  # still hashable (by identity)


@pytest.mark.parametrize("module", ["replay_buffer", "replay_buffer_h5py", "episode_collector", "concat_replay_buffer"])
def test_the_seeds_submodules_import_under_replaybuf(module):
    """``from memmap_replay_buffer.replay_buffer import ReplayBuffer`` (and the other submodules'
    public classes) works after changing the package name alone: each name the seed's
    submodule defines and ``replaybuf`` exports is the same object there."""
    import importlib

    theirs, ours = (
        importlib.import_module(f"memmap_replay_buffer.{module}"),
        importlib.import_module(f"replaybuf.{module}"),
    )
    names = [
        name
        for name, value in vars(theirs).items()
        if not name.startswith("_")
        and getattr(value, "__module__", None) == theirs.__name__
        and name in replaybuf.__all__
    ]
    aliases = {"ReplayBufferBase": replaybuf.ReplayBuffer} if module == "replay_buffer" else {}
    assert names and sorted(names) == sorted(set(ours.__all__) - set(aliases)), module
    for name in names:
        assert getattr(ours, name) is getattr(replaybuf, name), f"replaybuf.{module}.{name}"
    for name, value in aliases.items():  # the seed's base class of its buffers: type hints, isinstance
        assert name in vars(theirs) and getattr(ours, name) is value
        assert issubclass(replaybuf.ReplayBufferH5PY, getattr(ours, name))


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_second_object_in_the_process_is_seen_after_a_write_or_refresh(tmp_path, backend):
    """README, Differences: the seed's README reopens with ``from_folder`` while the first object
    keeps writing. Both take turns without overwriting each other; the first reads the
    second's commits after its own next write or ``refresh()`` (the seed's at once)."""
    if backend == "hdf5":
        require("h5py")
    first = replaybuf.ReplayBuffer(tmp_path / backend, max_episodes=4, max_timesteps=3, fields=FIELDS, backend=backend)
    first.store_episode(act=torch.tensor([1]))
    second = replaybuf.ReplayBuffer.from_folder(tmp_path / backend)
    second.store_episode(act=torch.tensor([2]))
    assert (first.num_episodes, second.num_episodes) == (1, 2)
    first.refresh()
    assert first.num_episodes == len(first) == 2 and first.get_all_data()["act"][:, 0].tolist() == [1, 2]
    second.store_episode(act=torch.tensor([3]))
    first.store_episode(act=torch.tensor([4]))  # reloads the second's commit first: slot 3, not 2
    assert first.get_all_data()["act"][:, 0].tolist() == [1, 2, 3, 4] and first.episode_lens.tolist() == [1] * 4


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_view_reads_are_copies_and_one_index_writes_through(tmp_path, backend):
    """README, Differences: what indexing ``data`` / ``meta_data`` returns is a copy, on every
    backend (the seed's memmap slice writes through, its ReplayBufferH5PY copies), so a write
    into it changes nothing stored; a write with one index reaches the buffer."""
    if backend == "hdf5":
        require("h5py")
    buffer = replaybuf.ReplayBuffer(
        tmp_path / backend, max_episodes=3, max_timesteps=4, fields=FIELDS, meta_fields=META, backend=backend
    )
    buffer.store_episode(obs=torch.zeros(3, 2), act=torch.arange(3), done=torch.zeros(3, dtype=torch.bool), label=5)
    before = buffer.get_all_data()
    row = buffer.data["act"][0]
    row[1] = 99
    buffer.data["obs"][0][1] = 7.0  # chained: the second index writes into the first's copy
    buffer.meta_data["label"][:][0] = 1
    assert row.tolist()[:3] == [0, 99, 2]
    assert_same(buffer.get_all_data(), before, "after writes into copies")
    buffer.data["act"][0, 1] = 99
    assert buffer.data["act"][0].tolist()[:3] == [0, 99, 2]
    assert replaybuf.ReplayBuffer.from_folder(tmp_path / backend, read_only=True).data["act"][0, 1] == 99


@pytest.mark.parametrize("circular, episodes, in_progress", [(False, 2, False), (True, 5, True)])
def test_copy_seed_h5_keeps_config_slots_and_order(tmp_path, circular, episodes, in_progress):
    """A folder of the seed's ReplayBufferH5PY (a layout replaybuf does not open) is named as such
    when opened, and ``copy_seed_h5`` makes a replaybuf buffer that reads as the seed's did."""
    require("h5py")
    args = dict(max_episodes=3, max_timesteps=4, fields=FIELDS, meta_fields=META, circular=circular)
    theirs = seed.ReplayBufferH5PY(tmp_path / "seed", **args, h5py_compression="gzip")
    for e in range(episodes):
        for t in range(e % 3 + 1):
            theirs.store(obs=[e, t], act=e)
        theirs.store_meta_datapoint(theirs.episode_index, "label", e)
        theirs.advance_episode()
    if in_progress:
        theirs.store(obs=[9, 9], act=9)  # published by the seed; copied as an episode of 1 step
    theirs.flush()
    hint = "memmap-replay-buffer ReplayBufferH5PY folder.*copy_seed_h5"
    with pytest.raises(FileNotFoundError, match=hint):
        replaybuf.ReplayBufferH5PY.from_folder(tmp_path / "seed")
    with pytest.raises(FileNotFoundError, match=hint):
        replaybuf.ReplayBuffer(tmp_path / "seed", read_only=True, overwrite=False)
    with pytest.raises(ValueError, match="nothing was deleted.*" + hint):
        replaybuf.ReplayBufferH5PY(tmp_path / "seed", **args)
    assert sorted(p.name for p in (tmp_path / "seed").iterdir()) == ["data.h5", "metadata.pkl"]

    ours = replaybuf.copy_seed_h5(tmp_path / "seed", tmp_path / "ours")
    next_slot = (theirs.episode_index + in_progress) % 3  # the episode in progress is committed
    assert (ours.h5py_compression, ours.episode_index, len(ours)) == ("gzip", next_slot, len(theirs))
    theirs_data = theirs.get_all_data()
    assert ours.num_episodes == theirs.num_episodes  # the circular one is full either way
    assert_same(ours.get_all_data(), theirs_data, "get_all_data")
    ours.close()
    # the seed's config, its compression included
    reopened = replaybuf.ReplayBufferH5PY(tmp_path / "ours", **args, h5py_compression="gzip", overwrite=False)
    assert_same(reopened.get_all_data(), theirs_data, "reopened")
    reopened.close()
    with pytest.raises(FileExistsError, match="already holds a buffer"):
        replaybuf.copy_seed_h5(tmp_path / "seed", tmp_path / "ours")


@pytest.mark.parametrize("how", OUTSIDE_KINDS)
def test_copy_seed_h5_refuses_a_dataset_kept_outside_the_seed_file_naming_it(tmp_path, how):
    """Before: a dataset of the seed's data.h5 kept in another file (HDF5 external storage, a
    virtual dataset, an external link) was copied into the new buffer: any file of this
    machine read into it; a soft link made a field another dataset's. Nothing is written."""
    require("h5py")
    theirs = seed.ReplayBufferH5PY(tmp_path / "seed", max_episodes=2, max_timesteps=3, fields={"obs": ("float", 2)})
    theirs.store(obs=[1.0, 2.0])
    theirs.advance_episode()
    theirs.flush()
    outside = tmp_path / "users"
    before = replace_with_outside(tmp_path / "seed" / "data.h5", "data_obs", how, outside, (2, 3, 2), 7, "/v")
    refusal = (
        r"data\.h5: dataset 'data_obs' keeps its data in other files"
        if how in ("external storage", "virtual")
        else r"data\.h5: 'data_obs' is reached through (External|Soft)Link"
    )
    with pytest.raises(replaybuf.BufferDamagedError, match=refusal):
        replaybuf.copy_seed_h5(tmp_path / "seed", tmp_path / "ours")
    assert outside.read_bytes() == before
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("after", ["length-0 episodes", "episode_index set"])
def test_a_reopen_keeps_the_next_slot_as_the_seed_does(tmp_path, after):
    """The next slot survives ``from_folder`` when nothing was published after the counters
    (it was recomputed from the newest non-empty episode, pointing elsewhere than the seed)."""
    args = dict(max_episodes=3, max_timesteps=4, fields=FIELDS, meta_fields=META, circular=True)
    buffers = [seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)]
    for buffer in buffers:
        buffer.store_batch(act=np.array([1, 2]))
        buffer.advance_episode(2)
        if after == "length-0 episodes":
            buffer.advance_episode(2)  # slots 2 and 0, nothing stored
        else:
            buffer.episode_index = 1
    buffers[1].close()
    theirs, ours = (type(b).from_folder(b.folder) for b in buffers)
    assert (ours.episode_index, ours.num_episodes) == (theirs.episode_index, theirs.num_episodes)
    for buffer in (theirs, ours):
        buffer.store(act=5)
        buffer.advance_episode()
    lens = np.asarray(theirs.episode_lens[:])
    assert ours.episode_lens.tolist() == lens.tolist()  # the new episode went to the seed's slot
    kept = lens > 0  # (past an episode's end the seed returns what the slot held: README)
    for name in ("act", "obs"):
        assert_same(ours.data[name][kept], np.asarray(theirs.data[name][kept]), name)


def _damage_h5(path, damage: str) -> None:
    import h5py

    with h5py.File(path, "r+") as file:
        if damage == "length past max_timesteps":
            file["meta_episode_lens"][1] = 100
        elif damage == "negative length":
            file["meta_episode_lens"][1] = -5
        elif damage == "short dataset":
            del file["data_obs"]
            file["data_obs"] = np.zeros((1, 4, 2), np.float32)
        else:  # an episode in progress in a slot past the end
            file.attrs["episode_index"], file.attrs["timestep_index"] = 7, 1


@pytest.mark.parametrize(
    "damage, complaint",
    [
        ("length past max_timesteps", r"meta_episode_lens of slots \[1\] hold \[100\], outside \[0, max_timesteps=4\]"),
        ("negative length", r"meta_episode_lens of slots \[1\] hold \[-5\]"),
        ("short dataset", r"dataset 'data_obs' holds float32\[1, 4, 2\], .* expects numbers of shape \[3, 4, 2\]"),
        ("counter past the end", r"attribute 'episode_index' is .*7.*, expected an int in \[0, 2\]"),
    ],
)
def test_copy_seed_h5_refuses_damaged_lengths_shapes_and_counters_before_creating(tmp_path, damage, complaint):
    """Before: a damaged length (past max_timesteps or negative) left its episode out of the copy
    silently, and a short dataset or a counter past the end raised numpy's unnamed IndexError or
    ValueError with the new buffer half written. Now: BufferDamagedError naming data.h5, nothing made."""
    require("h5py")
    theirs = seed.ReplayBufferH5PY(tmp_path / "seed", max_episodes=3, max_timesteps=4, fields=FIELDS, meta_fields=META)
    for i in range(2):
        theirs.store_episode(
            obs=torch.full((3, 2), float(i)), act=torch.full((3,), i), done=torch.zeros(3, dtype=torch.bool), label=i
        )
    theirs.flush()
    del theirs
    _damage_h5(tmp_path / "seed" / "data.h5", damage)
    with pytest.raises(replaybuf.BufferDamagedError, match=r"data\.h5: " + complaint):
        replaybuf.copy_seed_h5(tmp_path / "seed", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.get_all_data(fields=("nope",)),
        lambda b: b.get_all_data(meta_fields=("obs",)),
        lambda b: b.dataset(fields=("nope",))[0],
        lambda b: b.dataset(filter_meta={"nope": 1}),
        lambda b: b.dataset(timestep_level=True, filter_fields={"nope": 1}),
        lambda b: next(iter(b.dataloader(2, return_mask=True, dataset_kwargs={"return_episode_lens": False}))),
    ],
    ids=["get_all_data-fields", "get_all_data-meta_fields", "fields", "filter_meta", "filter_fields", "mask-no-lens"],
)
def test_an_unknown_field_name_raises_the_seeds_key_error_and_a_value_error(tmp_path, call):
    """The seed's lookups raise KeyError for an unknown name: a user's ``except KeyError`` (and
    replaybuf's ``except ValueError``) must catch ours."""
    theirs, ours = pair(tmp_path)
    with pytest.raises(KeyError):
        call(theirs)
    with pytest.raises(KeyError) as caught:
        call(ours)
    assert isinstance(caught.value, replaybuf.UnknownFieldError) and isinstance(caught.value, ValueError)
    assert "nope" in str(caught.value) or "obs" in str(caught.value) or "_lens" in str(caught.value)
