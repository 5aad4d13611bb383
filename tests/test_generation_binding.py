"""Zarr format 7: each image shard is bound to the generation its episode publishes. A hypothesis
state machine drives a small circular buffer through the public API (episodes stored whole, step
by step and in batches, left in progress across edits, drops, clears, rewinds, length-0 episodes,
slot jumps, compaction and reopens) and checks after each step that every committed episode reads
back as stored (get_all_data and a timestep loader, writer and reader), that each
shard's binding names its slot's published generation, and that ``verify`` finds nothing."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from replaybuf import ReplayBuffer, staging, verify

pytest_plugins = ["tests._servers"]  # fixtures: s3_server

MAX_EPISODES = 3
MAX_TIMESTEPS = 4
FRAME = (32, 32, 4)  # image-sized: one shard per episode


def frames(seed: int, lead: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 255, (*lead, *FRAME), dtype=np.uint8)


class GenerationMachine(RuleBasedStateMachine):
    """A circular format-7 buffer and a model of its committed episodes and the group in progress."""

    location = ""
    storage_options: dict | None = None  # an object store's

    @initialize(flush=st.sampled_from([0, 1]), hot=st.booleans())
    def create(self, flush, hot):
        self.config = dict(
            max_episodes=MAX_EPISODES,
            max_timesteps=MAX_TIMESTEPS,
            fields={"frame": {"dtype": "uint8", "shape": list(FRAME)}, "reward": "float"},
            circular=True,
            flush_every_store_step=flush,
            hot_bytes=(1 << 20) if hot else 0,
            storage_options=self.storage_options,
        )
        self.buffer = ReplayBuffer(self.location, **self.config)
        self.slots: dict[int, dict[str, np.ndarray]] = {}  # committed: slot -> frame, reward (length rows)
        self.progress: list[dict[str, np.ndarray]] | None = None  # the group in progress: per episode
        self.episode_index = 0
        self.seed = 0

    def teardown(self):
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.close()
            ReplayBuffer(self.location, **self.config, overwrite=False).close()  # commits a step log left
            problems = verify(self.location, storage_options=self.storage_options)
            assert problems == [], problems

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def commit(self, episodes: list[dict[str, np.ndarray]]) -> None:
        for i, episode in enumerate(episodes):
            self.slots[(self.episode_index + i) % MAX_EPISODES] = {n: v.copy() for n, v in episode.items()}
        self.episode_index = (self.episode_index + len(episodes)) % MAX_EPISODES

    def group_slots(self) -> list[int]:
        if not self.progress:
            return []
        return [(self.episode_index + i) % MAX_EPISODES for i in range(len(self.progress))]

    @property
    def progress_length(self) -> int:
        return len(self.progress[0]["reward"]) if self.progress else 0

    # ---- rules ----------------------------------------------------------------------------

    @rule(length=st.integers(1, MAX_TIMESTEPS))
    def store_episode(self, length):
        episode = {"frame": frames(self.next_seed(), (length,)), "reward": np.arange(length, dtype=np.float32) + 0.5}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.buffer.store_episode(**episode)
        self.progress = None
        self.commit([episode])

    @precondition(lambda self: not self.progress or len(self.progress) == 1)
    @rule(steps=st.integers(1, 2))
    def store_steps(self, steps):
        steps = min(steps, MAX_TIMESTEPS - self.progress_length)
        if self.progress is None:
            self.progress = [{"frame": np.zeros((0, *FRAME), np.uint8), "reward": np.zeros(0, np.float32)}]
        episode = self.progress[0]
        for _ in range(steps):
            frame, reward = frames(self.next_seed(), ()), float(self.seed)
            self.buffer.store(frame=frame, reward=reward)
            episode["frame"] = np.concatenate([episode["frame"], frame[None]])
            episode["reward"] = np.append(episode["reward"], np.float32(reward))

    @precondition(lambda self: not self.progress or len(self.progress) > 1)
    @rule(batch=st.integers(2, MAX_EPISODES), steps=st.integers(1, 2))
    def store_batch(self, batch, steps):
        if self.progress is not None:
            batch = len(self.progress)
        steps = min(steps, MAX_TIMESTEPS - self.progress_length)
        if self.progress is None:
            self.progress = [
                {"frame": np.zeros((0, *FRAME), np.uint8), "reward": np.zeros(0, np.float32)} for _ in range(batch)
            ]
        for _ in range(steps):
            frame, reward = frames(self.next_seed(), (batch,)), np.arange(batch, dtype=np.float32) + self.seed
            self.buffer.store_batch(frame=frame, reward=reward)
            for i, episode in enumerate(self.progress):
                episode["frame"] = np.concatenate([episode["frame"], frame[i][None]])
                episode["reward"] = np.append(episode["reward"], reward[i])

    @precondition(lambda self: self.progress_length > 0)
    @rule(data=st.data())
    def advance(self, data):
        count = data.draw(st.integers(1, len(self.progress)))
        if data.draw(st.booleans()) or count == len(self.progress):
            self.buffer.advance_episode()
            self.commit(self.progress)
        else:
            self.buffer.advance_episode(batch_size=count)
            self.commit(self.progress[:count])
        self.progress = None

    @precondition(lambda self: not self.progress)
    @rule(count=st.integers(2, MAX_EPISODES))
    def empty_episodes(self, count):
        self.buffer.advance_episode(batch_size=count)  # length 0: their slots hold no episode
        for i in range(count):
            self.slots.pop((self.episode_index + i) % MAX_EPISODES, None)
        self.episode_index = (self.episode_index + count) % MAX_EPISODES

    @precondition(lambda self: not self.progress)
    @rule(data=st.data())
    def choose_slot(self, data):
        # a listed slot: the writer lists num_episodes slots, counting commits as the seed does
        # (a jump past them hides the episode stored there from get_all_data, as in the seed)
        slot = data.draw(st.integers(0, min(self.buffer.num_episodes, MAX_EPISODES - 1)))
        self.buffer.episode_index = slot
        self.episode_index = slot

    @precondition(lambda self: self.progress_length > 1)
    @rule(data=st.data())
    def rewind(self, data):
        t = data.draw(st.integers(1, self.progress_length - 1))
        self.buffer.timestep_index = t
        for episode in self.progress:
            for name in episode:
                episode[name] = episode[name][:t]

    @precondition(lambda self: self.progress_length > 0)
    @rule(data=st.data())
    def edit_in_progress(self, data):
        row = data.draw(st.integers(0, len(self.progress) - 1))
        t = data.draw(st.integers(0, self.progress_length - 1))
        frame = frames(self.next_seed(), ())
        self.buffer.store_datapoint(self.group_slots()[row], t, "frame", frame)
        self.progress[row]["frame"][t] = frame

    @precondition(lambda self: set(self.slots) - set(self.group_slots()))
    @rule(data=st.data())
    def edit_committed(self, data):
        slot = data.draw(st.sampled_from(sorted(set(self.slots) - set(self.group_slots()))))
        length = len(self.slots[slot]["reward"])
        if data.draw(st.booleans()):
            t = data.draw(st.integers(0, length - 1))
            frame = frames(self.next_seed(), ())
            self.buffer.store_datapoint(slot, t, "frame", frame)
            self.slots[slot]["frame"][t] = frame
        else:
            value = frames(self.next_seed(), (1, length))
            self.buffer.update([slot], frame=value)
            self.slots[slot]["frame"][:] = value[0]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def drop(self, data):
        slot = data.draw(st.sampled_from(sorted(self.slots)))
        assert self.buffer.drop_episodes([slot]) == [slot]
        del self.slots[slot]

    @rule()
    def clear(self):
        self.buffer.clear()
        self.slots, self.progress, self.episode_index = {}, None, 0

    @rule()
    def flush(self):
        self.buffer.flush()

    @rule()
    def compact(self):
        self.buffer.compact()

    @rule()
    def reopen(self):
        self.buffer.close()
        self.buffer = ReplayBuffer(self.location, **self.config, overwrite=False)
        if self.progress_length and self.config["flush_every_store_step"]:
            self.commit(self.progress)  # the step log's episodes, committed by the open
        self.progress = None

    # ---- what a reader sees -------------------------------------------------------------------

    @invariant()
    def committed_episodes_read_back(self):
        buffer = getattr(self, "buffer", None)
        if buffer is None:
            return
        valid = buffer.valid_episodes().tolist()
        for slot in set(self.group_slots()) - set(valid):  # invalidated as the group's rows left RAM
            self.slots.pop(slot, None)
        assert sorted(valid) == sorted(self.slots)
        self.check_reads(buffer)
        reader = ReplayBuffer.from_folder(self.location, read_only=True, storage_options=self.storage_options)
        self.check_reads(reader)
        array = reader.storage.array("frame")
        for slot in reader.valid_episodes().tolist():
            shard = array.kv.get(array.shard_key(slot))
            bound = array.binding.held_generation(shard[-array.index_nbytes :])
            published = int(reader.storage.read_meta_rows("_generation", np.array([slot]))[0])
            assert bound == published, f"slot {slot}: shard bound to {bound}, published {published}"
        reader.close()

    def check_reads(self, buffer):
        got = buffer.get_all_data()
        order = sorted(self.slots)
        if not order:
            return
        listed = buffer.listed_slots().tolist()
        for slot in order:
            row = listed.index(slot)
            length = len(self.slots[slot]["reward"])
            assert int(got["episode_lens"][row]) == length
            np.testing.assert_array_equal(got["frame"][row, :length].numpy(), self.slots[slot]["frame"])
            np.testing.assert_array_equal(got["reward"][row, :length].numpy(), self.slots[slot]["reward"])
        loader = buffer.dataloader(batch_size=4, timestep_level=True, return_indices=True, seed=0)
        for batch in loader:
            for (slot, t), frame in zip(batch["_indices"].tolist(), batch["frame"].numpy()):
                np.testing.assert_array_equal(frame, self.slots[slot]["frame"][t], err_msg=f"slot {slot} step {t}")


def run_machine(monkeypatch, locations, storage_options: dict | None, examples: int, steps: int) -> None:
    """Run ``GenerationMachine`` on the buffers ``locations`` yields, one frame a write span:
    every step of an episode in progress leaves RAM at once (its shard written, bound to the
    generation planned for it, then rewritten by each later step)."""
    monkeypatch.setattr(staging, "WRITE_SPAN_BYTES", 4096)

    class Machine(GenerationMachine):
        def __init__(self):
            super().__init__()
            self.location = next(locations)
            self.storage_options = storage_options

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )


def test_every_committed_episode_reads_back_bound_to_its_generation(tmp_path, monkeypatch):
    locations = (str(tmp_path / f"b{n}") for n in itertools.count())
    run_machine(monkeypatch, locations, None, examples=30, steps=25)


def test_every_committed_episode_reads_back_bound_to_its_generation_on_s3(s3_server, monkeypatch):
    locations = (s3_server.url(f"generation-binding/b{n}") for n in itertools.count())
    run_machine(monkeypatch, locations, s3_server.storage_options, examples=4, steps=12)
