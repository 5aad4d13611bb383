"""ConcatReplayBuffer: read-only over several buffers, any mix of stores."""

from __future__ import annotations

import pickle

import dask.array as da
import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.concat import WRITE_METHODS, ConcatReplayBuffer, ConcatStorage
from replaybuf.storage.base import backend_class

from ._data import fields, padded, random_episode, uniform

pytest_plugins = ["tests._servers"]  # fixtures: s3_server (moto's S3 on 127.0.0.1)

FIELDS = fields("obs", "reward", "action")
META = {"task": "int"}


def episode(index: int, length: int) -> dict[str, np.ndarray]:
    """Episode ``index``: its obs lie near index."""
    return random_episode(
        FIELDS, length, index, obs=lambda rng, shape: rng.normal(size=shape).astype(np.float32) + index, reward=uniform
    )


# (location suffix, max_episodes, max_timesteps, episode lengths); the second member is longer in time.
MEMBERS = [("a", 4, 10, [3, 10]), ("b", 3, 20, [15, 4, 20]), ("c", 2, 8, [])]


def make_members(root, location=lambda root, name: root / name, seed_too=False, backends=(None, None, None)):
    """Write the MEMBERS buffers (and the same episodes in seed buffers when ``seed_too``)."""
    seeds, stored, index = [], [], 0
    for (name, episodes, timesteps, lengths), backend in zip(MEMBERS, backends):
        buffer = ReplayBuffer(
            location(root, name),
            max_episodes=episodes,
            max_timesteps=timesteps,
            fields=FIELDS,
            meta_fields=META,
            backend=backend,
        )
        if seed_too:
            from memmap_replay_buffer import ReplayBuffer as SeedBuffer

            seed = SeedBuffer(
                str(root / f"seed-{name}"),
                max_episodes=episodes,
                max_timesteps=timesteps,
                fields=FIELDS,
                meta_fields=META,
                overwrite=True,
            )
            seeds.append(str(root / f"seed-{name}"))
        for length in lengths:
            data = episode(index, length)
            buffer.store_episode(**data, task=index)
            if seed_too:
                seed.store_episode(**data, task=index)
            stored.append({**data, "task": index})
            index += 1
        buffer.close()
    return stored, seeds


@pytest.fixture
def concat(tmp_path):
    stored, _ = make_members(tmp_path)
    return ConcatReplayBuffer([tmp_path / "a", str(tmp_path / "b"), ReplayBuffer.from_folder(tmp_path / "c")]), stored


def test_bookkeeping(concat):
    buffer, _ = concat
    assert buffer.num_episodes == len(buffer) == 5
    assert buffer.max_episodes == 9 and buffer.max_timesteps == 20
    assert buffer.fieldnames == set(FIELDS) and buffer.meta_fieldnames == {"task", "episode_lens"}
    np.testing.assert_array_equal(buffer.episode_lens, [3, 10, 0, 0, 15, 4, 20, 0, 0])
    np.testing.assert_array_equal(buffer.valid_episodes(), [0, 1, 4, 5, 6])
    np.testing.assert_array_equal(buffer.meta_data["task"][:], [0, 1, 0, 0, 2, 3, 4, 0, 0])
    assert buffer.schema.max_episodes == 9 and buffer.schema.max_timesteps == 20
    assert isinstance(buffer.storage, ConcatStorage)


def test_get_all_data_matches_the_seeds_concat(tmp_path):
    from memmap_replay_buffer import ConcatReplayBuffer as SeedConcat

    _, seeds = make_members(tmp_path, seed_too=True)
    ours = ConcatReplayBuffer([tmp_path / name for name, *_ in MEMBERS]).get_all_data()
    theirs = SeedConcat(seeds).get_all_data()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


def test_get_all_data_pads_time_across_buffers(concat):
    buffer, stored = concat
    data = buffer.get_all_data(fields=["obs", "reward"], meta_fields=["task"])
    assert set(data) == {"obs", "reward", "task"}
    assert data["obs"].shape == (5, 20, 3)
    np.testing.assert_array_equal(data["obs"].numpy(), padded(stored, "obs"))
    np.testing.assert_array_equal(data["task"].numpy(), [0, 1, 2, 3, 4])
    lazy = buffer.get_all_data(fields=["reward"], lazy=True)
    assert isinstance(lazy["reward"], da.Array)
    with pytest.raises(ValueError, match="lazy=True"):
        buffer.get_all_data(lazy=True, device="cpu")
    with pytest.raises(ValueError, match=r"invalid field names \['speed'\]"):
        buffer.get_all_data(fields=["speed"])


