"""Dask views of a buffer: to_dask, get_all_data (eager and lazy), episode_mask, stats."""

from __future__ import annotations

import pickle

import dask
import dask.array as da
import numpy as np
import pytest
import torch

from replaybuf import ConcurrentWriteError, ReplayBuffer, StalePlanError, analysis
from replaybuf.analysis import BufferStats, episode_mask, get_all_data, stats, to_dask

from ._data import fields, random_episode
from ._data import padded as expected

pytest_plugins = ["tests._servers"]  # fixtures: s3_server (moto's S3 on 127.0.0.1)

FIELDS = fields("obs", "image", "reward", "done", "action", image=("uint8", (4, 5)))
META = {"task": "int"}
LENGTHS = [5, 12, 3, 9, 7, 1, 11]


def episode(index: int, length: int) -> dict[str, np.ndarray]:
    """Episode ``index``: its obs lie near 100 * index, signed rewards and actions."""
    return random_episode(
        FIELDS,
        length,
        index,
        obs=lambda rng, shape: rng.normal(size=shape) + 100 * index,
        reward=lambda rng, shape: rng.uniform(-1, 1, shape),
        action=lambda rng, shape: rng.integers(-3, 4, shape),
    )


def fill(buffer: ReplayBuffer, lengths=LENGTHS) -> list[dict[str, np.ndarray]]:
    stored = []
    for index, length in enumerate(lengths):
        data = episode(index, length)
        buffer.store_episode(**data, task=index)
        stored.append({**data, "task": index})
    return stored


@pytest.fixture
def circular(make_location):
    """On every backend, a circular buffer of 5 slots that wrapped: episodes 2..6, oldest in slot 2."""
    location, kwargs = make_location()
    buffer = ReplayBuffer(
        location, max_episodes=5, max_timesteps=16, fields=FIELDS, meta_fields=META, circular=True, **kwargs
    )
    stored = fill(buffer)
    return buffer, stored[2:]


def test_to_dask_holds_committed_episodes_oldest_first_zero_padded(circular):
    buffer, stored = circular
    arrays = to_dask(buffer)
    assert set(arrays) == set(FIELDS) | {"task", "episode_lens"}
    assert all(isinstance(a, da.Array) for a in arrays.values())
    for name in FIELDS:
        assert arrays[name].shape == (5, 11, *buffer.schema.fields[name].shape)
        np.testing.assert_array_equal(arrays[name].compute(), expected(stored, name))
    np.testing.assert_array_equal(arrays["task"].compute(), [2, 3, 4, 5, 6])
    np.testing.assert_array_equal(arrays["episode_lens"].compute(), LENGTHS[2:])


def test_to_dask_chunks_hold_whole_episodes_over_the_whole_time(circular):
    buffer, stored = circular
    image = to_dask(buffer, ["image"], episodes_per_chunk=2)["image"]
    assert image.chunks[:2] == ((2, 2, 1), (11,))
    np.testing.assert_array_equal(image[3:5, 2:6].compute(), expected(stored, "image")[3:5, 2:6])
    np.testing.assert_array_equal(image[[0, 4], ::3, 1].compute(), expected(stored, "image")[[0, 4], ::3, 1])
    np.testing.assert_array_equal(image[2, -1].compute(), expected(stored, "image")[2, -1])
    default = to_dask(buffer, ["image"])["image"]
    assert default.chunks[0] == (5,)
    with dask.config.set({"array.chunk-size": f"{11 * 20 * 2}B"}):
        assert to_dask(buffer, ["image"])["image"].chunks[0] == (2, 2, 1)


