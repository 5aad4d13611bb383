"""Rate-limited loaders (``samples_per_insert``): samples handed out never outrun the committed
steps, with a writer in this process or in another one (spawn), on local disk and on S3 (moto)."""

from __future__ import annotations

import multiprocessing
import time
import uuid

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.sampling import RateLimitTimeout
from tests._data import fields
from tests._data import sampling_episode as episode

pytest_plugins = ["tests._servers"]  # fixture: s3_server

FIELDS = fields("state", "reward", "ident", "priority")
LENGTH = 5
KINDS = {
    "trajectory": {},
    "timestep": {"timestep_level": True, "shuffle": True},
    "n-step": {"n_steps": 2, "shuffle": True},
    "prioritized": {"timestep_level": True, "sampler": "prioritized", "num_batches": 3},
    "workers": {"timestep_level": True, "num_workers": 2, "multiprocessing_context": "fork"},
}


def store(buffer: ReplayBuffer, index: int) -> None:
    steps = episode(index, LENGTH)
    buffer.store_episode(
        state=steps["state"], reward=steps["reward"], ident=steps["ident"], priority=np.ones(LENGTH, np.float32)
    )


def drain(loader) -> int:
    """Samples the loader hands out, pass after pass, until it times out waiting for inserts."""
    with pytest.raises(RateLimitTimeout) as raised:
        for _ in range(100):
            for _ in loader:
                pass
    assert "samples_per_insert=2" in str(raised.value) and "sampled" in str(raised.value)
    return loader.limiter.sampled


@pytest.mark.parametrize("kind", KINDS)
def test_samples_follow_inserts(tmp_path, kind):
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=10, max_timesteps=LENGTH, fields=FIELDS)
    loader = buffer.dataloader(2, samples_per_insert=2, min_size=10, error_buffer=3, rate_timeout=0.05, **KINDS[kind])
    store(buffer, 0)
    assert drain(loader) == 0, "nothing before min_size steps are committed"
    store(buffer, 1)
    store(buffer, 2)
    # 15 steps: 2 * (15 - 10) + 3 = 13 samples allowed, handed out in batches of 2
    assert drain(loader) == 12
    store(buffer, 3)
    # 2 * (20 - 10) + 3 = 23, reached within one batch (where the passes' batches end)
    assert 21 < drain(loader) <= 23


def test_state_dict_keeps_the_count(tmp_path):
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=4, max_timesteps=LENGTH, fields=FIELDS)
    for index in range(2):
        store(buffer, index)
    options = dict(timestep_level=True, samples_per_insert=2, min_size=5, error_buffer=0, rate_timeout=0.05)
    loader = buffer.dataloader(2, **options)
    assert drain(loader) == 10
    resumed = buffer.dataloader(2, **options)
    resumed.load_state_dict(loader.state_dict())
    assert drain(resumed) == 10, "a resumed loader continues the count instead of sampling again"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"samples_per_insert": 0}, "samples_per_insert must be a number > 0"),
        ({"samples_per_insert": -1.0}, r"samples_per_insert must be a number > 0\.0, got -1\.0"),
        ({"samples_per_insert": float("nan")}, "samples_per_insert must be a number > 0"),
        ({"min_size": 10}, r"min_size=10: applies only to a rate-limited loader; pass samples_per_insert=R"),
        ({"error_buffer": 4, "rate_timeout": 5}, r"error_buffer=4, rate_timeout=5: apply only to a rate-limited"),
        # the defaults' own values, passed: refused as well (they were taken as omitted)
        ({"min_size": 1}, r"min_size=1: applies only to a rate-limited loader"),
        ({"rate_timeout": 60}, r"rate_timeout=60: applies only to a rate-limited loader"),
        ({"rate_timeout": None}, r"rate_timeout=None: applies only to a rate-limited loader"),
        ({"samples_per_insert": "2"}, "samples_per_insert must be a number"),
        ({"samples_per_insert": 1, "min_size": 0}, "min_size must be an int >= 1"),
        ({"samples_per_insert": 1, "min_size": 2.5}, "min_size must be an int"),
        ({"samples_per_insert": 1, "error_buffer": -1}, "error_buffer must be a number >= 0"),
        ({"samples_per_insert": 1, "rate_timeout": -1}, "rate_timeout must be a number >= 0"),
        ({"samples_per_insert": 1, "min_size": 2 * LENGTH + 1}, rf"min_size={2 * LENGTH + 1}: more steps than .* can"),
    ],
)
def test_bad_arguments(tmp_path, bad, message):
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=LENGTH, fields=FIELDS)
    store(buffer, 0)
    with pytest.raises(ValueError, match=message):
        buffer.dataloader(2, **bad)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"fields": ["nope"]}, "nope"),
        ({"n_steps": 2, "timestep_level": True}, "cannot specify both n_steps and timestep_level"),
        ({"sampler": "prioritized", "priority_field": "nope"}, "priority_field 'nope' is not a field"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_loader_arguments_are_checked_when_a_rate_limited_loader_is_made(tmp_path, bad, message):
    """They were checked only when the first pass began, after waiting for min_size steps
    (a learner would find its typo once the actors had filled the buffer)."""
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=4, max_timesteps=LENGTH, fields=FIELDS)
    store(buffer, 0)
    options = {"batch_size": 2, "timestep_level": True, **bad}
    with pytest.raises((ValueError, TypeError), match=message):
        buffer.dataloader(**options, samples_per_insert=1, min_size=3 * LENGTH)


