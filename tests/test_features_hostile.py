"""The features beyond the peers used as a careless user or an attacker would: a priority update
that arrives after its slot was reused, quantiles of adversarial values (NaN, only NaN, float64
beyond float32's range, int64 timestamps)."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch

from replaybuf import ConcatReplayBuffer, ReplayBuffer, sketches, snapshots
from replaybuf.sketches import KLL_K
from replaybuf.snapshots import SnapshotError

PRIORITY_FIELDS = {"ident": "int", "priority": "float"}


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_late_priority_update_never_lands_on_the_episode_that_reused_the_slot(tmp_path, backend):
    """A learner draws a batch, its actor stores an episode into the slot the batch came from
    (circular buffer), then the learner writes the batch's priorities back: the new episode's
    priorities stay as its actor stored them; the still-live pairs are written."""
    buffer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=4, fields=PRIORITY_FIELDS, circular=True, backend=backend
    )
    buffer.store_episode(ident=np.arange(4), priority=np.ones(4))
    buffer.store_episode(ident=np.arange(4) + 10, priority=np.ones(4))
    loader = buffer.dataloader(
        batch_size=64, timestep_level=True, sampler="prioritized", priority_field="priority", seed=0
    )
    batch = next(iter(loader))
    drawn = batch["_indices"].numpy()
    assert set(drawn[:, 0].tolist()) == {0, 1}, "the batch names both slots"
    np.testing.assert_array_equal(batch["_generations"].numpy(), buffer.generations[drawn[:, 0]])
    buffer.store_episode(ident=np.arange(4) + 20, priority=np.full(4, 7.0))  # reuses slot 0

    written = buffer.update_priorities(batch["_indices"], np.full(64, 0.5), generations=batch["_generations"])

    assert written == int((drawn[:, 0] == 1).sum())
    data = buffer.get_all_data()
    by_ident = {int(ident[0]): row for ident, row in zip(data["ident"].numpy(), data["priority"].numpy())}
    expected_old = np.where(np.isin(np.arange(4), drawn[drawn[:, 0] == 1, 1]), 0.5, 1.0)
    np.testing.assert_array_equal(by_ident[10], expected_old)
    np.testing.assert_array_equal(by_ident[20], np.full(4, 7.0)), "the new episode keeps its priorities"


def test_bad_generations_and_priorities_are_refused_naming_them(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=4, fields=PRIORITY_FIELDS)
    buffer.store_episode(ident=np.arange(4), priority=np.ones(4))
    pairs = np.array([[0, 1], [0, 2]])
    with pytest.raises(ValueError, match=r"generations must be one int per pair, shape \(2,\).*shape \(1,\)"):
        buffer.update_priorities(pairs, [1.0, 2.0], generations=[1])
    with pytest.raises(ValueError, match=r"generations must be one int per pair.*float64"):
        buffer.update_priorities(pairs, [1.0, 2.0], generations=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"priorities must be numbers, got a <U1 array"):
        buffer.update_priorities(pairs, ["a", "b"])
    np.testing.assert_array_equal(buffer.get_all_data()["priority"].numpy(), np.ones((1, 4))), "nothing written"


STEPS = KLL_K  # the shortest episode that gets a stored sketch blob
QS = [0.01, 0.25, 0.5, 0.75, 0.99]


def assert_quantiles_within_rank_error(stats_field, values: np.ndarray) -> None:
    """Each sketch quantile's rank among ``values`` (compared exactly, in float64) is within the
    stated rank error of q."""
    got = stats_field.quantile(QS).numpy().astype(np.float64)
    column = np.sort(values.astype(np.float64))
    for q, estimate in zip(QS, got):
        low = np.searchsorted(column, estimate, side="left") / len(column)
        high = np.searchsorted(column, estimate, side="right") / len(column)
        assert low - stats_field.rank_error <= q <= high + stats_field.rank_error, (q, estimate, low, high)


def wide_episode(index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(index)
    return {
        "huge": rng.uniform(-1e300, 1e300, STEPS),  # finite float64 beyond float32's range
        "stamp": 1_700_000_000_000_000_000 + rng.integers(0, 10**6, STEPS),  # int64 ns timestamps
        "count": rng.integers(16_777_216, 16_777_316, STEPS),  # int32 beyond float32's 2**24
    }


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the std of +-1e300 values
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_quantiles_of_values_float32_would_round(tmp_path, backend, monkeypatch):
    """float64 beyond float32's range, int64 timestamps and int32 counts above 2**24: a float32
    sketch made every quantile inf or the same rounded value; each is within the rank error,
    from the data (first call), from the stored blobs, and after blobs of float32 sketches (an
    older release's) are sketched again."""
    fields = {"huge": "float64", "stamp": "int64", "count": "int32"}
    episodes = [wide_episode(i) for i in range(3)]
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=3, max_timesteps=STEPS, fields=fields, backend=backend)
    with monkeypatch.context() as patch:  # an older release's blobs: float32 sketches of every field
        patch.setattr(sketches, "sketch_kind", lambda dtype: "kll_floats", raising=False)
        for episode in episodes:
            buffer.store_episode(**episode)
        buffer.stats()
    assert len(buffer.storage.list_blobs(sketches.PREFIX)) == 3
    for call in ("older blobs sketched again", "from the stored blobs"):
        stats = buffer.stats()
        for name in fields:
            assert stats[name].quantile(QS).dtype == torch.float64, (call, name)
            assert_quantiles_within_rank_error(stats[name], np.concatenate([e[name] for e in episodes]))
        stored = sketches.decode(buffer.storage.read_blob(f"{sketches.PREFIX}0"))
        assert {f["sketch"] for f in stored["fields"].values()} == {"kll_doubles"}, "stored again, as doubles"


