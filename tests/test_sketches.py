"""Statistics sketches: stored by a writer's first stats() (commits write none), merged for any
set of episodes or any concatenation without reading data, quantiles within the KLL rank error
of exact ones."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer, sketches
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.sketches import KLL_K, PREFIX, decode, normalizer, summary
from replaybuf.storage.base import StorageError

from ._data import random_episode

FIELDS = {"state": ("float", (3,)), "reward": "float", "image": ("uint8", (16, 16, 3))}
QS = [0.01, 0.1, 0.5, 0.9, 0.99]


def episode(index: int, length: int = 200) -> dict[str, np.ndarray]:
    """Skewed, heavy-tailed states and rewards, so that quantiles are far from a normal's."""
    return random_episode(
        FIELDS,
        length,
        index,
        state=lambda rng, shape: rng.standard_normal(shape) ** 3 + index,
        reward=lambda rng, shape: rng.exponential(1.0, shape),
        image=lambda rng, shape: rng.integers(0, 255, shape, dtype=np.uint8),
    )


def make(path, count: int, first: int = 0, **options) -> ReplayBuffer:
    buffer = ReplayBuffer(
        path, max_episodes=options.pop("max_episodes", count), max_timesteps=200, fields=FIELDS, **options
    )
    for index in range(first, first + count):
        buffer.store_episode(**episode(index))
    return buffer


def assert_within_rank_error(summary_field, values: np.ndarray) -> None:
    """Each sketch quantile's rank in the exact data is within the stated rank error of q."""
    values = values.reshape(len(values), -1)
    got = summary_field.quantile(QS).reshape(len(QS), -1).numpy()
    error = summary_field.rank_error
    for feature in range(values.shape[1]):
        column = np.sort(values[:, feature].astype(np.float32))
        for q, estimate in zip(QS, got[:, feature]):
            low = np.searchsorted(column, estimate, side="left") / len(column)
            high = np.searchsorted(column, estimate, side="right") / len(column)
            assert low - error <= q <= high + error, (q, low, high, error)


