"""Differential tests: memmap-replay-buffer 0.2.3 and replaybuf driven by the same calls.

A hypothesis state machine creates the seed's buffer and replaybuf's with the same arguments in
two folders, applies every call of the public write API to both, and compares what a user
sees: which calls raise (an AssertionError of the seed may be a ValueError here), the counters,
lengths, ``get_all_data`` with field selections, and deterministic (``shuffle=False``) batches of
the trajectory, timestep and n-step loaders with their options. It runs for ``ReplayBuffer``
(replaybuf on zarr and memmap) and ``ReplayBufferH5PY``.

The deliberate differences listed in README.md ("Differences from memmap-replay-buffer") are
accounted for here, each where it applies, marked ``# difference:``. The main one: the seed
publishes the lengths of episodes still being written (``store_batch`` writes
``episode_lens`` at once), replaybuf only on commit; so lengths and reads are compared between
episodes, and slots the seed published that replaybuf never committed (a group cut short or
rolled back) are "tainted" until both commit an episode there again.

CI runs a bounded number of examples; ``--hypothesis-profile=long`` (registered in conftest.py)
or ``REPLAYBUF_DIFF_EXAMPLES=N`` run more.
"""

from __future__ import annotations

import os
import warnings

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch
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

import replaybuf

from ._backends import require

FIELDS = {"obs": ("float", 2), "act": "int", "done": "bool", "rew": ("float", (), -1.0)}
META = {"label": "int", "score": ("float", 2)}
SPECS = {"obs": ((2,), np.float32), "act": ((), np.int32), "done": ((), np.bool_), "rew": ((), np.float32)}
META_SPECS = {"label": ((), np.int32), "score": ((2,), np.float32)}