def test_to_dask_and_stats_across_buffers(concat):
    buffer, stored = concat
    arrays = buffer.to_dask(["action"], [])
    np.testing.assert_array_equal(arrays["action"].compute(), padded(stored, "action"))
    np.testing.assert_array_equal(buffer.episode_mask().compute().sum(1), [3, 10, 15, 4, 20])
    result = buffer.stats()
    steps = np.concatenate([e["obs"] for e in stored]).astype(np.float64)
    np.testing.assert_allclose(result["obs"].mean.numpy(), steps.mean(0), rtol=1e-5)
    np.testing.assert_allclose(result["obs"].std.numpy(), steps.std(0), rtol=1e-5)
    np.testing.assert_allclose(result.episode_sums["reward"].numpy(), [e["reward"].sum() for e in stored], rtol=1e-6)
    assert result.num_episodes == 5 and result.num_timesteps == 52


def test_storage_routes_reads_to_members(concat, tmp_path):
    buffer, stored = concat
    b = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    rows = buffer.storage.read_rows("obs", np.array([4, 0, 6]), 2, 18)
    np.testing.assert_array_equal(rows[0], b.storage.read_rows("obs", np.array([0]), 2, 18)[0])
    np.testing.assert_array_equal(rows[1, :1], stored[0]["obs"][2:3])
    assert not rows[1, 8:].any()  # member a stores 10 steps: zeros beyond
    picked = buffer.storage.gather("reward", np.array([6, 1, 1, 4]), np.array([19, 9, 15, 0]))
    np.testing.assert_array_equal(picked, [stored[4]["reward"][19], stored[1]["reward"][9], 0, stored[2]["reward"][0]])
    np.testing.assert_array_equal(buffer.data["obs"][4, 14], stored[2]["obs"][14])
    assert buffer.data["obs"][[0, 4], 1:3].shape == (2, 2, 3)
    np.testing.assert_array_equal(buffer.data["reward"][1], padded(stored, "reward")[1])
    np.testing.assert_array_equal(buffer.storage.read_meta("episode_lens"), buffer.episode_lens)
    with pytest.raises(IndexError, match=r"must be in \[0, 9\)"):
        buffer.storage.read_rows("obs", np.array([9]), 0, 1)


def test_mixed_stores(tmp_path, s3_server):
    """A local zarr folder, an S3 bucket (moto on 127.0.0.1) and an in-memory store, by path and URL."""
    urls = {"a": tmp_path / "a", "b": s3_server.url("concat-b"), "c": "memory://concat-c"}
    options = {"a": None, "b": s3_server.storage_options, "c": None}
    for (name, episodes, timesteps, lengths), first in zip(MEMBERS, (0, 2, 5)):
        buffer = ReplayBuffer(
            urls[name],
            max_episodes=episodes,
            max_timesteps=timesteps,
            fields=FIELDS,
            meta_fields=META,
            storage_options=options[name],
        )
        for index, length in enumerate(lengths, start=first):
            buffer.store_episode(**episode(index, length), task=index)
        buffer.close()
    stored = [{**episode(i, n), "task": i} for i, n in enumerate([3, 10, 15, 4, 20])]
    buffer = ConcatReplayBuffer(list(urls.values()), storage_options=list(options.values()))
    assert [m.storage.location for m in buffer.buffers][1:] == [s3_server.url("concat-b"), "memory://concat-c"]
    # one dict for all goes to the URLs only: a local folder refuses storage_options
    shared = ConcatReplayBuffer([urls["a"], urls["b"]], storage_options=s3_server.storage_options)
    assert len(shared) == len(MEMBERS[0][3]) + len(MEMBERS[1][3])
    np.testing.assert_array_equal(buffer.get_all_data(fields=["obs"])["obs"].numpy(), padded(stored, "obs"))
    np.testing.assert_allclose(
        buffer.stats(["reward"]).episode_sums["reward"].numpy(), [e["reward"].sum() for e in stored], rtol=1e-6
    )


def available(backend: str) -> bool:
    try:
        backend_class(backend)
    except ImportError:
        return False
    return True