def test_subsets_match_exact_values(tmp_path):
    buffer = make(tmp_path / "b", 8)
    assert buffer.storage.list_blobs(PREFIX) == [], "commits write no sketch"
    summary(buffer, ["reward"])  # the writer's first summary stores every sketched field's
    assert len(buffer.storage.list_blobs(PREFIX)) == 8, "one blob per committed episode"
    header = decode(buffer.storage.read_blob(f"{PREFIX}3"))
    assert set(header["fields"]) == {"state", "reward"}, "images are not sketched"
    for chosen in (None, [1, 4, 6]):
        slots = range(8) if chosen is None else chosen
        exact = {n: np.concatenate([episode(i)[n] for i in slots]) for n in ("state", "reward")}
        stats = summary(buffer, episodes=chosen)
        for name, values in exact.items():
            flat = values.reshape(len(values), -1).astype(np.float64)
            assert stats[name].count == len(values)
            np.testing.assert_allclose(stats[name].mean.reshape(-1), flat.mean(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(stats[name].std.reshape(-1), flat.std(0), rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(stats[name].min.reshape(-1), flat.min(0).astype(np.float32))
            np.testing.assert_array_equal(stats[name].max.reshape(-1), flat.max(0).astype(np.float32))
            assert_within_rank_error(stats[name], values)


def test_summary_reads_no_data_when_blobs_exist(tmp_path, monkeypatch):
    buffer = make(tmp_path / "b", 4)
    buffer.stats(["state"])
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    monkeypatch.setattr(reader.storage, "read_rows", lambda *a, **k: pytest.fail("summary read data"))
    monkeypatch.setattr(reader.storage, "read_spans", lambda *a, **k: pytest.fail("summary read data"))
    assert summary(reader)["reward"].count == 4 * 200
    del buffer


def test_overwritten_and_step_written_episodes(tmp_path):
    buffer = make(tmp_path / "b", 6, max_episodes=4, circular=True)  # episodes 4, 5 overwrite slots 0, 1
    summary(buffer)
    with buffer.one_episode():  # step by step
        for step in episode(99, 200)["reward"]:
            buffer.store(reward=step, state=np.zeros(3, np.float32))
    kept = {3: 3, 0: 4, 1: 5, 2: 99}  # slot -> episode; slot 2's blob is episode 2's until replaced
    assert decode(buffer.storage.read_blob(f"{PREFIX}2"))["generation"] == 3
    values = np.concatenate([episode(i)["reward"] for i in kept.values()])
    stats = summary(buffer, ["reward"])["reward"]
    assert decode(buffer.storage.read_blob(f"{PREFIX}2"))["generation"] == buffer._meta["_generation"][2] == 7
    assert stats.count == len(values)
    np.testing.assert_allclose(float(stats.mean), values.mean(), rtol=1e-5)
    assert_within_rank_error(stats, values)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_overwrite_true_erases_the_old_buffers_sketches(tmp_path, backend):
    """A new buffer counts generations from 1 again: a sketch left by the buffer it replaced
    named the same slot and generation and was merged into its stats (mean 0 for data of 5)."""
    path = tmp_path / "b"
    old = ReplayBuffer(path, max_episodes=2, max_timesteps=200, fields={"x": "float"}, backend=backend)
    old.store_episode(x=np.zeros(200, np.float32))
    assert old.stats(["x"])["x"].mean == 0 and old.storage.list_blobs(PREFIX)
    old.close()
    new = ReplayBuffer(path, max_episodes=2, max_timesteps=200, fields={"x": "float"}, backend=backend)
    assert new.storage.list_blobs(PREFIX) == []
    new.store_episode(x=np.full(200, 5, np.float32))
    assert new.stats(["x"])["x"].mean == 5 and new.stats(["x"], exact=True)["x"].mean == 5
    new.close()


def test_damaged_and_older_blobs_are_sketched_again(tmp_path):
    buffer = make(tmp_path / "b", 3)
    buffer.stats(["state"])
    header = decode(buffer.storage.read_blob(f"{PREFIX}1"))
    for field in header["fields"].values():  # an older release's blob: a sum of squares, no m2
        field["sumsq"] = field.pop("m2")
    body = json.dumps(
        {**header, "fields": {n: {**f, "kll": [len(b) for b in f["kll"]]} for n, f in header["fields"].items()}}
    )
    older = (
        b"RBSK"
        + struct.pack("<I", len(body))
        + body.encode()
        + b"".join(b for f in header["fields"].values() for b in f["kll"])
    )
    buffer.storage.write_blob(f"{PREFIX}1", older)
    buffer.storage.write_blob(f"{PREFIX}2", b"RBSK\xff\xff")
    stats = buffer.stats(["state"])["state"]
    values = np.concatenate([episode(i)["state"] for i in range(3)]).astype(np.float64)
    assert stats.count == len(values)
    np.testing.assert_allclose(stats.std.numpy(), values.std(0), rtol=1e-5)
    assert_within_rank_error(stats, values)
    for slot in (1, 2):  # stored again, in the current layout
        assert set(decode(buffer.storage.read_blob(f"{PREFIX}{slot}"))["fields"]["state"]) >= {"m2", "kll"}


@pytest.mark.parametrize("damage", ["sum digit", "kll byte", "truncated"])
def test_a_damaged_blob_is_never_served(tmp_path, damage):
    """A blob whose bytes changed on disk (a digit of a sum, a byte of a KLL sketch, a lost
    tail) fails its crc32 and is sketched again: before, a changed digit of a sum moved the
    mean silently and a truncated blob made quantile() fail."""
    buffer = make(tmp_path / "b", 2)
    buffer.stats(["state"])
    blob = bytearray(buffer.storage.read_blob(f"{PREFIX}0"))
    if damage == "truncated":
        del blob[-50:]
    else:
        at = blob.index(b'"sum": [') + 9 if damage == "sum digit" else len(blob) - 100
        blob[at] = ord("7") if blob[at] != ord("7") else ord("3")
    buffer.storage.write_blob(f"{PREFIX}0", bytes(blob))
    values = np.concatenate([episode(i)["state"] for i in range(2)]).astype(np.float64)
    for reader in (ReplayBuffer.from_folder(tmp_path / "b", read_only=True), buffer):
        stats = reader.stats(["state"])["state"]
        np.testing.assert_allclose(stats.mean.numpy(), values.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats.std.numpy(), values.std(0), rtol=1e-4, atol=1e-5)
        assert_within_rank_error(stats, values)
    assert decode(buffer.storage.read_blob(f"{PREFIX}0"))["generation"] == 1, "the writer stored it again"
    with pytest.raises(ValueError, match="crc32|not a current"):
        decode(bytes(blob))


@pytest.mark.parametrize("edit", ["update", "store_datapoint", "data[...]", "update_steps"])
def test_an_episode_edited_in_place_is_sketched_again(tmp_path, edit):
    """A blob named its episode's generation only: after an in-place edit stats() kept
    merging the blob of the values before it (the mean of the old rewards), in the writer and
    in every reader."""
    buffer = make(tmp_path / "b", 2)
    buffer.stats(["reward"])
    if edit == "update":
        buffer.update(1, reward=np.full(200, 50.0, np.float32))
    elif edit == "store_datapoint":
        buffer.store_datapoint(1, 3, "reward", 50.0)
    elif edit == "data[...]":
        buffer.data["reward"][1, 3] = 50.0
    else:
        buffer.update_steps([1], [3], reward=np.array([50.0], np.float32))
    values = np.concatenate([buffer.data["reward"][slot, :200] for slot in range(2)]).astype(np.float64)
    assert values.max() == 50.0
    for reader in (buffer, ReplayBuffer.from_folder(tmp_path / "b", read_only=True)):
        stats = reader.stats(["reward"])["reward"]
        np.testing.assert_allclose(float(stats.mean), values.mean(), rtol=1e-6)
        assert float(stats.max) == 50.0
        assert_within_rank_error(stats, values)


def test_min_max_and_sums_of_int64_beyond_2_53(tmp_path):
    """Nanosecond timestamps (~1.7e18): the sketches' min and max went through float64 (rounded
    to a multiple of 256, unlike stats(exact=True)), and exact=True summed each episode in int64,
    which wrapped around to a negative 'return'."""
    fields = {"stamp": ("int64", (2,)), "t": ("int64", ())}
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=KLL_K, fields=fields)
    stamps = [
        1_700_000_000_123_456_789 + np.arange(KLL_K * 2, dtype=np.int64).reshape(KLL_K, 2) * 7 + i for i in (1, 3)
    ]
    for values in (stamps[0], stamps[1][:50]):  # a stored blob, and an episode sketched from its data
        buffer.store_episode(stamp=values, t=values[:, 0])
    every = np.concatenate([stamps[0], stamps[1][:50]])
    sums = [float(stamps[0][:, 0].astype(np.float64).sum()), float(stamps[1][:50, 0].astype(np.float64).sum())]
    for exact in (False, True):
        stats = buffer.stats(["stamp", "t"], exact=exact)
        assert stats["stamp"].min.tolist() == every.min(0).tolist()
        assert stats["stamp"].max.tolist() == every.max(0).tolist()
        np.testing.assert_allclose(stats.episode_sums["t"].numpy(), sums, rtol=1e-12)


def fail_on_data_reads(buffer, monkeypatch) -> None:
    for name in ("read_rows", "read_spans", "gather"):
        monkeypatch.setattr(buffer.storage, name, lambda *a, **k: pytest.fail("read data"))


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_every_write_path_is_sketched_by_the_writers_stats(tmp_path, monkeypatch, backend):
    """Episodes of at least KLL_K steps (shorter ones get no blob) written by store,
    store_batch, a long episode whose first steps left RAM before the commit (memmap rows are
    1-step chunks, written every 256 bytes here), a rewound one and a recovered step log all
    get a blob of every sketched field from a writer's stats() of one field: a reader's
    stats() then reads no data."""
    monkeypatch.setattr("replaybuf.staging.WRITE_SPAN_BYTES", 256)
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=8, max_timesteps=3000, fields=FIELDS, backend=backend)
    data = {i: episode(i, 3000) for i in range(4)}
    with buffer.one_episode():
        for t in range(KLL_K):
            buffer.store(state=data[0]["state"][t], reward=data[0]["reward"][t])
    with buffer.batched_episode(2):
        for t in range(KLL_K):
            buffer.store_batch(state=np.stack([data[1]["state"][t], data[2]["state"][t]]))
    with buffer.one_episode():
        for t in range(3000):
            buffer.store(state=data[3]["state"][t], reward=data[3]["reward"][t])
    for t in range(KLL_K + 1):
        buffer.store(state=np.full(3, 50.0 + t, np.float32))
    buffer.timestep_index = KLL_K  # the last step is rewound away
    buffer.advance_episode()
    for _ in range(KLL_K):
        buffer.store(state=np.full(3, 7.0, np.float32), reward=1.0)
    buffer.flush()
    del buffer  # killed with its steps logged: the next writable open recovers it
    writer = ReplayBuffer.from_folder(tmp_path / "b", backend=backend)
    assert writer.storage.list_blobs(PREFIX) == []
    writer.stats(["reward"])
    writer.close()
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True, backend=backend)
    assert len(reader.storage.list_blobs(PREFIX)) == 6
    exact = reader.stats(["state", "reward"], exact=True)
    fail_on_data_reads(reader, monkeypatch)
    merged = reader.stats(["state", "reward"])
    states = [data[0]["state"][:KLL_K], data[1]["state"][:KLL_K], data[2]["state"][:KLL_K], data[3]["state"]]
    states += [
        50.0 + np.repeat(np.arange(KLL_K, dtype=np.float32)[:, None], 3, 1),
        np.full((KLL_K, 3), 7.0, np.float32),
    ]
    assert merged["state"].count == exact["state"].count == sum(len(s) for s in states)
    np.testing.assert_allclose(merged["state"].mean, exact["state"].mean, rtol=1e-5)
    np.testing.assert_allclose(merged["state"].std, exact["state"].std, rtol=1e-5)
    torch.testing.assert_close(merged.episode_lens, exact.episode_lens)
    torch.testing.assert_close(merged.episode_sums["reward"], exact.episode_sums["reward"])
    assert_within_rank_error(merged["state"], np.concatenate(states))


