"""Weighted mixtures (``ConcatReplayBuffer([...], weights=[...])``): each sample's source follows
the weights (chi-square over many batches), reproducibly from the seed, resumably, with one
``filter_meta`` per source, and bad weights are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from replaybuf import ReplayBuffer
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.sampling import ReplayDatasetTimeWindow, SnapshotOverwrittenError

FIELDS = {"obs": ("float", (2,)), "source": "int", "priority": "float"}
META = {"task": "int"}
# (episodes, length) per source: very different sizes, so that weights != size shares
SOURCES = [(2, 4), (6, 6), (1, 3)]
WEIGHTS = [0.5, 0.2, 0.3]
KINDS = {
    "trajectory": {},
    "timestep": {"timestep_level": True},
    "n-step": {"n_steps": 2, "current_fields": ("obs",), "sequence_fields": ("source",)},
}


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    buffers = []
    for k, (episodes, length) in enumerate(SOURCES):
        buffer = ReplayBuffer(
            root / f"s{k}", max_episodes=episodes, max_timesteps=length, fields=FIELDS, meta_fields=META
        )
        for e in range(episodes):
            buffer.store_episode(
                obs=np.full((length, 2), e, np.float32),
                source=np.full(length, k, np.int32),
                priority=np.ones(length, np.float32),
                task=e % 2,
            )
        buffers.append(buffer)
    return buffers


def sources_of(batch) -> np.ndarray:
    column = batch["source"] if "source" in batch else batch["seq_source"]
    return column.reshape(len(column), -1)[:, 0].numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_sources_follow_weights(members, kind):
    mixture = ConcatReplayBuffer(members, weights=[5, 2, 3])  # normalized: WEIGHTS
    loader = mixture.dataloader(32, num_batches=60, seed=7, **KINDS[kind])
    drawn = np.concatenate([sources_of(batch) for batch in loader])
    counts = np.bincount(drawn, minlength=3)
    assert counts.sum() == 60 * 32
    assert chisquare(counts, np.array(WEIGHTS) * counts.sum()).pvalue > 1e-3, counts
    # drawing by size (what an unweighted loader does) would be told apart: the sizes differ
    sizes = np.bincount(sources_of(next(iter(ConcatReplayBuffer(members).dataloader(10_000, **KINDS[kind])))))
    assert chisquare(counts, sizes / sizes.sum() * counts.sum()).pvalue < 1e-3


def test_zero_weight_source_never_drawn(members):
    loader = ConcatReplayBuffer(members, weights=[0, 1, 1]).dataloader(16, timestep_level=True, num_batches=20)
    assert 0 not in np.concatenate([sources_of(b) for b in loader])


def test_weights_near_the_float_maximum_are_proportions_like_any_other(members):
    """Three weights of 1e308 sum to inf: they were accepted, then every batch failed in numpy
    ('probabilities do not sum to 1')."""
    huge = as_lists(ConcatReplayBuffer(members, weights=[1e308] * 3).dataloader(8, timestep_level=True, seed=1))
    assert huge == as_lists(ConcatReplayBuffer(members, weights=[1, 1, 1]).dataloader(8, timestep_level=True, seed=1))


@pytest.mark.parametrize("seed", [-1, 1.5, "7", True])
def test_a_bad_seed_is_refused_by_name(members, seed):
    """seed=1.5 was truncated to 1, seed=-1 failed at the first batch in numpy."""
    with pytest.raises(ValueError, match=rf"seed must be an int >= 0, got {seed!r}"):
        ConcatReplayBuffer(members, weights=WEIGHTS).dataloader(8, timestep_level=True, seed=seed)


def test_num_batches_takes_a_numpy_int_and_refuses_others_by_name(members):
    """np.int64(3) (a count computed with numpy) was refused as "not an int >= 1, got 3"; the
    prioritized sampler takes it."""
    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    assert len(mixture.dataloader(8, timestep_level=True, num_batches=np.int64(3), seed=0)) == 3
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"num_batches must be an int >= 1, got {bad!r}"):
            mixture.dataloader(8, timestep_level=True, num_batches=bad, seed=0)


@pytest.mark.parametrize("concat", [False, True])
def test_num_batches_beside_a_loader_that_takes_none_is_refused_by_name(members, concat):
    """Only weighted mixtures and the prioritized sampler draw a number of batches; elsewhere it
    reached torch as "DataLoader.__init__() got an unexpected keyword argument 'num_batches'"."""
    buffer = ConcatReplayBuffer(members) if concat else members[0]
    with pytest.raises(
        ValueError, match=r"num_batches=3 applies only to sampler='prioritized' or a ConcatReplayBuffer"
    ):
        buffer.dataloader(8, timestep_level=True, num_batches=3)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"seed": 5, "pass": 0, "batch": -1}, r"batch must be an int >= 0, got -1"),
        ({"seed": 5, "pass": 1.5, "batch": 0}, r"pass must be an int >= 0, got 1.5"),
        ({"seed": "x", "pass": 0, "batch": 0}, r"seed must be an int >= 0, got 'x'"),
        ({"seed": 5}, r"mixture loader state is missing keys \['batch', 'pass'\]"),
    ],
)
def test_a_bad_state_is_refused_and_the_loader_keeps_its_own(members, state, message):
    loader = ConcatReplayBuffer(members, weights=WEIGHTS).dataloader(8, timestep_level=True, num_batches=3, seed=5)
    before = loader.state_dict()
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


def test_a_state_that_is_no_dict_is_refused_by_name(members):
    loader = ConcatReplayBuffer(members, weights=WEIGHTS).dataloader(8, timestep_level=True, num_batches=3, seed=5)
    with pytest.raises(TypeError, match=r"state must be a mixture loader's state_dict\(\) \(a dict\), got None"):
        loader.load_state_dict(None)  # was: 'NoneType' object is not iterable


def as_lists(loader) -> list:
    return [(b["source"].tolist(), b["obs"].tolist()) for b in loader]


def test_reproducible_from_the_seed(members):
    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    first = as_lists(mixture.dataloader(8, timestep_level=True, num_batches=10, seed=3))
    assert first == as_lists(mixture.dataloader(8, timestep_level=True, num_batches=10, seed=3))
    workers = mixture.dataloader(8, timestep_level=True, num_batches=10, seed=3, num_workers=2)
    assert first == as_lists(workers), "DataLoader workers draw the same batches"
    assert first != as_lists(mixture.dataloader(8, timestep_level=True, num_batches=10, seed=4))
    torch.manual_seed(11)
    unseeded = as_lists(mixture.dataloader(8, timestep_level=True, num_batches=10))
    torch.manual_seed(11)
    assert unseeded == as_lists(mixture.dataloader(8, timestep_level=True, num_batches=10))


def test_resume_from_state_dict(members):
    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    loader = mixture.dataloader(8, timestep_level=True, num_batches=6, seed=5)
    full = as_lists(loader)
    second_pass = as_lists(loader)
    assert full != second_pass, "each pass draws new batches"
    partial = mixture.dataloader(8, timestep_level=True, num_batches=6, seed=5)
    for count, _ in enumerate(partial, start=1):
        if count == 4:
            break
    state = partial.state_dict()
    resumed = mixture.dataloader(8, timestep_level=True, num_batches=6)
    resumed.load_state_dict(state)
    assert as_lists(resumed) == full[4:]
    assert as_lists(resumed) == second_pass


def test_time_windows_of_a_seeded_mixture_repeat_and_resume(tmp_path):
    """The same seed gives the same batches, windows included (their starts came from torch's
    generator: another window in every loader, and in a resumed one)."""
    for k in range(2):
        member = ReplayBuffer(tmp_path / f"m{k}", max_episodes=3, max_timesteps=12, fields={"ident": "int"})
        for e in range(3):
            member.store_episode(ident=np.arange(12) + 100 * e + 1000 * k)
        member.close()
    mixture = ConcatReplayBuffer([tmp_path / "m0", tmp_path / "m1"], weights=[1, 1])

    def loader():
        return mixture.dataloader(4, dataset=ReplayDatasetTimeWindow(mixture, 4), num_batches=3, seed=2)

    def windows(loader):
        return [batch["ident"][:, 0].tolist() for batch in loader]

    full = windows(loader())
    assert windows(loader()) == full
    interrupted, resumed = loader(), loader()
    next(iter(interrupted))
    resumed.load_state_dict(interrupted.state_dict())
    assert windows(resumed) == full[1:]


def test_filter_meta_per_source(members):
    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    loader = mixture.dataloader(16, num_batches=20, filter_meta=[{"task": 1}, None, {"task": 0}], seed=1)
    batches = list(loader)
    source, obs = np.concatenate([sources_of(b) for b in batches]), np.concatenate([b["obs"][:, 0, 0] for b in batches])
    assert (obs[source == 0] == 1).all() and (obs[source == 2] == 0).all()
    assert set(obs[source == 1].tolist()) > {1.0, 2.0}, "no filter on source 1"
    together = list(mixture.dataloader(16, num_batches=5, filter_meta={"task": 0}, seed=1))
    assert all((b["obs"][:, 0, 0] % 2 == 0).all() for b in together), "one dict filters every source"
    with pytest.raises(ValueError, match="filter_meta has 2 entries for 3 buffers"):
        mixture.dataloader(16, filter_meta=[{"task": 1}, None])
    with pytest.raises(ValueError, match=r"filter_meta\[2\] on .*matches no episode"):
        mixture.dataloader(16, filter_meta=[None, None, {"task": 1}])
    with pytest.raises(TypeError, match="needs a ConcatReplayBuffer"):
        members[0].dataloader(4, filter_meta=[{"task": 1}])


@pytest.mark.parametrize(
    "weights, error, message",
    [
        ([1, -1, 1], ValueError, r"weights must be finite numbers >= 0, got \[1, -1, 1\]"),
        ([1, 1], ValueError, "weights has 2 entries for 3 buffers"),
        ([0, 0, 0], ValueError, "weights are all 0"),
        ([1, float("nan"), 1], ValueError, "finite"),
        ("abc", TypeError, "weights must be a sequence of 3 numbers"),
        ([1, "x", 2], TypeError, "weights must be a sequence of 3 numbers"),
    ],
)
def test_bad_weights(members, weights, error, message):
    with pytest.raises(error, match=message):
        ConcatReplayBuffer(members, weights=weights)


def test_weights_refuse_other_samplers(members):
    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    with pytest.raises(ValueError, match="sampler='prioritized' cannot be combined"):
        mixture.dataloader(4, timestep_level=True, sampler="prioritized")
    with pytest.raises(ValueError, match="drop_last cannot be combined"):
        mixture.dataloader(4, drop_last=True)
    with pytest.raises(ValueError, match=r"buffers \[2\] have a weight > 0 but no sample"):
        mixture.dataloader(4, filter_meta={"task": 1})  # source 2 holds only task 0


def test_weights_with_rate_limit(members):
    from replaybuf.sampling import RateLimitTimeout

    mixture = ConcatReplayBuffer(members, weights=WEIGHTS)
    committed = sum(episodes * length for episodes, length in SOURCES)  # 47 steps
    loader = mixture.dataloader(
        4,
        timestep_level=True,
        seed=2,
        num_batches=50,
        samples_per_insert=1,
        min_size=7,
        error_buffer=0,
        rate_timeout=0.05,
    )
    with pytest.raises(RateLimitTimeout):
        for _ in loader:
            pass
    assert loader.limiter.sampled == 40 == (committed - 7) // 4 * 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_whose_slot_is_reused_is_redrawn_from_its_own_source(tmp_path, kind):
    """Samples of source 0 whose slot a writer reused since the loader was made are drawn again
    from source 0's other episode, never from source 1 (weight 0: it was drawn from when any
    live sample was); once source 0 has none left, the loader says so rather than return
    batches of no samples. memmap: zarr's in-RAM copies would serve the snapshot's episode."""
    writers = []
    for k, episodes in enumerate((2, 6)):
        writer = ReplayBuffer(
            tmp_path / f"s{k}",
            max_episodes=episodes,
            max_timesteps=4,
            fields=FIELDS,
            meta_fields=META,
            circular=True,
            backend="memmap",
        )
        for e in range(episodes):
            writer.store_episode(obs=np.full((4, 2), e, np.float32), source=np.full(4, k, np.int32), task=e)
        writers.append(writer)
    readers = [ReplayBuffer.from_folder(tmp_path / f"s{k}", read_only=True) for k in range(2)]
    loader = ConcatReplayBuffer(readers, weights=[1, 0]).dataloader(16, num_batches=2, seed=3, **KINDS[kind])
    writers[0].store_episode(obs=np.full((4, 2), 9, np.float32), source=np.full(4, 9, np.int32), task=9)  # slot 0
    batches = list(loader)
    assert [len(sources_of(b)) for b in batches] == [16, 16]
    for batch in batches:
        assert (sources_of(batch) == 0).all()
        assert (batch["task"] == 1).all(), "episode 0 of source 0 was reused: only its episode 1 is left"
    writers[0].store_episode(obs=np.full((4, 2), 9, np.float32), source=np.full(4, 9, np.int32), task=9)  # slot 1
    with pytest.raises(SnapshotOverwrittenError, match="make a new loader"):  # not batches of no samples
        next(iter(loader))


def test_a_member_whose_every_episode_is_overwritten_is_named_not_left_out_of_the_shares(tmp_path):
    """Before: its samples were dropped from every batch, which shrank and held the other
    member's alone (the 50/50 mixture asked for became 0/100) without a word."""
    writers = []
    for k in range(2):
        writer = ReplayBuffer(
            tmp_path / f"s{k}", 2, 4, fields=FIELDS, meta_fields=META, circular=True, backend="memmap"
        )
        for e in range(2):
            writer.store_episode(obs=np.full((4, 2), e, np.float32), source=np.full(4, k, np.int32), task=e)
        writers.append(writer)
    readers = [ReplayBuffer.from_folder(tmp_path / f"s{k}", read_only=True) for k in range(2)]
    loader = ConcatReplayBuffer(readers, weights=[1, 1]).dataloader(16, num_batches=3, seed=3, timestep_level=True)
    first = next(iter(loader))
    assert set(sources_of(first)) == {0, 1}
    for _ in range(2):  # every episode of member 0
        writers[0].store_episode(obs=np.full((4, 2), 9, np.float32), source=np.full(4, 9, np.int32), task=9)
    with pytest.raises(SnapshotOverwrittenError, match=r"members \[0\] of this loader's weighted mixture"):
        next(iter(loader))