@pytest.mark.parametrize("sampled", [-100, 2.5, "10"])
def test_a_bad_sample_count_in_a_state_is_refused(tmp_path, sampled):
    """A negative count would let the loader hand out that many samples beyond the ratio."""
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=LENGTH, fields=FIELDS)
    store(buffer, 0)
    loader = buffer.dataloader(2, timestep_level=True, samples_per_insert=1, rate_timeout=0.05)
    with pytest.raises(ValueError, match=r"state\['rate_limiter'\]\['sampled'\] must be an int >= 0"):
        loader.load_state_dict({"rate_limiter": {"sampled": sampled}})
    assert loader.state_dict()["rate_limiter"] == {"sampled": 0, "inserted": 0, "newest": [0]}


@pytest.mark.parametrize(
    "count",
    [{"inserted": -1, "newest": [0]}, {"inserted": 5}, {"inserted": 5, "newest": [0, 1]}, {"inserted": 5, "newest": 3}],
)
def test_a_bad_insert_count_in_a_state_is_refused(tmp_path, count):
    """An insert count, or the generation it covers, that would let the loader oversample."""
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=LENGTH, fields=FIELDS)
    store(buffer, 0)
    loader = buffer.dataloader(2, timestep_level=True, samples_per_insert=1, rate_timeout=0.05)
    with pytest.raises(ValueError, match=r"state\['rate_limiter'\]\['(inserted|newest)'\] must be"):
        loader.load_state_dict({"rate_limiter": {"sampled": 0, **count}})
    assert loader.state_dict()["rate_limiter"] == {"sampled": 0, "inserted": 0, "newest": [0]}


@pytest.mark.parametrize("concat", [False, True])
def test_a_resumed_count_keeps_the_inserts_a_circular_writer_overwrote(tmp_path, concat):
    """Before: a state held the samples alone, and a resumed loader counted as inserted only the
    steps the buffer holds now: after a circular writer's wrap (6 episodes of 5 steps through 2
    slots: 30 inserted, 10 held) it was 20 inserts short and waited for 4 more episodes."""
    from replaybuf.concat import ConcatReplayBuffer

    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=LENGTH, fields=FIELDS, circular=True)
    options = dict(timestep_level=True, samples_per_insert=2, min_size=5, error_buffer=0, rate_timeout=0.05)
    sampler = ConcatReplayBuffer([tmp_path / "buffer"]) if concat else buffer
    loader = sampler.dataloader(1, **options)
    sampled = 0
    for index in range(6):
        store(buffer, index)
        if concat:
            sampler.refresh()
        sampled = drain(loader)
    assert sampled == 50 and loader.state_dict()["rate_limiter"] == {"sampled": 50, "inserted": 30, "newest": [6]}
    resumed = sampler.dataloader(1, **options)
    resumed.load_state_dict(loader.state_dict())
    assert drain(resumed) == 50, "nothing new committed: the resumed loader may hand out nothing more"
    store(buffer, 6)
    if concat:
        sampler.refresh()
    assert drain(resumed) == 60, "one episode of 5 steps more: 2 * 5 samples more"