def test_stats_of_subsets_against_exact_dask(tmp_path):
    make(tmp_path / "b", 6, max_episodes=5, circular=True).close()  # slot 0 holds episode 5
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    for chosen in (None, [0, 3], [4]):
        merged = reader.stats(episodes=chosen)
        exact = reader.stats(episodes=chosen, exact=True)
        assert merged.num_episodes == exact.num_episodes
        torch.testing.assert_close(merged.episode_lens, exact.episode_lens)
        for name in ("state", "reward", "image"):
            assert merged[name].count == exact[name].count
            torch.testing.assert_close(merged[name].mean, exact[name].mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(merged[name].std, exact[name].std, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(merged[name].min, exact[name].min)
            torch.testing.assert_close(merged[name].max, exact[name].max)
        torch.testing.assert_close(merged.episode_sums["reward"], exact.episode_sums["reward"], rtol=1e-5, atol=1e-4)
    # quantiles against the exact values dask computes over the valid steps
    arrays, mask = reader.to_dask(["state"]), reader.episode_mask()
    values = arrays["state"].reshape(-1, 3)[mask.reshape(-1)].compute()
    assert_within_rank_error(reader.stats(["state"])["state"], values)
    with pytest.raises(ValueError, match="carry no quantile sketches"):
        reader.stats(["state"], exact=True)["state"].quantile(0.5)
    with pytest.raises(ValueError, match="carry no quantile sketches"):
        reader.stats(["image"])["image"].quantile(0.5)
    with pytest.raises(ValueError, match=r"stats: episodes \[7\] hold no committed episode"):
        reader.stats(episodes=[0, 7])


def test_concatenation(tmp_path):
    first, second = make(tmp_path / "a", 3), make(tmp_path / "b", 5, first=3)
    both = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
    values = np.concatenate([episode(i)["state"] for i in range(8)])
    stats = summary(both, ["state"])["state"]
    assert stats.count == len(values)
    np.testing.assert_allclose(stats.mean.numpy(), values.astype(np.float64).mean(0), rtol=1e-5, atol=1e-5)
    assert_within_rank_error(stats, values)
    merged, exact = both.stats(["state"], episodes=[1, 2, 6]), both.stats(["state"], episodes=[1, 2, 6], exact=True)
    torch.testing.assert_close(merged["state"].mean, exact["state"].mean, rtol=1e-5, atol=1e-5)
    assert_within_rank_error(merged["state"], np.concatenate([episode(i)["state"] for i in (1, 2, 6)]))
    del first, second


def test_normalizers(tmp_path):
    buffer = make(tmp_path / "b", 4)
    values = torch.from_numpy(np.concatenate([episode(i)["state"] for i in range(4)]))
    standard = normalizer(buffer, "state")(values)
    torch.testing.assert_close(standard.mean(0), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(standard.std(0, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)
    scaled = normalizer(buffer, "state", kind="quantile", q=(0.05, 0.95))
    inside = ((scaled(values) >= -1) & (scaled(values) <= 1)).float().mean(0)
    assert ((inside > 0.85) & (inside < 0.95)).all(), inside
    torch.testing.assert_close(scaled.unnormalize(scaled(values)), values, atol=1e-3, rtol=1e-5)


def test_normalizers_take_numpy_arrays(tmp_path):
    """An observation from an environment is a numpy array: torch's operators refused it
    ("unsupported operand type(s) for -: 'numpy.ndarray' and 'Tensor'")."""
    buffer = make(tmp_path / "b", 4)
    values = np.concatenate([episode(i)["state"] for i in range(4)])
    for kind in ("meanstd", "quantile"):
        norm = normalizer(buffer, "state", kind=kind)
        out = norm(values[:5])
        assert isinstance(out, np.ndarray)
        np.testing.assert_allclose(out, norm(torch.from_numpy(values[:5])).numpy(), rtol=1e-6)
        np.testing.assert_allclose(norm.unnormalize(out), values[:5], rtol=1e-5, atol=1e-5)
        assert isinstance(norm(values[0].tolist()), np.ndarray)


def test_errors(tmp_path):
    buffer = make(tmp_path / "b", 2, max_episodes=3)
    with pytest.raises(ValueError, match=r"fields \['image'\] have no sketches"):
        summary(buffer, ["image"])
    with pytest.raises(ValueError, match=r"episodes \[2\] hold no committed episode"):
        summary(buffer, episodes=[0, 2])
    with pytest.raises(ValueError, match="kind must be 'meanstd' or 'quantile'"):
        normalizer(buffer, "state", kind="minmax")
    with pytest.raises(ValueError, match="q must be in"):
        summary(buffer)["state"].quantile(1.5)
    with pytest.raises(ValueError, match="q must be in"):
        summary(buffer)["state"].quantile(float("nan"))  # NaN compared False both ways: was accepted
    with pytest.raises(ValueError, match=r"episodes lists slot\(s\) \[0\] more than once"):
        buffer.stats(["state"], episodes=[0, 0, 1])  # slot 0 was counted twice
    with pytest.raises(ValueError, match=r"q must be two quantiles 0 <= low < high <= 1, got \(0.99, 0.01\)"):
        normalizer(buffer, "state", kind="quantile", q=(0.99, 0.01))  # was a scale of eps: values x 1e8
    with pytest.raises(ValueError, match=r"q must be two quantiles 0 <= low < high <= 1, got 0.5"):
        normalizer(buffer, "state", kind="quantile", q=0.5)  # was TypeError: object of type 'float' has no len()
    for eps in (float("nan"), 0, -1.0, "x"):  # NaN gave all-NaN values, 0 or less inf for a constant feature
        with pytest.raises(ValueError, match=f"normalizer: eps must be a finite number > 0, got {eps!r}"):
            normalizer(buffer, "state", eps=eps)
    with pytest.raises(ValueError, match=r"quantile: q must be in \[0, 1\], got 'x'"):
        summary(buffer)["state"].quantile("x")  # was: could not convert string to float: 'x'
    for slots in ([0.5, 1], [True], ["0"]):  # 0.5 and True were read as slots 0 and 1
        with pytest.raises(ValueError, match=r"stats: episodes must be slots \(ints\), got "):
            buffer.stats(["state"], episodes=slots)


def test_quantiles_0_and_1_are_the_exact_min_and_max(tmp_path):
    """A merged KLL sketch keeps a sample of the values: its 0 and 1 quantiles were the least
    and largest values it kept, not the data's."""
    buffer = make(tmp_path / "b", 4)
    for name in ("state", "reward"):
        values = np.concatenate([episode(i)[name] for i in range(4)]).astype(np.float32)
        stats = buffer.stats([name])[name]
        ends = stats.quantile([0.0, 0.5, 1.0])
        np.testing.assert_array_equal(ends[0].numpy(), values.min(0))
        np.testing.assert_array_equal(ends[2].numpy(), values.max(0))
        np.testing.assert_array_equal(stats.quantile(1.0).numpy(), values.max(0))
        assert_within_rank_error(stats, values)


def test_quantile_of_a_scalar_field(tmp_path):
    """One q of a scalar field (rewards) is a 0-d tensor; it raised TypeError (a numpy scalar)."""
    buffer = make(tmp_path / "b", 2)
    rewards = np.concatenate([episode(i)["reward"] for i in range(2)])
    stats = buffer.stats(["reward"])["reward"]
    median = stats.quantile(0.5)
    assert median.shape == () and median.dtype == torch.float32
    assert abs((rewards <= median.item()).mean() - 0.5) <= stats.rank_error
    assert stats.quantile([0.5]).shape == (1,)


def test_short_episodes_get_no_blob_and_are_sketched_from_their_data(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=4, max_timesteps=KLL_K, fields=FIELDS)
    short = episode(1, KLL_K - 1)
    buffer.store_episode(**short)
    stats = buffer.stats(["reward"])["reward"]
    assert buffer.storage.list_blobs(PREFIX) == []
    assert stats.count == KLL_K - 1
    np.testing.assert_allclose(float(stats.mean), short["reward"].mean(), rtol=1e-5)


def test_read_only_reader_sketches_from_data_and_stores_nothing(tmp_path):
    """A reader of a buffer whose writer never asked for statistics: the same figures, from the
    data, and no blob (it cannot write); the writer's own stats() then stores them."""
    writer = make(tmp_path / "b", 3)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    values = np.concatenate([episode(i)["state"] for i in range(3)])
    for _ in range(2):
        stats = reader.stats(["state"])["state"]
        assert stats.count == len(values)
        np.testing.assert_allclose(stats.mean.numpy(), values.astype(np.float64).mean(0), rtol=1e-5, atol=1e-5)
        assert_within_rank_error(stats, values)
        assert reader.storage.list_blobs(PREFIX) == []
    writer.stats(["state"])
    assert len(reader.storage.list_blobs(PREFIX)) == 3


def test_a_readers_stats_leave_out_an_episode_rewritten_while_it_is_sketched(tmp_path):
    """Slot 0 reused after the reader's read of the data it sketches from: its figures, length
    and return are left out together; the other episodes' are exact."""
    writer = ReplayBuffer(tmp_path / "b", max_episodes=3, max_timesteps=200, fields={"reward": "float"}, circular=True)
    for index in range(3):
        writer.store_episode(reward=episode(index)["reward"])
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    read_rows, reads = reader.storage.read_rows, []

    def reuse_slot_0_after_the_first_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        reads.append(sorted(map(int, episodes)))
        if len(reads) == 1:
            writer.store_episode(reward=episode(9, 50)["reward"])
        return rows

    reader.storage.read_rows = reuse_slot_0_after_the_first_read
    got = reader.stats(["reward"])
    assert reads == [[0, 1, 2]] and got.episode_lens.tolist() == [200, 200]
    rewards = [episode(i)["reward"] for i in (1, 2)]
    np.testing.assert_allclose(got.episode_sums["reward"].numpy(), [r.sum() for r in rewards], rtol=1e-5)
    assert got["reward"].count == 400
    np.testing.assert_allclose(got["reward"].mean.numpy(), np.concatenate(rewards).mean(), rtol=1e-5)


def test_a_refused_blob_write_warns_once_and_stats_goes_on(tmp_path, monkeypatch):
    buffer = make(tmp_path / "b", 3)
    write_blob = buffer.storage.write_blob

    def refuse(key: str, data: bytes) -> None:
        raise StorageError(f"disk full writing {key}")

    monkeypatch.setattr(buffer.storage, "write_blob", refuse)
    with pytest.warns(UserWarning, match=r"could not store the statistics sketch of slot 0 .* disk full") as caught:
        stats = buffer.stats(["reward"])["reward"]
    assert len(caught) == 1, "one warning, not one per episode"
    values = np.concatenate([episode(i)["reward"] for i in range(3)])
    np.testing.assert_allclose(float(stats.mean), values.mean(), rtol=1e-5)
    assert_within_rank_error(stats, values)
    assert buffer.storage.list_blobs(PREFIX) == []
    monkeypatch.setattr(buffer.storage, "write_blob", write_blob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer.stats(["reward"])
    assert len(buffer.storage.list_blobs(PREFIX)) == 3


def test_sketching_from_data_reads_a_bounded_batch_at_a_time(tmp_path, monkeypatch):
    """A first stats() of a large buffer reads its episodes READ_BYTES at a time (here one
    episode: state f32[3] + reward f32 = 16 bytes a step), not the whole buffer at once."""
    buffer = make(tmp_path / "b", 3)
    monkeypatch.setattr(sketches, "READ_BYTES", 16 * 200)
    reads = []
    read = sketches.read_episodes_consistent
    monkeypatch.setattr(
        sketches,
        "read_episodes_consistent",
        lambda b, slots, *a, **k: reads.append(len(slots)) or read(b, slots, *a, **k),
    )
    stats = buffer.stats(["state"])["state"]
    assert reads == [1, 1, 1]
    values = np.concatenate([episode(i)["state"] for i in range(3)])
    np.testing.assert_allclose(stats.std.numpy(), values.astype(np.float64).std(0), rtol=1e-5)
    assert_within_rank_error(stats, values)


def test_short_episodes_sketched_from_data_share_one_sketch_per_read(tmp_path, monkeypatch):
    """Episodes whose blobs are not stored (shorter than KLL_K steps, or a read-only buffer) are
    sketched together, one KLL sketch per feature per read of READ_BYTES, not one per episode
    serialized, parsed and merged (stats() of 100,000 5-step episodes took 76 s and 830 MB);
    moments, returns and quantiles stay those of the values."""
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=40, max_timesteps=KLL_K, fields=FIELDS)
    episodes = [episode(i, 3 + i % 5) for i in range(40)]
    for one in episodes:
        buffer.store_episode(**one)
    monkeypatch.setattr(sketches, "READ_BYTES", 16 * KLL_K * 16)  # 16 episodes a read: 3 reads
    for reader in (buffer, ReplayBuffer.from_folder(tmp_path / "b", read_only=True)):
        stats = reader.stats(["state", "reward"])
        assert [len(parts) for parts in stats["state"].sketches._parts] == [3, 3, 3]
        assert buffer.storage.list_blobs(PREFIX) == [], "no blob of a short episode is stored"
        for name in ("state", "reward"):
            values = np.concatenate([one[name] for one in episodes]).astype(np.float64)
            flat = values.reshape(len(values), -1)
            np.testing.assert_allclose(stats[name].mean.reshape(-1), flat.mean(0), rtol=1e-5)
            np.testing.assert_allclose(stats[name].std.reshape(-1), flat.std(0), rtol=1e-4)
            assert_within_rank_error(stats[name], values)
        returns = [one["reward"].astype(np.float64).sum() for one in episodes]
        np.testing.assert_allclose(stats.episode_sums["reward"].numpy(), returns, rtol=1e-6)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(1).standard_normal((300, 5)).astype(np.float32) * 1e3 + 1e4,
        np.random.default_rng(2).integers(0, 200, (300, 4)).astype(np.uint8),
        np.random.default_rng(3).integers(-(2**40), 2**40, (300, 2)),
        np.random.default_rng(4).random((300, 3)) > 0.5,
        np.array([[1.0, np.nan, 5.0], [2.0, 3.0, -1.0]]),
    ],
    ids=["float32", "uint8", "int64", "bool", "nan"],
)
def test_episode_moments_match_numpy(values):
    """Count, sum, m2, min and max of one episode (sorted per feature before sketching) are
    numpy's over the original values, NaN included (a NaN feature has NaN moments, as np.min)."""
    header, blobs = sketches._field_sketch(values)
    exact = values.astype(np.float64)
    assert header["count"] == len(values) and len(blobs) == values.shape[1]
    np.testing.assert_allclose(header["sum"], exact.sum(0), rtol=1e-12)
    np.testing.assert_allclose(header["m2"], np.square(exact - exact.mean(0)).sum(0), rtol=1e-9)
    np.testing.assert_array_equal(header["min"], exact.min(0))
    np.testing.assert_array_equal(header["max"], exact.max(0))


def test_a_writer_reads_every_sketched_field_only_for_the_blobs_it_stores(tmp_path, monkeypatch):
    """A writer's stats(['reward']) reads state too for an episode whose blob it stores (one
    blob holds every sketched field), and only reward for a short one (no blob, read again)."""
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=4, max_timesteps=KLL_K, fields=FIELDS)
    short, long = episode(1, KLL_K - 1), episode(2, KLL_K)
    buffer.store_episode(**short)
    buffer.store_episode(**long)
    reads = []
    read = sketches.read_episodes_consistent

    def spy(b, slots, fields, *args, **kwargs):
        reads.append((np.asarray(slots).tolist(), list(fields)))
        return read(b, slots, fields, *args, **kwargs)

    monkeypatch.setattr(sketches, "read_episodes_consistent", spy)
    for expected in ([([1], ["state", "reward"]), ([0], ["reward"])], [([0], ["reward"])]):
        reads.clear()
        stats = buffer.stats(["reward"])["reward"]
        assert reads == expected
        assert buffer.storage.list_blobs(PREFIX) == [f"{PREFIX}1"]
        values = np.concatenate([short["reward"], long["reward"]])
        np.testing.assert_allclose(float(stats.mean), values.mean(), rtol=1e-5)
        assert_within_rank_error(stats, values)


def test_quantiles_without_datasketches_name_the_install(tmp_path, monkeypatch):
    """The README's stats block in an install without the ``sketches`` extra: ``quantile`` said
    "these statistics carry no quantile sketches (stats(exact=True), or a field that is not
    sketched ...)", none of which the user did, and not what to install."""
    buffer = make(tmp_path / "b", 1)
    monkeypatch.setattr(sketches, "available", lambda: False)  # as where datasketches is not installed
    stats = buffer.stats(["state"])
    assert stats["state"].count == 200  # mean, std, min and max need no sketches
    with pytest.raises(ImportError, match=r"quantile needs Apache DataSketches.*pip install 'replaybuf\[sketches\]'"):
        stats["state"].quantile([0.01, 0.99])