def test_mixed_backends(tmp_path):
    """zarr, memmap and hdf5 members side by side (each skipped while its backend has not landed)."""
    backends = ("zarr", "memmap", "hdf5")
    if not all(available(b) for b in backends):
        pytest.skip(f"needs all of {backends}; available: {[b for b in backends if available(b)]}")
    stored, _ = make_members(tmp_path, backends=backends)
    buffer = ConcatReplayBuffer([tmp_path / name for name, *_ in MEMBERS])
    assert [m.storage.backend_name for m in buffer.buffers] == list(backends)
    np.testing.assert_array_equal(buffer.get_all_data(fields=["obs"])["obs"].numpy(), padded(stored, "obs"))
    picked = buffer.storage.gather("action", np.array([1, 6]), np.array([9, 19]))
    np.testing.assert_array_equal(picked, [stored[1]["action"][9], stored[4]["action"][19]])
    np.testing.assert_allclose(
        buffer.stats(["reward"]).episode_sums["reward"].numpy(), [e["reward"].sum() for e in stored], rtol=1e-6
    )


@pytest.mark.parametrize("call", sorted(WRITE_METHODS))
def test_write_calls_are_refused(concat, call):
    assert callable(getattr(ReplayBuffer, call)), "only ReplayBuffer's own write methods are refused"
    with pytest.raises(NotImplementedError, match=f"ConcatReplayBuffer is read-only: `{call}` is not allowed"):
        getattr(concat[0], call)(np.zeros(3), obs=np.zeros(3))


def test_every_other_missing_attribute_is_an_attribute_error(concat):
    buffer, _ = concat
    for name in ("store_batch_datapoints", "reset", "warm_cache_", "_meta"):  # none is ReplayBuffer's
        assert not hasattr(buffer, name)
        with pytest.raises(AttributeError, match=f"'ConcatReplayBuffer' object has no attribute '{name}'"):
            getattr(buffer, name)
    assert hasattr(buffer, "store"), "a write method is there to refuse, naming itself"


def test_write_methods_are_not_stubs_in_the_class():
    assert not WRITE_METHODS & set(vars(ConcatReplayBuffer)), "one mechanism (__getattr__), not a stub per method"


def test_snapshot_comes_from_the_members_public_views(concat):
    buffer, stored = concat
    members = buffer.buffers
    np.testing.assert_array_equal(buffer.generations, np.concatenate([m.generations for m in members]))
    np.testing.assert_array_equal(buffer.meta_values("task"), np.concatenate([m.meta_values("task") for m in members]))
    np.testing.assert_array_equal(buffer.meta_values("episode_lens"), buffer.episode_lens)
    assert buffer.shapes == members[0].shapes and buffer.meta_dtypes == members[0].meta_dtypes
    assert buffer.fieldnames == set(FIELDS) and buffer.meta_fieldnames == {"task", "episode_lens"}
    for view in (buffer.generations, buffer.episode_lens, buffer.meta_values("task")):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 7
    with pytest.raises(ValueError, match=r"meta_values: invalid meta field name '_generation' - must be one of"):
        buffer.meta_values("_generation")


def test_meta_and_data_writes_are_refused(concat):
    buffer, _ = concat
    with pytest.raises(NotImplementedError, match="read-only"):
        buffer.meta_data["task"][0] = 3
    with pytest.raises(NotImplementedError, match="read-only"):
        buffer.data["obs"][0, 0] = 1.0
    with pytest.raises(NotImplementedError, match="read-only"):
        buffer.storage.write_rows("obs", np.array([0]), 0, np.zeros((1, 1, 3), np.float32))


def test_different_fields_are_listed(tmp_path):
    ReplayBuffer(tmp_path / "x", max_episodes=2, max_timesteps=4, fields=FIELDS, meta_fields=META)
    ReplayBuffer(
        tmp_path / "y",
        max_episodes=2,
        max_timesteps=4,
        fields={"obs": ("float", (4,)), "done": "bool"},
        meta_fields={"task": "float"},
    )
    with pytest.raises(ValueError) as error:
        ConcatReplayBuffer([tmp_path / "x", tmp_path / "y"])
    message = str(error.value)
    assert "lacks fields ['action', 'reward']" in message
    assert "has extra fields ['done']" in message
    assert "field 'obs' is float32[4], buffer 0 has float32[3]" in message
    assert "meta field 'task' is float32[], buffer 0 has int32[]" in message