def test_min_size_beyond_what_a_circular_buffer_holds_is_accepted(tmp_path):
    """A circular buffer counts every commit, overwritten or not: min_size may exceed its
    capacity there (and only there: elsewhere the loader would wait forever)."""
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=LENGTH, fields=FIELDS, circular=True)
    loader = buffer.dataloader(2, timestep_level=True, samples_per_insert=1, min_size=3 * LENGTH, rate_timeout=0)
    for index in range(3):
        store(buffer, index)
        loader.limiter.update()  # as a waiting loader rereads the store between commits
    assert len(next(iter(loader))["state"]) == 2


def test_infinite_ratio_waits_for_min_size_only(tmp_path):
    """samples_per_insert=inf is Reverb's MinSize: nothing before min_size steps, then no limit
    (at exactly min_size steps inf * 0 made the bound nan and it blocked)."""
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=4, max_timesteps=LENGTH, fields=FIELDS)
    store(buffer, 0)
    options = dict(timestep_level=True, samples_per_insert=float("inf"), rate_timeout=0.05)
    with pytest.raises(RateLimitTimeout, match="for min_size=6 committed steps"):
        next(iter(buffer.dataloader(2, min_size=LENGTH + 1, **options)))
    loader = buffer.dataloader(2, min_size=LENGTH, **options)
    assert sum(len(batch["state"]) for _ in range(3) for batch in loader) == 3 * LENGTH


def slow_writer(location: str, storage_options: dict | None, episodes: int, pause: float) -> None:
    """Child-process body: commit ``episodes`` episodes into the buffer at ``location``, pausing."""
    buffer = ReplayBuffer(location, overwrite=False, storage_options=storage_options, **buffer_kwargs())
    for index in range(episodes):
        store(buffer, index)
        time.sleep(pause)
    buffer.close()


def buffer_kwargs() -> dict:
    return dict(max_episodes=12, max_timesteps=LENGTH, fields=FIELDS)


def committed_steps(reader: ReplayBuffer) -> int:
    return int(reader.refresh().episode_lens.sum())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_writer_in_another_process(where, tmp_path, request):
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        location, options = server.url(f"ratelimit-{uuid.uuid4().hex[:8]}"), server.storage_options
    else:
        location, options = str(tmp_path / "buffer"), None
    ReplayBuffer(location, storage_options=options, **buffer_kwargs()).close()
    episodes, rate, slack, batch = 12, 0.5, 2, 2
    # a local writer is forked (no second torch import); an S3 one is spawned: this process runs
    # the moto server's and the S3 clients' threads, which a forked child would inherit stopped
    context = multiprocessing.get_context("fork" if where == "local" else "spawn")
    writer = context.Process(target=slow_writer, args=(location, options, episodes, 0.05))
    writer.start()
    try:
        reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=options)
        observer = ReplayBuffer.from_folder(location, read_only=True, storage_options=options)
        deadline = time.monotonic() + 120
        while committed_steps(observer) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # a spawned writer imports torch before its first commit
        loader = reader.dataloader(
            batch,
            timestep_level=True,
            shuffle=True,
            samples_per_insert=rate,
            min_size=LENGTH,
            error_buffer=slack,
            rate_timeout=3,
        )
        observations = []
        with pytest.raises(RateLimitTimeout, match="samples_per_insert=0.5"):
            for _ in range(200):
                for _ in loader:
                    observations.append((loader.limiter.sampled, committed_steps(observer)))
        writer.join(timeout=60)
    finally:
        if writer.is_alive():
            writer.terminate()
    total = episodes * LENGTH
    assert committed_steps(observer) == total
    for sampled, inserted in observations:
        assert sampled <= rate * inserted + slack, observations
    # it sampled right up to the limit, 0.5 * (60 - 5) + 2 = 29.5, within one batch of 2 (a
    # pass's last batch may hold 1, depending on what was committed when the pass began)
    assert 27.5 < loader.limiter.sampled <= 29.5
    assert len({inserted for _, inserted in observations}) > 1, "sampling overlapped the writes"


SEEDED = {
    "timestep": {"timestep_level": True, "shuffle": True},
    "prioritized": {"timestep_level": True, "sampler": "prioritized", "num_batches": 4},
    "mixture": {"timestep_level": True, "num_batches": 4},
}