def test_get_all_data_matches_the_seed(tmp_path):
    from memmap_replay_buffer import ReplayBuffer as SeedBuffer

    ours = ReplayBuffer(tmp_path / "ours", max_episodes=10, max_timesteps=16, fields=FIELDS, meta_fields=META)
    seed = SeedBuffer(
        str(tmp_path / "seed"), max_episodes=10, max_timesteps=16, fields=FIELDS, meta_fields=META, overwrite=True
    )
    for index, length in enumerate(LENGTHS):
        data = episode(index, length)
        ours.store_episode(**data, task=index)
        seed.store_episode(**data, task=index)
    theirs, mine = seed.get_all_data(), get_all_data(ours)
    assert set(mine) == set(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name
    subset, seed_subset = (
        get_all_data(ours, fields=["obs"], meta_fields=["task"]),
        seed.get_all_data(fields=("obs",), meta_fields=("task",)),
    )
    assert set(subset) == set(seed_subset) == {"obs", "task"}
    assert torch.equal(subset["obs"], seed_subset["obs"])


SLOT_ORDER = [3, 4, 0, 1, 2]  # slots 0..4 of the wrapped buffer hold episodes 5, 6, 2, 3, 4


def test_get_all_data_is_in_slot_order_as_the_seed_and_to_dask_oldest_first(circular):
    buffer, stored = circular
    data = get_all_data(buffer)
    assert data["task"].tolist() == [5, 6, 2, 3, 4]
    np.testing.assert_array_equal(data["image"].numpy(), expected(stored, "image")[SLOT_ORDER])
    assert to_dask(buffer, meta_fields=["task"])["task"].compute().tolist() == [2, 3, 4, 5, 6]
    assert to_dask(buffer, meta_fields=["task"], order="slot")["task"].compute().tolist() == [5, 6, 2, 3, 4]
    np.testing.assert_array_equal(
        episode_mask(buffer, order="slot").compute().sum(1), np.array(LENGTHS[2:])[SLOT_ORDER]
    )
    with pytest.raises(ValueError, match=r"order must be one of \['chronological', 'slot'\], got 'newest'"):
        to_dask(buffer, order="newest")


def test_get_all_data_lazy_and_device(circular):
    buffer, stored = circular
    lazy = get_all_data(buffer, fields=["reward"], lazy=True)
    assert set(lazy) == {"reward"} and isinstance(lazy["reward"], da.Array)
    eager = get_all_data(buffer, fields=["reward"], device="cpu")
    assert torch.equal(eager["reward"], torch.from_numpy(lazy["reward"].compute()))
    with pytest.raises(ValueError, match="lazy=True.*device='cpu'"):
        get_all_data(buffer, lazy=True, device="cpu")


def test_get_all_data_refuses_a_bad_device_before_reading(circular, monkeypatch):
    # torch refused it only after every row was decoded: a RuntimeError ("Expected one of cpu,
    # cuda, ...") or, for a CUDA device on a machine without one, an AssertionError from torch
    buffer, _ = circular
    monkeypatch.setattr(analysis, "_read_rows", lambda *args: pytest.fail("read before the device was checked"))
    with pytest.raises(ValueError, match="device: 'tpu' is not a torch device"):
        get_all_data(buffer, device="tpu")
    with pytest.raises(ValueError, match="device: 'cuda:99'"):
        get_all_data(buffer, device="cuda:99")


@pytest.mark.parametrize("call", [to_dask, get_all_data])
def test_unknown_field_names_are_refused(circular, call):
    buffer, _ = circular
    with pytest.raises(ValueError, match=r"invalid field names \['velocity'\].*'obs'"):
        call(buffer, fields=["obs", "velocity"])
    with pytest.raises(ValueError, match=r"invalid meta field names \['obs'\]"):
        call(buffer, meta_fields=["obs"])
    with pytest.raises(TypeError, match="fields must be field names"):
        call(buffer, fields=[1])


def test_field_names_that_are_not_a_list_of_str_are_refused_naming_the_call(tmp_path):
    buffer = ReplayBuffer(tmp_path / "names", max_episodes=2, max_timesteps=3, fields={"obs": "float"})
    buffer.store_episode(obs=np.ones(2))
    for call in (to_dask, get_all_data, stats):
        for names in (5, [5], b"obs"):
            with pytest.raises(TypeError, match=rf"{call.__name__}: fields must be field names \(str\), got"):
                call(buffer, fields=names)
    with pytest.raises(TypeError, match=r"to_dask: meta_fields must be field names \(str\), got 5"):
        to_dask(buffer, meta_fields=5)


def test_episodes_per_chunk_must_be_positive(circular):
    with pytest.raises(ValueError, match="episodes_per_chunk must be a positive int, got 0"):
        to_dask(circular[0], episodes_per_chunk=0)
    for bad in (0, -1, 1.5, "x"):  # dask took 0 and -1 as one chunk, and named neither for 1.5 or 'x'
        with pytest.raises(ValueError, match=f"episode_mask: episodes_per_chunk must be a positive int, got {bad!r}"):
            episode_mask(circular[0], episodes_per_chunk=bad)


def test_empty_buffer(tmp_path):
    buffer = ReplayBuffer(tmp_path / "empty", max_episodes=3, max_timesteps=4, fields=FIELDS)
    assert get_all_data(buffer) == {}
    assert to_dask(buffer, ["obs"])["obs"].shape == (0, 0, 3)
    assert episode_mask(buffer).shape == (0, 0)
    with pytest.raises(ValueError, match="no committed episodes"):
        stats(buffer)


def test_reused_slot_reads_zero_beyond_its_new_length(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=16, fields=FIELDS, circular=True)
    buffer.store_episode(**episode(0, 16))
    buffer.store_episode(**episode(1, 4))
    buffer.store_episode(**episode(2, 6))
    image = get_all_data(buffer, fields=["image"])["image"]
    assert image.shape == (1, 6, 4, 5)
    np.testing.assert_array_equal(image[0].numpy(), episode(2, 6)["image"])


def test_episode_mask(circular):
    buffer, stored = circular
    mask = episode_mask(buffer)
    assert isinstance(mask, da.Array) and mask.dtype == bool
    np.testing.assert_array_equal(mask.compute().sum(axis=1), LENGTHS[2:])
    np.testing.assert_array_equal(mask.compute(), np.arange(11)[None] < np.array(LENGTHS[2:])[:, None])


def reference_stats(stored: list[dict], name: str):
    steps = np.concatenate([e[name] for e in stored]).astype(np.float64)
    return steps.mean(0), steps.std(0), steps.min(0), steps.max(0), len(steps)


def test_stats_over_valid_steps_only(circular):
    buffer, stored = circular
    result = stats(buffer)
    assert isinstance(result, BufferStats)
    assert result.num_episodes == 5 and result.num_timesteps == sum(LENGTHS[2:])
    np.testing.assert_array_equal(result.episode_lens.numpy(), LENGTHS[2:])
    counts, edges = result.lens_histogram
    assert counts.sum() == 5 and edges[0] == 1 and edges[-1] > 11
    np.testing.assert_array_equal(np.histogram(LENGTHS[2:], edges.numpy())[0], counts.numpy())
    for name in FIELDS:
        mean, std, low, high, count = reference_stats(stored, name)
        field = result[name]
        assert field.mean.shape == buffer.schema.fields[name].shape
        assert field.count == count
        np.testing.assert_allclose(field.mean.numpy(), mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(field.std.numpy(), std, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(field.min.numpy(), low)
        np.testing.assert_array_equal(field.max.numpy(), high)
    assert set(result.episode_sums) == {"reward", "done", "action"}
    np.testing.assert_allclose(result.episode_sums["reward"].numpy(), [e["reward"].sum() for e in stored], rtol=1e-6)
    np.testing.assert_array_equal(result.episode_sums["done"].numpy(), [1] * 5)


def test_stats_normalizes_observations(circular):
    buffer, _ = circular
    result = stats(buffer, ["obs"])
    assert list(result) == ["obs"] and "obs" in result and "act" not in result  # its fields, as a dict's keys
    obs_stats = result["obs"]
    obs, mask = torch.from_numpy(to_dask(buffer, ["obs"])["obs"].compute()), episode_mask(buffer).compute()
    normalized = ((obs - obs_stats.mean) / obs_stats.std)[torch.from_numpy(mask)]
    assert obs_stats.mean.dtype == torch.float32
    torch.testing.assert_close(normalized.mean(0), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(normalized.std(0, correction=0), torch.ones(3), atol=1e-4, rtol=0)


def test_stats_std_is_accurate_far_from_zero(tmp_path):
    buffer = ReplayBuffer(tmp_path / "far", max_episodes=8, max_timesteps=50, fields={"x": "float"})
    rng = np.random.default_rng(0)
    values = [1e6 + rng.normal(0, 0.01, 50).astype(np.float32) for _ in range(8)]
    for v in values:
        buffer.store_episode(x=v)
    with dask.config.set({"array.chunk-size": "400B"}):
        result = stats(buffer)["x"]
    np.testing.assert_allclose(result.std.numpy(), np.concatenate(values).astype(np.float64).std(), rtol=1e-3)


@pytest.mark.parametrize("exact", [True, False])
def test_stats_of_infinite_values_match_numpy_from_data_and_from_sketches(tmp_path, exact):
    """An infinite first step or an infinite episode mean merged with another part gives numpy's
    inf mean (not NaN); episode sums of an int field are int64 from data and sketches alike."""
    buffer = ReplayBuffer(tmp_path / "inf", max_episodes=3, max_timesteps=4, fields={"x": ("float", 3), "n": "int"})
    inf = np.inf
    episodes = [np.array([[inf, 1, inf], [1, 2, 3]], np.float32), np.array([[5, inf, -inf], [1, 2, 3]], np.float32)]
    for values in episodes:
        buffer.store_episode(x=values, n=np.array([1, 2], np.int32))
    with dask.config.set({"array.chunk-size": "16B"}):  # one task per episode: blocks are merged
        result = stats(buffer, exact=exact)
    steps = np.concatenate(episodes).astype(np.float64)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(result["x"].mean.numpy(), steps.mean(0).astype(np.float32))
        np.testing.assert_array_equal(result["x"].std.numpy(), steps.std(0).astype(np.float32))
    assert result.episode_sums["n"].dtype == torch.int64 and result.episode_sums["n"].tolist() == [3, 3]


def test_padding_is_the_field_default_as_the_seed_and_stats_skip_it(tmp_path):
    from memmap_replay_buffer import ReplayBuffer as SeedBuffer

    fields = {"reward": "float", "bonus": ("float", (), 5.0), "flag": ("bool", (), True)}
    ours = ReplayBuffer(tmp_path / "ours", max_episodes=3, max_timesteps=6, fields=fields)
    seed = SeedBuffer(str(tmp_path / "seed"), max_episodes=3, max_timesteps=6, fields=fields, overwrite=True)
    for buffer in (ours, seed):
        buffer.store_episode(reward=np.arange(2.0), bonus=np.array([1.0, 2.0]), flag=np.array([False, False]))
        buffer.store_episode(reward=np.arange(4.0))
    mine, theirs = get_all_data(ours), seed.get_all_data()
    for name in fields:
        assert torch.equal(mine[name], theirs[name]), name
    assert mine["bonus"][0].tolist() == [1, 2, 5, 5]
    result = stats(ours)
    assert result.episode_sums["bonus"].tolist() == [3.0, 20.0]
    assert result.episode_sums["flag"].tolist() == [0, 4]
    assert result["bonus"].count == 6 and result["bonus"].min.item() == 1.0


def test_stats_unknown_field(circular):
    with pytest.raises(ValueError, match=r"stats: invalid field names \['nope'\]"):
        stats(circular[0], ["nope"])


def test_dask_arrays_pickle_without_open_handles(circular):
    buffer, stored = circular
    arrays = pickle.loads(pickle.dumps(to_dask(buffer, ["image"])))
    np.testing.assert_array_equal(arrays["image"].compute(scheduler="threads"), expected(stored, "image"))


@pytest.fixture(scope="module")
def cluster():
    """A dask.distributed cluster of two worker processes of one thread each."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        yield cluster


@pytest.fixture
def cluster_client(cluster):
    """The default client of ``cluster`` for one test: a client left default would run the
    module's later tests on this xdist worker on the cluster, where memory:// buffers are unseen."""
    import distributed

    with distributed.Client(cluster) as client:
        yield client


def check_on_cluster(client, buffer: ReplayBuffer, stored: list[dict]) -> None:
    """stats(), to_dask() and get_all_data() computed by the cluster's worker processes equal the local results."""
    local = stats(buffer, scheduler="threads")
    remote = stats(buffer)
    image = to_dask(buffer, ["image"], episodes_per_chunk=1)["image"]
    futures = client.compute(image.to_delayed().ravel().tolist())
    blocks = client.gather(futures)
    assert len({w for f in futures for w in client.who_has(f).get(f.key, ())}) == 2
    data = get_all_data(buffer, fields=["obs"], meta_fields=["task"])
    np.testing.assert_array_equal(np.concatenate(blocks), expected(stored, "image"))
    np.testing.assert_array_equal(data["obs"].numpy(), expected(stored, "obs")[SLOT_ORDER])
    np.testing.assert_array_equal(data["task"].numpy(), np.array([e["task"] for e in stored])[SLOT_ORDER])
    for name in FIELDS:
        torch.testing.assert_close(remote[name].mean, local[name].mean)
        torch.testing.assert_close(remote[name].std, local[name].std)
    torch.testing.assert_close(remote.episode_sums["reward"], local.episode_sums["reward"])


@pytest.mark.slow
@pytest.mark.xdist_group("dask_cluster")  # one xdist worker: one cluster (cluster_client) for both
def test_local_zarr_on_a_two_process_cluster(tmp_path, cluster_client):
    buffer = ReplayBuffer(
        tmp_path / "cluster", max_episodes=5, max_timesteps=16, fields=FIELDS, meta_fields=META, circular=True
    )
    check_on_cluster(cluster_client, buffer, fill(buffer)[2:])


@pytest.mark.slow
@pytest.mark.xdist_group("dask_cluster")
def test_s3_buffer_on_a_two_process_cluster(s3_server, cluster_client):
    buffer = ReplayBuffer(
        s3_server.url("analysis-cluster"),
        max_episodes=5,
        max_timesteps=16,
        fields=FIELDS,
        meta_fields=META,
        circular=True,
        storage_options=s3_server.storage_options,
    )
    stored = fill(buffer)[2:]
    reader = ReplayBuffer.from_folder(
        s3_server.url("analysis-cluster"), read_only=True, storage_options=s3_server.storage_options
    )
    check_on_cluster(cluster_client, reader, stored)


def _store_steps(writer: ReplayBuffer, uid: int, length: int) -> None:
    writer.store_episode(step=100 * uid + np.arange(length), uid=uid)


def _three_episodes_and_a_reader(location) -> tuple[ReplayBuffer, ReplayBuffer]:
    """A circular writer of 3 slots holding uids 1, 2, 3 (4, 3 and 2 steps; padding -1), and a
    read-only reader of it."""
    writer = ReplayBuffer(
        location,
        max_episodes=3,
        max_timesteps=24,
        fields={"step": ("int", (), -1)},
        meta_fields={"uid": "int"},
        circular=True,
    )
    for uid, length in ((1, 4), (2, 3), (3, 2)):
        _store_steps(writer, uid, length)
    return writer, ReplayBuffer.from_folder(location, read_only=True)


@pytest.mark.parametrize(
    ("scheduler", "slot_2"), [("sync", 3), ("threads", 3), (dask.get, 6)], ids=["sync", "threads", "dask.get"]
)
def test_get_all_data_rows_stay_whole_episodes_while_reads_are_replanned_wider_narrower_and_dropped(
    tmp_path, scheduler, slot_2
):
    """A writer rewrites slots after each read: slots 0 and 1 (re-planned 24 and 1 steps long:
    the rows grow), then slots 2 and 0 (9 steps: narrower) and a drop of slot 1. Each row is one
    whole episode its slot held, padded with the field's default, or a dropped slot's row of
    padding with length 0 and default meta values. Through dask (a scheduler elsewhere) a read
    naming a moved slot is read whole again, so it sees slot 2's rewrite too."""
    writer, reader = _three_episodes_and_a_reader(tmp_path / "b")
    read_spans, reads = reader.storage.read_spans, []
    lengths = {4: 24, 5: 1, 6: 5, 7: 9}

    def rewrite_after_each_read(name, episodes, *args, **kwargs):
        read_spans(name, episodes, *args, **kwargs)
        reads.append(sorted(map(int, episodes)))
        for uid in {1: (4, 5), 2: (6, 7)}.get(len(reads), ()):  # circular: slots 0, 1, then 2, 0
            _store_steps(writer, uid, lengths[uid])
        if len(reads) == 2:
            writer.drop_episodes([1])

    reader.storage.read_spans = rewrite_after_each_read
    got = get_all_data(reader, ["step"], ["uid", "episode_lens"], scheduler=scheduler)
    assert len(reads) == 3 and reads[:2] == [[0, 1, 2], [0, 1] if slot_2 == 3 else [0, 1, 2]]
    assert got["uid"].tolist() == [7, 0, slot_2] and got["step"].shape == (3, 9)
    assert got["episode_lens"].tolist() == [9, 0, lengths.get(slot_2, 2)]
    for row, uid in enumerate(got["uid"].tolist()):
        length = int(got["episode_lens"][row])
        assert got["step"][row, :length].tolist() == (100 * uid + np.arange(length)).tolist()
        assert (got["step"][row, length:] == -1).all(), f"row {row}: padding is the field's default"


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_to_dask_blocks_of_episodes_rewritten_after_planning_or_during_their_read_raise(tmp_path, scheduler):
    """A lazy array planned before slot 0 was reused, computed in blocks of one episode, slot 1
    reused between its block's read and its re-check: each of their blocks raises
    StalePlanError naming the slot (it used to read as padding under the planned length 4 and
    uid 1, which passed for data); row 2's block still reads whole, and after refresh() a new
    plan reads the new episodes."""
    writer, reader = _three_episodes_and_a_reader(tmp_path / "b")
    arrays = to_dask(reader, ["step"], ["uid", "episode_lens"], episodes_per_chunk=1, order="slot")
    _store_steps(writer, 4, 24)  # into slot 0
    read_spans, reads = reader.storage.read_spans, []

    def reuse_slot_1_after_its_read(name, episodes, *args, **kwargs):
        read_spans(name, episodes, *args, **kwargs)
        reads.append(list(map(int, episodes)))
        if reads[-1] == [1]:
            _store_steps(writer, 5, 9)  # into slot 1

    reader.storage.read_spans = reuse_slot_1_after_its_read
    with pytest.raises(StalePlanError, match=r"slots \[0\] of .* rewritten or dropped .* since these lazy arrays"):
        arrays["step"][0].compute(scheduler=scheduler)
    with pytest.raises(StalePlanError, match=r"slots \[1\]") as raised:
        arrays["step"][1].compute(scheduler=scheduler)
    assert isinstance(raised.value, ConcurrentWriteError) and raised.value.slots == [1]
    assert pickle.loads(pickle.dumps(raised.value)).slots == [1]  # crosses a distributed worker's pipe
    assert reads.count([1]) == 1, "a row whose slot moved is not read again as another episode"
    assert arrays["step"][2].compute(scheduler=scheduler).tolist() == [300, 301, -1, -1]
    step = to_dask(reader.refresh(), ["step"], [], order="slot")["step"].compute(scheduler=scheduler)
    assert step[:, :2].tolist() == [[400, 401], [500, 501], [300, 301]]