def test_quantiles_of_features_holding_nan_are_nan(tmp_path):
    """A feature holding NaN has NaN quantiles, as its mean, min and max (np.quantile's answer),
    and one holding only NaN too: its sketch is empty, which raised a bare RuntimeError."""
    rng = np.random.default_rng(0)
    state = rng.standard_normal((STEPS, 3)).astype(np.float32)
    state[::10, 1] = np.nan
    state[:, 2] = np.nan
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=STEPS, fields={"state": ("float", (3,))})
    buffer.store_episode(state=state)
    with np.errstate(invalid="ignore"):
        stats = buffer.stats()["state"]
    quantiles = stats.quantile(QS).numpy()
    assert np.isnan(quantiles[:, 1:]).all()
    assert np.isnan(stats.quantile(0.5).numpy()[1:]).all()
    assert_quantiles_within_rank_error(stats_of_feature(stats, 0), state[:, 0])
    np.testing.assert_array_equal(np.isnan(stats.mean.numpy()), [False, True, True])


def stats_of_feature(stats_field, feature: int):
    """A view of one feature of a (features,) field's statistics, for the rank check."""

    class One:
        rank_error = stats_field.rank_error

        @staticmethod
        def quantile(qs):
            return stats_field.quantile(qs)[:, feature]

    return One


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_an_episode_stored_after_a_reopen_recounted_fewer_is_listed(tmp_path, backend):
    """A circular writer drops its only episode and is reopened: the open recounted num_episodes
    as 0 (the next slot still 1), so the episodes stored next, in slots 1 and 2, counted 1 and 2
    commits and get_all_data, and a snapshot of them, listed slots 0 .. 1 and hid one. The
    dropped slot stays a row of padding, as before the reopen."""
    options = dict(max_episodes=4, max_timesteps=5, fields={"x": "float"}, circular=True, backend=backend)
    buffer = ReplayBuffer(tmp_path / "b", **options)
    buffer.store_episode(x=np.zeros(3))
    buffer.drop_episodes([0])
    buffer.close()
    buffer = ReplayBuffer.from_folder(tmp_path / "b")
    buffer.store_episode(x=np.full(3, 1.0))
    buffer.store_episode(x=np.full(3, 2.0))
    assert buffer.valid_episodes().tolist() == [1, 2]
    buffer.snapshot("s")
    view = ReplayBuffer.from_folder(tmp_path / "b", snapshot="s")
    for reader in (buffer, view):
        rows = reader.get_all_data()["x"].numpy()
        assert sorted(rows[:, 0].tolist()) == [0.0, 1.0, 2.0], "slot 0 is a row of padding; slots 1, 2 listed"


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"num_episodes": 10**18}, r"num_episodes is 1000000000000000000, over max_episodes 3"),
        ({"episode_index": 3}, r"episode_index is 3, expected < max_episodes 3"),
    ],
)
def test_a_snapshot_with_absurd_counters_is_named_damaged(tmp_path, state, problem):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=3, max_timesteps=5, fields={"x": "float"})
    buffer.store_episode(x=np.zeros(3))
    buffer.snapshot("s")
    key = snapshots.key("s")
    document = json.loads(buffer.storage.read_blob(key))
    document["state"].update(state)
    buffer.storage.write_blob(key, json.dumps(document).encode())
    with pytest.raises(SnapshotError, match=rf"snapshot 's' is damaged \(.*snapshot.json.*\): 'state': {problem}"):
        ReplayBuffer.from_folder(tmp_path / "b", snapshot="s")