@pytest.mark.parametrize("kind", SEEDED)
def test_a_seeded_loader_draws_anew_each_pass_and_resumes_the_pass(tmp_path, kind):
    """Each pass builds its loader anew: seeded, every pass drew the very batches of the first."""
    from replaybuf import ConcatReplayBuffer

    members = []
    for member in range(2):
        buffer = ReplayBuffer(tmp_path / f"b{member}", max_episodes=4, max_timesteps=LENGTH, fields=FIELDS)
        for index in range(4):
            store(buffer, 4 * member + index)
        members.append(buffer)
    source = ConcatReplayBuffer([m.folder for m in members], weights=[1, 1]) if kind == "mixture" else members[0]
    options = dict(samples_per_insert=float("inf"), seed=3, rate_timeout=0.05, return_indices=True, **SEEDED[kind])

    def passes(loader, count):
        return [[batch["_indices"].tolist() for batch in loader] for _ in range(count)]

    first, second = passes(source.dataloader(4, **options), 2)
    assert first != second, "the second pass drew the first pass's batches"
    again = source.dataloader(4, **options)
    assert passes(again, 2) == [first, second], "a seed gives the same passes"
    resumed = source.dataloader(4, **options)
    resumed.load_state_dict(again.state_dict())
    assert passes(resumed, 1)[0] not in (first, second), "a resumed loader starts at the third pass"


@pytest.mark.parametrize("kind", ["timestep", "mixture"])
def test_a_batch_that_timed_out_is_handed_out_next_not_skipped_nor_its_pass_restarted(tmp_path, kind):
    """A batch is read before the limiter may hand it out. When it timed out, state_dict() counted
    it as received (a resumed run skipped it), and iterating again restarted the pass: a seeded
    loop that retried after the timeout trained on the pass's first batches again."""
    from replaybuf import ConcatReplayBuffer

    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=8, max_timesteps=LENGTH, fields=FIELDS)
    for index in range(4):
        store(buffer, index)
    source = ConcatReplayBuffer([buffer], weights=[1]) if kind == "mixture" else buffer
    options = dict(timestep_level=True, seed=3, min_size=1, error_buffer=0, rate_timeout=0.05, return_indices=True)
    options.update(num_batches=10) if kind == "mixture" else options.update(shuffle=True)

    def indices(batches) -> list:
        return [batch["_indices"].tolist() for batch in batches]

    unlimited = source.dataloader(2, samples_per_insert=float("inf"), **options)
    whole_pass = indices(unlimited)  # 20 steps, 10 batches of 2
    received = []
    limited = source.dataloader(2, samples_per_insert=0.5, **options)  # 0.5 * (20 - 1): 4 batches
    with pytest.raises(RateLimitTimeout):
        for batch in limited:
            received.append(batch["_indices"].tolist())
    assert received == whole_pass[:4]
    after_four = source.dataloader(2, samples_per_insert=float("inf"), **options)
    for _ in zip(range(4), after_four):
        pass
    assert limited.state_dict()["loader"] == after_four.state_dict()["loader"], "the fifth batch was not received"
    store(buffer, 4)  # 5 steps more: 0.5 * (25 - 1) = 12 samples, two batches more
    if kind == "mixture":
        source.refresh()
    with pytest.raises(RateLimitTimeout):
        for batch in limited:
            received.append(batch["_indices"].tolist())
    assert received == whole_pass[:6], "the pass goes on with the batch that timed out"


@pytest.mark.parametrize("kind", SEEDED)
def test_a_loop_that_breaks_out_of_a_pass_goes_on_as_with_a_plain_loader(tmp_path, kind):
    """A plain mixture or prioritized loader draws its next pass at each iteration; the
    rate-limited one counted a pass only once it ended, so a loop that breaks after a few
    batches drew the same first batches of the same pass at every iteration."""
    from replaybuf import ConcatReplayBuffer

    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=8, max_timesteps=LENGTH, fields=FIELDS)
    for index in range(8):
        store(buffer, index)
    source = ConcatReplayBuffer([buffer], weights=[1]) if kind == "mixture" else buffer
    options = dict(seed=3, return_indices=True, **SEEDED[kind])

    def first_batches(loader) -> list:
        firsts = []
        for _ in range(3):
            for batch in loader:
                firsts.append(batch["_indices"].tolist())
                break
        return firsts

    plain = first_batches(source.dataloader(4, **options))
    limited = source.dataloader(4, samples_per_insert=float("inf"), rate_timeout=0.05, **options)
    assert first_batches(limited) == plain
    assert limited.state_dict()["passes"] == (0 if kind == "timestep" else 3)