def test_bad_arguments(tmp_path):
    ReplayBuffer(tmp_path / "x", max_episodes=2, max_timesteps=4, fields=FIELDS)
    with pytest.raises(ValueError, match="at least one buffer"):
        ConcatReplayBuffer([])
    assert ConcatReplayBuffer(str(tmp_path / "x")).max_episodes == 2, "one path: that buffer (or its shards)"
    with pytest.raises(TypeError, match="list of paths"):
        ConcatReplayBuffer(ReplayBuffer.from_folder(tmp_path / "x"))
    with pytest.raises(TypeError, match="got 3"):
        ConcatReplayBuffer([tmp_path / "x", 3])
    with pytest.raises(ValueError, match="storage_options has 1 entries for 2 buffers"):
        ConcatReplayBuffer([tmp_path / "x", tmp_path / "x"], storage_options=[{}])
    with pytest.raises(FileNotFoundError):
        ConcatReplayBuffer([tmp_path / "x", tmp_path / "missing"])


def test_field_names_that_are_not_a_sequence_are_refused_naming_the_argument(concat):
    buffer, _ = concat
    for make in (buffer.dataset, lambda **names: buffer.dataloader(batch_size=2, **names)):
        with pytest.raises(TypeError, match="fields must be a sequence of field names, got 5"):
            make(fields=5)
    with pytest.raises(TypeError, match="stats: fields must be field names"):
        buffer.stats(fields=5)


def test_refresh_sees_new_episodes(tmp_path):
    writer = ReplayBuffer(tmp_path / "w", max_episodes=4, max_timesteps=5, fields=FIELDS)
    writer.store_episode(**episode(0, 2))
    buffer = ConcatReplayBuffer([tmp_path / "w"])
    writer.store_episode(**episode(1, 5))
    assert len(buffer) == 1
    assert len(buffer.refresh()) == 2 and buffer.get_all_data(fields=["obs"])["obs"].shape == (2, 5, 3)
    live = ConcatReplayBuffer([writer])
    with writer.one_episode():
        writer.store(**{n: v[0] for n, v in episode(2, 1).items()})
        live.refresh()
        assert writer.timestep_index == 1 and len(live) == 2
    assert len(live.refresh()) == 3


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("how", ["deleted", "created again"])
def test_stats_of_a_member_gone_raise_instead_of_leaving_it_out(tmp_path, exact, how):
    """A member deleted (or created again) after the concatenation opened: stats() from
    sketches answered for the other members only (its episodes dropped as 'rewritten'), and
    stats(exact=True) of one created again said 'rewritten by a concurrent writer; retryable'."""
    import shutil

    from replaybuf.storage import BufferReplacedError

    make_members(tmp_path)
    concat = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    if how == "deleted":
        shutil.rmtree(tmp_path / "b")
    else:  # overwrite=True: the same slots and generations, of new episodes
        with ReplayBuffer(
            tmp_path / "b", max_episodes=3, max_timesteps=20, fields=FIELDS, meta_fields=META, overwrite=True
        ) as new:
            for index in range(3):
                new.store_episode(**episode(10 + index, 20), task=0)
    for buffer in (concat, reader):
        with pytest.raises(BufferReplacedError, match=r"b' was replaced"):
            buffer.stats(["obs"], exact=exact)


def test_pickles_as_a_read_only_view(concat):
    buffer, stored = concat
    copy = pickle.loads(pickle.dumps(buffer))
    np.testing.assert_array_equal(copy.get_all_data(fields=["obs"])["obs"].numpy(), padded(stored, "obs"))
    assert copy.memory_namedtuple._fields == tuple(FIELDS)
    np.testing.assert_array_equal(copy.meta_data["task"][:], buffer.meta_data["task"][:])


def sampling():
    try:
        from replaybuf.sampling import make_dataloader, make_dataset
    except ImportError:
        pytest.skip("replaybuf.sampling (branch 'sampling') has not landed")
    return make_dataset, make_dataloader


def test_dataset_samples_across_buffers(concat):
    sampling()
    buffer, stored = concat
    trajectories = buffer.dataset()
    assert len(trajectories) == 5
    assert {int(trajectories[i]["obs"].shape[0]) for i in range(5)} <= {3, 10, 15, 4, 20}
    assert len(buffer.dataset(timestep_level=True)) == 52