def diff_settings() -> settings:
    """Bounded in CI; the ``long`` profile or REPLAYBUF_DIFF_EXAMPLES for long runs."""
    examples = os.environ.get("REPLAYBUF_DIFF_EXAMPLES")
    if examples or settings.get_current_profile_name() == "long":
        base = settings.get_profile("long")
        return settings(base, max_examples=int(examples) if examples else base.max_examples)
    return settings(
        max_examples=30,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def values(data, name: str, lead: tuple[int, ...], meta: bool = False) -> np.ndarray:
    """Small exact values (integers, so float32 round-trips) of a field, shaped lead + shape."""
    shape, dtype = (META_SPECS if meta else SPECS)[name]
    n = int(np.prod(lead + shape))
    ints = data.draw(
        st.lists(st.integers(0 if dtype == np.bool_ else -4, 1 if dtype == np.bool_ else 4), min_size=n, max_size=n)
    )
    return np.asarray(ints).astype(dtype).reshape(lead + shape)


class RolledBack(Exception):
    """Raised inside a ``with`` block to roll its episode back."""


def outcome(fn, buffer):
    """(result, None) or (None, exception) of ``fn(buffer)``, warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(buffer), None
        except Exception as e:  # noqa: BLE001 - which calls raise is what is compared
            return None, e


def to_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return np.asarray(value)


def assert_batches_equal(ours, theirs, where: str) -> None:
    if isinstance(theirs, tuple):  # named tuples
        assert type(ours).__name__ == type(theirs).__name__ and ours._fields == theirs._fields, where
        ours, theirs = ours._asdict(), theirs._asdict()
    assert set(ours) == set(theirs), f"{where}: keys {sorted(ours)} vs seed {sorted(theirs)}"
    for key in theirs:
        a, b = to_numpy(ours[key]), to_numpy(theirs[key])
        assert a.shape == b.shape, f"{where}[{key}]: shape {a.shape} vs seed {b.shape}"
        assert a.dtype == b.dtype or (a.dtype.kind == b.dtype.kind == "i"), f"{where}[{key}]: {a.dtype} vs {b.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=f"{where}[{key}]")


class DifferentialMachine(RuleBasedStateMachine):
    """The seed's buffer and replaybuf's side by side; subclasses choose the classes."""

    seed_cls = seed.ReplayBuffer
    ours_cls = replaybuf.ReplayBuffer
    ours_kwargs: tuple[dict, ...] = ({}, {"backend": "memmap"})
    seed_n_steps = True  # difference: the seed's ReplayBufferH5PY refuses n-step datasets
    tmp_root = ""  # set per test

    @initialize(
        circular=st.booleans(),
        max_episodes=st.integers(3, 4),
        max_timesteps=st.integers(4, 6),
        variant=st.integers(0, 1),
    )
    def create(self, circular, max_episodes, max_timesteps, variant):
        self.case = len(os.listdir(self.tmp_root))
        args = dict(
            max_episodes=max_episodes, max_timesteps=max_timesteps, fields=FIELDS, meta_fields=META, circular=circular
        )
        root = os.path.join(self.tmp_root, f"case-{self.case}")
        self.seed = self.seed_cls(os.path.join(root, "seed"), **args)
        extra = self.ours_kwargs[variant % len(self.ours_kwargs)]
        self.ours = self.ours_cls(os.path.join(root, "ours"), **args, **extra)
        self.max_episodes, self.max_timesteps, self.circular = max_episodes, max_timesteps, circular
        self.group = 0  # episodes in the group in progress (0: none)
        self.meta_batch = 0  # episodes meta was set for before any step (0: none)
        self.tainted: set[int] = set()  # lengths may differ (see the module docstring)
        self.stale: set[int] = set()  # rows and meta may differ (see ``starting``)
        self.fresh: set[int] = set()  # slots the seed reset for the episodes in progress
        self.jumped = False  # episode_index was set since the last clear (see ``reopen``)

    def teardown(self):
        for buffer in (getattr(self, "seed", None), getattr(self, "ours", None)):
            if buffer is not None and hasattr(buffer, "close"):
                buffer.close()
            elif buffer is not None:
                buffer._close_storage()

    # ---- helpers ----------------------------------------------------------------------------

    def both(self, fn, what: str, empty_ok: bool = False):
        """Apply ``fn`` to both; both must succeed or both raise. Returns (seed, ours) results.
        ``empty_ok``: a ValueError here may stand for an empty result of the seed."""
        theirs, seed_error = outcome(fn, self.seed)
        ours, our_error = outcome(fn, self.ours)
        if empty_ok and seed_error is None and isinstance(our_error, ValueError) and len(theirs) == 0:
            return (theirs, ours), True  # difference: a dataset or loader that would be empty raises here
        assert (seed_error is None) == (our_error is None), (
            f"{what}: seed {'raised ' + repr(seed_error) if seed_error else 'succeeded'}, "
            f"replaybuf {'raised ' + repr(our_error) if our_error else 'succeeded'}"
        )
        if our_error is not None:
            # an AssertionError of the seed (bad input) is a ValueError / TypeError here
            assert isinstance(our_error, (ValueError, TypeError, RuntimeError, RolledBack)), f"{what}: {our_error!r}"
        return (theirs, ours), our_error is not None

    @property
    def room(self) -> int:
        return self.max_episodes if self.circular else self.max_episodes - int(self.seed.num_episodes)

    def slots(self, count: int) -> set[int]:
        start = int(self.seed.episode_index)
        return {(start + i) % self.max_episodes for i in range(count)}

    @property
    def full(self) -> bool:
        return not self.circular and self.room <= 0

    def refused_when_full(self, fn, what: str) -> None:
        """difference: on a full non-circular buffer the seed's ``store`` and ``store_episode``
        write into the first slot (then ``advance_episode`` raises); here the call raises first."""
        _, error = outcome(fn, self.ours)
        assert isinstance(error, ValueError), f"{what} on a full buffer: {error!r}"

    @property
    def pending(self) -> int:
        """Episodes of the group in progress, or that meta was set for before any step (0: none)."""
        return self.group or self.meta_batch

    def finished(self) -> None:
        """Nothing in progress any more on either side."""
        self.group = self.meta_batch = 0
        self.fresh.clear()

    def starting(self, count: int) -> None:
        """Before a call that may start episodes in the next ``count`` slots: the seed reuses a
        slot's rows and meta as they are when it still counts them initialised (after an
        ``episode_index`` jump or a wider batch), where replaybuf starts from the defaults."""
        if self.group or int(self.seed.timestep_index) > 0:
            return
        lens = np.asarray(self.seed.episode_lens[:])
        for slot in self.slots(min(count, self.max_episodes)):
            if not bool(self.seed._initted[slot]):
                # the seed resets the slot's rows now; a committed episode there is read back as
                # defaults until the new one commits, while it stays whole here
                self.fresh.add(slot)
                if lens[slot] > 0:
                    self.stale.add(slot)
                else:
                    self.stale.discard(slot)
            elif not self.meta_batch:
                self.stale.add(slot)  # difference: stale rows and meta of the seed
                self.fresh.discard(slot)

    def commit(self, slots: set[int]) -> None:
        """Both committed episodes to ``slots``: lengths agree again, rows where freshly reset."""
        self.tainted -= slots
        self.stale -= slots & self.fresh
        self.fresh -= slots

    # ---- writes ----------------------------------------------------------------------------

    @precondition(lambda self: self.pending <= 1)  # difference: store() in a batched group raises here
    @rule(data=st.data(), names=st.sets(st.sampled_from(sorted(FIELDS))))
    def store(self, data, names):
        step = {n: values(data, n, ()) for n in sorted(names)}
        if self.full and not self.pending and int(self.seed.timestep_index) == 0:
            self.refused_when_full(lambda b: b.store(**step), "store")
            return
        self.starting(1)
        (theirs, ours), failed = self.both(lambda b: b.store(**step), "store")
        if not failed:
            assert theirs._fields == ours._fields
            for a, b in zip(ours, theirs):
                np.testing.assert_array_equal(a, b, err_msg="store() result")
            self.group = 1

    @rule(data=st.data(), batch=st.integers(1, 4), names=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1))
    def store_batch(self, data, batch, names):
        # difference: a batch of another size than the group's (or than the meta set before) raises
        # or drops that meta here; a batch larger than the buffer raises here
        batch = self.pending or min(batch, self.max_episodes)
        step = {n: torch.from_numpy(values(data, n, (batch,))) for n in sorted(names)}
        self.starting(min(batch, self.room))
        _, failed = self.both(lambda b: b.store_batch(**step), "store_batch")
        if not failed and not self.group:
            self.group = min(batch, self.room)

    @rule(data=st.data(), batch=st.integers(1, 4), names=st.sets(st.sampled_from(sorted(META)), min_size=1))
    def store_meta_batch(self, data, batch, names):
        batch = self.pending or min(batch, self.max_episodes)  # difference: as in store_batch
        meta = {n: torch.from_numpy(values(data, n, (batch,), meta=True)) for n in sorted(names)}
        self.starting(min(batch, self.room))
        _, failed = self.both(lambda b: b.store_meta_batch(**meta), "store_meta_batch")
        if not failed and not self.group:
            self.meta_batch = min(batch, self.room)

    @rule(batch_size=st.none() | st.integers(1, 4))
    def advance_episode(self, batch_size):
        t = int(self.seed.timestep_index)
        if batch_size is None and self.group > 1:
            batch_size = self.group  # difference: without batch_size the whole group is committed here
        if batch_size is not None and (batch_size > self.max_episodes or (t > 0 and batch_size > max(self.group, 1))):
            # difference: committing more episodes than are in progress, or than the buffer
            # holds, raises here (the seed wraps around onto the same slots)
            _, error = outcome(lambda b: b.advance_episode(batch_size), self.ours)
            assert isinstance(error, ValueError), f"advance_episode({batch_size}): {error!r}"
            return
        count = batch_size or 1

        def call(buffer):
            return buffer.advance_episode() if batch_size is None else buffer.advance_episode(batch_size)

        if t == 0 and count == 1:  # nothing stored: nothing happens on either side
            self.both(call, "advance_episode(1) before any step")
            return
        slots, kept = self.slots(max(self.group, self.meta_batch, count)), self.slots(count)
        if t == 0 and count > self.meta_batch:
            # difference: length-0 episodes without meta set get the default here, the seed
            # leaves the slot's earlier meta
            self.tainted |= kept
        self.starting(count)
        _, failed = self.both(call, f"advance_episode({batch_size})")
        if failed:
            return
        if t > 0:
            self.commit(kept)
        # the seed published the lengths of the rows it leaves behind; nothing of them is kept here
        self.tainted |= slots - kept
        self.finished()

    @precondition(lambda self: self.pending <= 1)  # difference: the seed overwrites an episode in progress
    @rule(data=st.data(), length=st.integers(1, 6), names=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1))
    def store_episode(self, data, length, names):
        episode = {n: values(data, n, (length,)) for n in sorted(names)}
        if data.draw(st.booleans()):
            episode["label"] = int(data.draw(st.integers(-3, 3)))
        if self.full:
            self.refused_when_full(lambda b: b.store_episode(**episode), "store_episode")
            return
        slots = self.slots(1)
        if int(self.seed.timestep_index) > 0:
            self.tainted |= slots  # the seed published the steps it then overwrites
            if set(episode) & set(FIELDS) != set(FIELDS):
                # difference: the seed keeps the episode in progress in the fields not given
                self.stale |= slots
                self.fresh -= slots
        self.starting(1)
        _, failed = self.both(lambda b: b.store_episode(**episode), "store_episode")
        if not failed:
            self.commit(slots)
            self.finished()

    @precondition(lambda self: self.pending <= 1 and int(self.seed.timestep_index) == 0)
    @rule(data=st.data(), steps=st.integers(0, 3), meta=st.booleans(), fail=st.booleans())
    def one_episode(self, data, steps, meta, fail):
        # difference: one_episode with an episode in progress raises here, the seed continues it;
        # a rolled-back episode leaves nothing here, its meta neither (so no meta when it fails)
        start = {"label": int(data.draw(st.integers(-3, 3)))} if meta and not fail else {}
        rows = [{n: values(data, n, ()) for n in sorted(FIELDS)} for _ in range(steps)]
        final = {"score": values(data, "score", (), meta=True)} if data.draw(st.booleans()) and not fail else {}
        slot = self.slots(1)
        self.starting(1)

        def run(buffer):
            with buffer.one_episode(**start) as final_meta:
                for row in rows:
                    buffer.store(**row)
                final_meta.update(final)
                if fail:
                    raise RolledBack

        _, failed = self.both(run, "one_episode")
        if fail:
            if rows:
                # the seed published the rolled-back steps' lengths and keeps their rows in the
                # slot for the next episode there
                self.tainted |= slot
                self.stale |= slot
                self.fresh -= slot
            if self.meta_batch:
                self.tainted |= slot  # and keeps the meta set before, which is dropped here
            self.finished()
        elif not failed and rows:
            self.commit(slot)
            self.finished()
        elif not failed:
            self.meta_batch = 1  # nothing stored: the meta waits for the next episode

    @precondition(lambda self: int(self.seed.timestep_index) == 0)
    @rule(data=st.data(), batch=st.integers(1, 4), steps=st.integers(0, 3), meta=st.booleans())
    def batched_episode(self, data, batch, steps, meta):
        # difference: nested groups and batches larger than the buffer raise here
        batch = self.pending or min(batch, self.max_episodes)
        start = {"label": torch.from_numpy(values(data, "label", (batch,), meta=True))} if meta else {}
        rows = [{n: torch.from_numpy(values(data, n, (batch,))) for n in sorted(FIELDS)} for _ in range(steps)]
        slots = self.slots(batch)
        self.starting(batch)

        def run(buffer):
            with buffer.batched_episode(batch, **start):
                for row in rows:
                    buffer.store_batch(**row)

        _, failed = self.both(run, f"batched_episode({batch})")
        if failed:
            return
        if rows:
            self.commit(slots)
            self.finished()
        elif batch > 1:
            if not (meta or self.meta_batch):
                self.tainted |= slots  # length-0 episodes: meta differs (see advance_episode)
            self.finished()
        else:
            self.meta_batch = 1

    @rule(data=st.data())
    def store_datapoint(self, data):
        episode = data.draw(st.integers(-1, self.max_episodes))
        t = data.draw(st.integers(-1, self.max_timesteps))
        name = data.draw(st.sampled_from(sorted(FIELDS)))
        value = values(data, name, ())
        if 0 <= episode < self.max_episodes and 0 <= t < self.max_timesteps and self.pending:
            return  # difference: a write into an episode in progress lands in its staged rows here
        self.both(lambda b: b.store_datapoint(episode, t, name, value), "store_datapoint")

    @rule(data=st.data())
    def store_meta_datapoint(self, data):
        episode = data.draw(st.integers(-1, self.max_episodes))
        name = data.draw(st.sampled_from(sorted(META)))
        value = values(data, name, (), meta=True)
        if 0 <= episode < self.max_episodes and (self.pending or episode in self.slots(1)):
            return  # difference: meta of the next episode is kept in its group here (see README)
        self.both(lambda b: b.store_meta_datapoint(episode, name, value), "store_meta_datapoint")

    @rule(data=st.data())
    def store_batch_datapoint(self, data):
        # ascending: the seed's ReplayBufferH5PY takes no other (h5py's fancy indexing)
        episodes = np.asarray(sorted(data.draw(st.sets(st.integers(0, self.max_episodes - 1), min_size=1))))
        t = data.draw(st.integers(-1, self.max_timesteps))
        name = data.draw(st.sampled_from(sorted(FIELDS)))
        value = values(data, name, (len(episodes),))
        call = lambda b: b.store_batch_datapoint(episodes, t, name, value)  # noqa: E731
        if t < 0:  # difference: a negative index raises here, the seed wraps it
            _, error = outcome(call, self.ours)
            assert isinstance(error, ValueError), f"store_batch_datapoint at timestep {t}: {error!r}"
            return
        if self.pending and t < self.max_timesteps:
            return  # difference: as store_datapoint into an episode in progress
        self.both(call, "store_batch_datapoint")

    @rule(data=st.data())
    def store_batch_meta_datapoint(self, data):
        # ascending: the seed's ReplayBufferH5PY takes no other (h5py's fancy indexing)
        episodes = np.asarray(sorted(data.draw(st.sets(st.integers(0, self.max_episodes - 1), min_size=1))))
        name = data.draw(st.sampled_from(sorted(META)))
        value = values(data, name, (len(episodes),), meta=True)
        if self.pending or set(episodes.tolist()) & self.slots(1):
            return  # difference: as store_meta_datapoint
        self.both(lambda b: b.store_batch_meta_datapoint(episodes, name, value), "store_batch_meta_datapoint")

    # difference: a writable open derives the counters from the published episodes, where the
    # seed keeps an ``episode_index`` set by hand (README: recovery)
    @precondition(lambda self: self.pending == 0 and int(self.seed.timestep_index) == 0 and not self.jumped)
    @rule()
    def reopen(self):
        """Both reopened from their folders (``from_folder``): counters and episodes carry over."""
        seed_folder, ours_folder = self.seed.folder, self.ours.folder
        self.seed.flush()
        self.ours.close()
        self.seed = type(self.seed).from_folder(seed_folder)
        self.ours = type(self.ours).from_folder(ours_folder)

    # difference: update() of a slot whose meta was set before its episode began keeps it in the seed
    @precondition(lambda self: self.pending == 0 and int(self.seed.timestep_index) == 0)
    @rule(data=st.data(), kind=st.sampled_from(["none", "int", "list", "slice"]))
    def update(self, data, kind):
        indices = {
            "none": None,
            "int": data.draw(st.integers(0, self.max_episodes - 1)),
            "list": sorted(data.draw(st.sets(st.integers(0, self.max_episodes - 1), min_size=1))),
            "slice": slice(0, data.draw(st.integers(1, self.max_episodes))),
        }[kind]
        count = 1 if kind == "int" else None
        name = data.draw(st.sampled_from(sorted(FIELDS) + sorted(META)))
        if name in META:
            value = values(data, name, () if kind == "int" else (1,), meta=True)
        else:
            value = values(data, name, ((1,) if count is None else ()) + (data.draw(st.integers(1, 3)),))
        self.both(lambda b: b.update(indices, **{name: value}), f"update({kind}, {name})")

    @rule(name=st.sampled_from(["clear", "reset_"]))
    def clear(self, name):
        self.both(lambda b: getattr(b, name)(), name)
        self.finished()
        self.jumped = False
        self.tainted.clear()
        self.stale.clear()
        self.fresh.clear()

    @rule(data=st.data())
    def set_timestep_index(self, data):
        t = int(self.seed.timestep_index)
        value = data.draw(st.integers(0, self.max_timesteps))
        if self.group == 0 and t == 0 and value > 0:
            return  # difference: skipped steps hold the default here, whatever the slot held in the seed
        if value < t:
            rewound = self.slots(max(self.group, 1))
            self.tainted |= rewound  # the seed keeps the longer lengths published
            self.stale |= rewound  # and the rewound steps' rows, which a later episode there reuses
            self.fresh -= rewound
        _, failed = self.both(lambda b: setattr(b, "timestep_index", value), "timestep_index = ...")
        if not failed and value == 0 and self.group:
            self.meta_batch, self.group = self.group, 0  # an empty group: as if only meta was set

    @precondition(lambda self: int(self.seed.timestep_index) == 0 and self.pending == 0)
    @rule(data=st.data())
    def set_episode_index(self, data):
        value = data.draw(st.integers(0, self.max_episodes - 1))
        _, failed = self.both(lambda b: setattr(b, "episode_index", value), "episode_index = ...")
        self.jumped |= not failed

    # ---- reads -------------------------------------------------------------------------------

    @invariant()
    def counters_agree(self):
        if not hasattr(self, "seed"):
            return
        assert int(self.ours.num_episodes) == int(self.seed.num_episodes), "num_episodes"
        assert int(self.ours.episode_index) == int(self.seed.episode_index), "episode_index"
        assert int(self.ours.timestep_index) == int(self.seed.timestep_index), "timestep_index"

    def quiet(self) -> bool:
        """Between episodes: nothing in progress on either side."""
        return int(self.seed.timestep_index) == 0 and int(self.ours.timestep_index) == 0

    @invariant()
    def lengths_agree(self):
        if not hasattr(self, "seed") or not self.quiet():
            return
        theirs, ours = np.asarray(self.seed.episode_lens[:]), np.asarray(self.ours.episode_lens)
        for slot in range(self.max_episodes):
            if slot not in self.tainted:
                assert ours[slot] == theirs[slot], f"episode_lens[{slot}]: {ours.tolist()} vs seed {theirs.tolist()}"
        if not self.tainted:
            assert len(self.ours) == len(self.seed)

    @precondition(lambda self: self.quiet())
    @rule(data=st.data())
    def get_all_data(self, data):
        selection = data.draw(
            st.sampled_from(
                [
                    {},
                    {"fields": ("obs",)},
                    {"meta_fields": ("label",)},
                    {"fields": ("act", "done"), "meta_fields": ("score",)},
                ]
            )
        )
        (theirs, ours), failed = self.both(lambda b: b.get_all_data(**selection), f"get_all_data({selection})")
        if failed:
            return
        assert set(ours) == set(theirs), f"get_all_data({selection}) keys {sorted(ours)} vs seed {sorted(theirs)}"
        lens = np.asarray(self.seed.episode_lens[:])
        for key, value in theirs.items():
            a, b = ours[key].numpy(), value.numpy()
            # the time axis is as long as the longest episode: the seed's tainted rows may be longer
            same = a.shape == b.shape if not self.tainted else a.shape[0] == b.shape[0]
            assert same, f"get_all_data[{key}]: shape {a.shape} vs seed {b.shape}"
            for row in range(len(b)):
                if row in self.tainted | self.stale or (key in META and lens[row] == 0):
                    continue  # difference: meta of length-0 episodes (see advance_episode)
                if key in FIELDS:  # difference: beyond an episode's end the seed returns what the slot held
                    np.testing.assert_array_equal(a[row, : lens[row]], b[row, : lens[row]], err_msg=f"{key}[{row}]")
                else:
                    np.testing.assert_array_equal(a[row], b[row], err_msg=f"{key}[{row}]")

    LOADERS = [
        dict(),
        dict(fields=("obs", "act"), return_indices=True, return_mask=True),
        dict(fieldname_map={"obs": "state"}, filter_meta={"label": 0}),
        dict(to_named_tuple=("obs", "done", "_lens")),
        dict(timestep_level=True),
        dict(timestep_level=True, return_indices=True, fields=("rew",), filter_meta={"label": 1}),
        dict(n_steps=2, current_fields=("obs",), next_fields=("obs", "act"), sequence_fields=("rew",)),
        dict(n_steps=1, return_indices=True, fieldname_map={"next_obs": "obs_next"}),
    ]

    @precondition(lambda self: self.quiet() and not self.tainted and not self.stale)
    @rule(config=st.sampled_from(range(len(LOADERS))), batch_size=st.integers(1, 3))
    def dataloader(self, config, batch_size):
        kwargs = self.LOADERS[config]
        if "n_steps" in kwargs and not self.seed_n_steps:
            return
        (theirs, ours), failed = self.both(
            lambda b: list(b.dataloader(batch_size, shuffle=False, **kwargs)), f"dataloader({kwargs})", empty_ok=True
        )
        if failed:
            return
        assert len(ours) == len(theirs), f"dataloader({kwargs}): {len(ours)} batches vs seed {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_batches_equal(a, b, f"dataloader({kwargs}) batch {i}")

    @precondition(lambda self: self.quiet() and not self.tainted and not self.stale)
    @rule(
        kwargs=st.sampled_from([dict(), dict(timestep_level=True), dict(n_steps=2), dict(slice_by_episode_len=False)])
    )
    def dataset(self, kwargs):
        if "n_steps" in kwargs and not self.seed_n_steps:
            return
        (theirs, ours), failed = self.both(lambda b: b.dataset(**kwargs), f"dataset({kwargs})", empty_ok=True)
        if failed:
            return
        assert len(ours) == len(theirs), f"dataset({kwargs}): {len(ours)} items vs seed {len(theirs)}"
        for i in range(len(theirs)):
            a, b = dict(ours[i]), dict(theirs[i])
            if kwargs.get("slice_by_episode_len") is False:  # whole rows: compared within the episode
                for key in FIELDS:
                    a[key], b[key] = a[key][: int(b["_lens"])], b[key][: int(b["_lens"])]
            assert_batches_equal(a, b, f"dataset({kwargs})[{i}]")


class H5DifferentialMachine(DifferentialMachine):
    seed_cls = getattr(seed, "ReplayBufferH5PY", None)  # the seed defines it only where h5py imports
    ours_cls = replaybuf.ReplayBufferH5PY
    ours_kwargs = ({},)
    seed_n_steps = False


@pytest.mark.parametrize("machine", [DifferentialMachine, H5DifferentialMachine], ids=["memmap", "h5py"])
def test_differential(machine, tmp_path):
    if machine is H5DifferentialMachine:
        require("h5py")
    machine.tmp_root = str(tmp_path)
    run_state_machine_as_test(machine, settings=diff_settings())
