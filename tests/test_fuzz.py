"""Hypothesis: random schemas and call sequences against a plain in-memory model, on every backend.

The model is a dict of slots, each holding an episode's length, full-width rows, meta values and
its commit ordinal; every rule applies a call to both and the invariant compares what a reader
sees. Bad inputs are thrown in between: they must raise ValueError/TypeError and change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from replaybuf import ReplayBuffer

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (1,), (2,), (2, 3)]

field_specs = st.fixed_dictionaries(
    {"dtype": st.sampled_from(DTYPES), "shape": st.sampled_from(SHAPES)},
    optional={"default": st.sampled_from([0, 1]), "chunks": st.integers(1, 3)},
)
meta_specs = st.fixed_dictionaries(
    {"dtype": st.sampled_from(DTYPES), "shape": st.sampled_from([(), (2,)])},
    optional={"default": st.sampled_from([0, 1])},
)
schemas = st.tuples(
    st.dictionaries(st.sampled_from(["obs", "act", "rew"]), field_specs, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["task", "score"]), meta_specs, max_size=2),
)


def elements(dtype: np.dtype):
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "u":
        return st.integers(0, 200)
    if dtype.kind == "i":
        return st.integers(-100, 100)
    return st.floats(-100, 100, width=8 * min(dtype.itemsize, 8), allow_nan=False)


def values(data, field, lead: tuple[int, ...]) -> np.ndarray:
    if field.dtype.kind == "b":  # hypothesis's bool arrays misfire on numpy 2.4 (False read back as True)
        return data.draw(hnp.arrays(np.uint8, lead + field.shape, elements=st.integers(0, 1))).astype(bool)
    return data.draw(hnp.arrays(field.dtype, lead + field.shape, elements=elements(field.dtype)))


class BufferMachine(RuleBasedStateMachine):
    """Drives a ReplayBuffer and the model side by side; ``make_location`` is set per test."""

    make_location = None

    # ---- setup ----------------------------------------------------------------------------

    @initialize(
        schema=schemas,
        circular=st.booleans(),
        max_episodes=st.integers(1, 4),
        max_timesteps=st.integers(1, 6),
        flush=st.sampled_from([0, 1, 2]),
    )
    def create(self, schema, circular, max_episodes, max_timesteps, flush):
        fields, meta_fields = schema
        self.location, self.extra = self.make_location()
        self.config = dict(
            max_episodes=max_episodes,
            max_timesteps=max_timesteps,
            fields=fields,
            meta_fields=meta_fields,
            circular=circular,
            flush_every_store_step=flush,
        )
        self.buffer = ReplayBuffer(self.location, **self.config, **self.extra)
        self.fields = self.buffer.schema.fields
        self.meta_fields = self.buffer.schema.meta_fields
        self.slots: dict[int, dict] = {}
        self.num_episodes = self.episode_index = self.total = 0

    def teardown(self):
        if getattr(self, "buffer", None) is not None:
            self.buffer.close()

    # ---- the model ----------------------------------------------------------------------------

    @property
    def room(self) -> int:
        return self.buffer.max_episodes if self.buffer.circular else self.buffer.max_episodes - self.num_episodes

    def fresh_row(self, field) -> np.ndarray:
        return np.full((self.buffer.max_timesteps, *field.shape), field.fill, dtype=field.dtype)

    def model_commit(self, episodes: list[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]]) -> None:
        """Commit (length, {field: (length, *shape)}, {meta: value}) episodes as one group."""
        size = self.buffer.max_episodes
        for i, (length, steps, meta) in enumerate(episodes):
            slot = (self.episode_index + i) % size
            rows = {n: self.fresh_row(f) for n, f in self.fields.items()}
            for name, value in steps.items():
                rows[name][:length] = value
            metas = {n: np.full(f.shape, f.fill, f.dtype) for n, f in self.meta_fields.items()}
            metas.update({n: np.asarray(v, self.meta_fields[n].dtype) for n, v in meta.items()})
            self.slots[slot] = {"len": length, "rows": rows, "meta": metas, "gen": self.total + i + 1}
        self.total += len(episodes)
        self.num_episodes = min(self.num_episodes + len(episodes), size)
        self.episode_index = (self.episode_index + len(episodes)) % size

    def draw_meta(self, data, lead: tuple[int, ...]) -> dict[str, np.ndarray]:
        names = data.draw(st.lists(st.sampled_from(sorted(self.meta_fields)), unique=True)) if self.meta_fields else []
        return {n: values(data, self.meta_fields[n], lead) for n in names}

    def draw_fields(self, data) -> list[str]:
        return data.draw(st.lists(st.sampled_from(sorted(self.fields)), min_size=1, unique=True))

    # ---- rules ----------------------------------------------------------------------------------

    @rule(data=st.data())
    def store_episode(self, data):
        length = data.draw(st.integers(1, self.buffer.max_timesteps))
        steps = {n: values(data, self.fields[n], (length,)) for n in self.draw_fields(data)}
        meta = self.draw_meta(data, ())
        if self.room < 1:
            with pytest.raises(ValueError, match="full"):
                self.buffer.store_episode(**steps, **meta)
            return
        self.buffer.store_episode(**steps, **meta)
        self.model_commit([(length, steps, meta)])

    @rule(data=st.data())
    def store_steps(self, data):
        # at least one step: an empty block's meta carries over to the next episode, as in the
        # seed, which test_differential checks against the real package
        length = data.draw(st.integers(1, self.buffer.max_timesteps))
        meta, final = self.draw_meta(data, ()), self.draw_meta(data, ())
        if self.room < 1:
            with pytest.raises(ValueError, match="full"), self.buffer.one_episode(**meta):
                pass
            return
        steps = {n: self.fresh_row(f)[:length] for n, f in self.fields.items()}
        with self.buffer.one_episode(**meta) as end:
            for t in range(length):
                step = {n: values(data, self.fields[n], ()) for n in self.draw_fields(data)}
                self.buffer.store(**step)
                for name, value in step.items():
                    steps[name][t] = value
            end.update(final)
        if length:
            self.model_commit([(length, steps, {**meta, **final})])

    @rule(data=st.data())
    def store_batched(self, data):
        batch = data.draw(st.integers(1, self.buffer.max_episodes))
        length = data.draw(st.integers(1, self.buffer.max_timesteps))
        meta = self.draw_meta(data, (batch,))
        if self.room < batch:
            with pytest.raises(ValueError, match="full"), self.buffer.batched_episode(batch, **meta):
                pass
            return
        steps = {n: np.stack([self.fresh_row(f)[:length]] * batch) for n, f in self.fields.items()}
        with self.buffer.batched_episode(batch, **meta):
            for t in range(length):
                step = {n: values(data, self.fields[n], (batch,)) for n in self.draw_fields(data)}
                self.buffer.store_batch(**step)
                for name, value in step.items():
                    steps[name][:, t] = value
        self.model_commit(
            [(length, {n: v[i] for n, v in steps.items()}, {n: v[i] for n, v in meta.items()}) for i in range(batch)]
        )

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def update(self, data):
        everything = data.draw(st.booleans())
        slots = (
            sorted(self.slots)
            if everything
            else data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True).map(sorted))
        )
        name = data.draw(st.sampled_from(sorted(self.fields) + sorted(self.meta_fields)))
        if name in self.fields:
            length = data.draw(st.integers(1, self.buffer.max_timesteps))
            value = values(data, self.fields[name], (len(slots), length))
            for i, slot in enumerate(slots):
                self.slots[slot]["rows"][name][:length] = value[i]
        else:
            value = values(data, self.meta_fields[name], (len(slots),))
            for i, slot in enumerate(slots):
                self.slots[slot]["meta"][name] = value[i]
        self.buffer.update(None if everything else np.array(slots), **{name: value})

    @rule()
    def clear(self):
        self.buffer.clear()
        self.slots, self.num_episodes, self.episode_index = {}, 0, 0

    @rule()
    def reopen(self):
        self.buffer.close()
        self.buffer = ReplayBuffer(self.location, **self.config, overwrite=False, **self.extra)

    @rule(data=st.data())
    def bad_input(self, data):
        buffer, name = self.buffer, data.draw(st.sampled_from(sorted(self.fields)))
        field = self.fields[name]
        wrong_shape = field.shape[:-1] + (field.shape[-1] + 1,) if field.shape else (2,)
        ints = [n for n, f in self.fields.items() if f.dtype.kind in "iub"]
        calls = {
            "string": (TypeError, lambda: buffer.store(**{name: "abc"})),
            "objects": (TypeError, lambda: buffer.store(**{name: np.array([object()] * 2)})),
            "shape": (ValueError, lambda: buffer.store(**{name: np.zeros(wrong_shape)})),
            "episode shape": (ValueError, lambda: buffer.store_episode(**{name: np.zeros((1, *wrong_shape))})),
            "too long": (
                ValueError,
                lambda: buffer.store_episode(**{name: np.zeros((buffer.max_timesteps + 1, *field.shape))}),
            ),
            "negative index": (
                ValueError,
                lambda: buffer.update(np.array([-1]), **{name: np.zeros((1, 1, *field.shape))}),
            ),
            "index past the end": (ValueError, lambda: buffer.update([buffer.max_episodes], **{name: 0})),
            "datapoint index": (ValueError, lambda: buffer.store_datapoint(-1, 0, name, 0)),
            "unknown field": (ValueError, lambda: buffer.store(nope=1.0)),
            "batch size": (ValueError, lambda: buffer.batched_episode(0).__enter__()),
        }
        if ints:
            calls["nan into ints"] = (
                ValueError,
                lambda: buffer.store(**{ints[0]: np.full(self.fields[ints[0]].shape, np.nan)}),
            )
        error, call = calls[data.draw(st.sampled_from(sorted(calls)))]
        with pytest.raises(error):
            call()
        assert buffer.timestep_index == 0, "a rejected call left an episode in progress"

    # ---- what a reader sees -------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        if getattr(self, "buffer", None) is None:
            return
        buffer = self.buffer
        assert buffer.num_episodes == self.num_episodes
        assert buffer.episode_index == self.episode_index
        lens = np.zeros(buffer.max_episodes, np.int32)
        for slot, episode in self.slots.items():
            lens[slot] = episode["len"]
        np.testing.assert_array_equal(buffer.episode_lens, lens)
        order = sorted(self.slots, key=lambda s: self.slots[s]["gen"])
        assert buffer.valid_episodes().tolist() == order
        got = buffer.get_all_data()
        if not order:
            assert got == {}
            return
        order = sorted(order)  # get_all_data is in slot order, as the seed
        longest = max(self.slots[s]["len"] for s in order)
        for name in self.fields:
            expected = np.stack([self.slots[s]["rows"][name][:longest] for s in order])
            # padding past each episode's end is the field's default (else zero), as the seed pads
            expected[np.arange(longest)[None, :] >= lens[order][:, None]] = self.fields[name].fill
            np.testing.assert_array_equal(got[name].numpy(), expected, err_msg=name)
        for name in self.meta_fields:
            np.testing.assert_array_equal(got[name].numpy(), np.stack([self.slots[s]["meta"][name] for s in order]))
        np.testing.assert_array_equal(got["episode_lens"].numpy(), lens[order])


def test_buffer_matches_model(make_location):
    machine = type("Machine", (BufferMachine,), {"make_location": staticmethod(make_location)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20,
            stateful_step_count=10,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        ),
    )


def test_huge_max_timesteps_is_refused_clearly_or_works(make_location):
    location, extra = make_location()
    try:
        buffer = ReplayBuffer(
            location, max_episodes=2, max_timesteps=10**9, fields={"frame": ("uint8", (64, 64, 3))}, **extra
        )
    except ValueError as e:
        assert "max_timesteps" in str(e)
        return
    buffer.store_episode(frame=np.ones((2, 64, 64, 3), np.uint8))
    assert buffer.episode_lens[0] == 2