def test_dataloader_samples_across_buffers(concat):
    sampling()
    buffer, stored = concat
    seen = torch.cat([batch["obs"] for batch in buffer.dataloader(batch_size=4, timestep_level=True, shuffle=True)])
    assert seen.shape == (52, 3)
    every_step = np.concatenate([e["obs"] for e in stored])
    np.testing.assert_array_equal(np.unique(seen.numpy(), axis=0), np.unique(every_step, axis=0))
    trajectories = next(iter(buffer.dataloader(batch_size=5)))
    assert trajectories["obs"].shape == (5, 20, 3)
    np.testing.assert_array_equal(trajectories["obs"].numpy(), padded(stored, "obs"))


def test_concat_reads_rewritten_member_slots_again_by_their_global_index(tmp_path):
    """Between member b's reads of two fields a writer reuses its slot 0 (global slot 2) and
    drops member a's slot 1: the frame shards, bound to their episode, refuse the reads naming
    local slots, which the concatenation reports as global ones; the read is repeated until
    global slot 2 is read as its new episode, row 1 is padding and the other rows are whole."""
    from replaybuf.storage import GenerationMismatchError
    from tests._workloads import buffer_kwargs, check_episode, write_episode

    writers = [ReplayBuffer(tmp_path / name, **buffer_kwargs(2, circular=True)) for name in ("a", "b")]
    for writer, uids in zip(writers, ((4, 5), (6, 7))):  # 24, 23, 22 and 21 steps
        for uid in uids:
            write_episode(writer, uid, "whole")
    concat = ConcatReplayBuffer([ReplayBuffer.from_folder(tmp_path / name, read_only=True) for name in ("a", "b")])
    member, reads = concat.storage.members[1], []
    read_spans = member.read_spans

    def rewrite_between_two_fields(name, episodes, *args, **kwargs):
        try:
            read_spans(name, episodes, *args, **kwargs)
        except GenerationMismatchError as error:
            reads.append((name, "refused", list(map(int, error.slots))))
            raise
        reads.append((name, sorted(map(int, episodes))))
        if len(reads) == 3:  # obs, step and img read
            write_episode(writers[1], 16, "whole")  # 12 steps, into b's slot 0
            writers[0].drop_episodes([1])

    member.read_spans = rewrite_between_two_fields
    got = concat.get_all_data()
    fields = ["obs", "step", "img"]
    # a's frame read refuses its dropped slot first (b's is not reached), then b's its slot 0
    assert [read[0] for read in reads] == fields + fields + ["frame"] + fields + ["frame"]
    assert reads[6] == ("frame", "refused", [0])
    assert got["uid"].tolist() == [4, 0, 16, 7] and got["episode_lens"].tolist() == [24, 0, 12, 21]
    for row, uid in enumerate(got["uid"].tolist()):
        rows = {name: got[name][row].numpy() for name in ("obs", "step", "img", "frame")}
        if uid:
            check_episode(uid, int(got["episode_lens"][row]), rows)
        else:
            assert not any(values.any() for values in rows.values()), "a dropped slot's row is padding"


@pytest.mark.parametrize("backend, shards", [("memmap", 12), ("hdf5", 12)])
def test_a_reader_of_many_shards_holds_no_descriptor_per_array(tmp_path, backend, shards):
    """A memmap shard's arrays, an hdf5 shard's field maps and checksums, and the file that pins
    a reader's buffer are mapped without a descriptor each: ``ConcatReplayBuffer(root)`` over
    ~130 memmap shards (8 descriptors each) ran out of the default open-file limit of 1024
    (``OSError: Too many open files``). hdf5 keeps data.h5 open: one descriptor per shard."""
    import os
    import resource

    for shard in range(shards):
        with ReplayBuffer.shard(
            tmp_path, shard, max_episodes=2, max_timesteps=4, fields={"obs": ("float", 3)}, backend=backend
        ) as buffer:
            buffer.store_episode(obs=np.full((4, 3), shard, np.float32))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 20, hard))
    try:
        reader = ConcatReplayBuffer(tmp_path)
        rows = reader.get_all_data()["obs"][:, 0, 0]
        reader.refresh()
        batch = next(iter(reader.dataloader(batch_size=shards, timestep_level=True)))
        reader.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(rows.tolist()) == list(range(shards))
    assert batch["obs"].shape == (shards, 3)