def reencode(blob: bytes, change) -> bytes:
    """``blob`` with ``change`` applied to its header and its crc32 recomputed: damage that the
    checksum cannot see."""
    (size,) = struct.unpack("<I", blob[8:12])
    header = json.loads(blob[12 : 12 + size])
    change(header["fields"]["state"])
    encoded = json.dumps(header).encode()
    body = struct.pack("<I", len(encoded)) + encoded + blob[12 + size :]
    return blob[:4] + struct.pack("<I", zlib.crc32(body)) + body


@pytest.mark.parametrize(
    "change",
    [
        lambda field: field.update(count=0),  # ZeroDivisionError
        lambda field: field.update(count=field["count"] * 1000),  # the mean weighted 1000x, silently
        lambda field: field.update(min=["a"] * len(field["min"])),  # ValueError from numpy
        lambda field: field.update(sum=field["sum"][:1]),  # one feature's sum broadcast to all
        lambda field: field.update(m2=None),
    ],
    ids=["count 0", "count x1000", "min strings", "sum short", "m2 null"],
)
def test_a_sketch_header_that_does_not_fit_its_episode_is_sketched_again(tmp_path, change):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=STEPS, fields={"state": ("float", (2,))})
    rng = np.random.default_rng(0)
    for _ in range(2):
        buffer.store_episode(state=rng.standard_normal((STEPS, 2)) + 5)
    exact = buffer.stats(exact=True)["state"]
    key = f"{sketches.PREFIX}0"
    buffer.stats()  # stores the blobs
    buffer.storage.write_blob(key, reencode(buffer.storage.read_blob(key), change))
    got = buffer.stats()["state"]
    assert got.count == exact.count
    np.testing.assert_allclose(got.mean.numpy(), exact.mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got.std.numpy(), exact.std.numpy(), rtol=1e-5)
    assert sketches.decode(buffer.storage.read_blob(key))["fields"]["state"]["count"] == STEPS, "stored again"


@pytest.mark.parametrize("weights", [["1", "2"], [[1, 1]], np.array([[0.5], [0.5]])], ids=["strings", "nested", "2-D"])
def test_mixture_weights_that_are_not_one_number_per_buffer_are_refused(tmp_path, weights):
    """Strings were parsed as numbers and nested weights flattened, as if one per buffer."""
    for name in ("a", "b"):
        buffer = ReplayBuffer(tmp_path / name, max_episodes=1, max_timesteps=2, fields={"x": "float"})
        buffer.store_episode(x=np.zeros(2))
    with pytest.raises(TypeError, match=r"weights must be a sequence of 2 numbers, got"):
        ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"], weights=weights)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({}, r"state must be a rate-limited loader's state_dict\(\) \(a dict with 'rate_limiter'\), got \{\}"),
        ({"rate_limiter": {}}, r"state\['rate_limiter'\] must be a dict with 'sampled' \(from state_dict\(\)\)"),
    ],
)
def test_a_rate_limited_loader_state_without_its_keys_is_named(tmp_path, state, message):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=4, fields={"x": "float"})
    buffer.store_episode(x=np.zeros(4))
    loader = buffer.dataloader(batch_size=2, timestep_level=True, samples_per_insert=1.0)
    before = loader.state_dict()["rate_limiter"]
    with pytest.raises(ValueError, match=message):  # was a bare KeyError
        loader.load_state_dict(state)
    assert loader.state_dict()["rate_limiter"] == before and before["sampled"] == 0, "nothing loaded"
