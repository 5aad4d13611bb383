"""Drop-in parity with memmap-replay-buffer 0.2.3 as a switching user meets it: the calls of
test_seed_*.py and test_differential.py with other inputs. Random schemas (dtypes, shapes,
defaults, spec forms) and values in every form a user passes (lists, tuples, Python scalars,
float64 and int64 arrays, torch tensors, 0-d arrays, non-contiguous and Fortran-ordered arrays)
go through store / store_episode / one_episode / update on both libraries, which must agree on
what raises, what store() returns and what the reads give; then the edges found that way."""

from __future__ import annotations

import os
import re
import shutil
import warnings

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replaybuf
from replaybuf.concat import WRITE_METHODS

from ._compare import assert_same

DTYPES = {"int": np.int32, "float": np.float32, "bool": np.bool_, "uint8": np.uint8}
SHAPES = [(), (1,), (2,), (2, 3)]


@st.composite
def field_specs(draw, prefix: str, count: tuple[int, int]) -> dict:
    """``{name: (kind, shape, spec)}``: a spec as a user writes it ('int', (kind, shape) with an
    int or tuple shape, or with a default)."""
    specs = {}
    for i in range(draw(st.integers(*count))):
        kind = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.sampled_from(SHAPES))
        form = draw(st.sampled_from(["str", "pair", "int shape", "default"]))
        if form == "str":
            shape, spec = (), kind
        elif form == "pair":
            spec = (kind, shape)
        elif form == "int shape":
            shape = (draw(st.integers(1, 3)),)
            spec = (kind, shape[0])
        else:
            default = {"int": -2, "float": 0.5, "bool": True, "uint8": 7}[kind]
            spec = (kind, shape, default)
        specs[f"{prefix}{i}"] = (kind, shape, spec)
    return specs


def as_user_value(draw, kind: str, shape: tuple[int, ...]):
    """Exact small values of the field's kind, in one of the forms a user passes."""
    n = int(np.prod(shape))
    if kind == "bool":
        flat = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif kind == "float":
        flat = draw(st.lists(st.sampled_from([0.0, 0.5, -2.25, 3.0]), min_size=n, max_size=n))
    else:
        flat = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    array = np.asarray(flat).reshape(shape)
    form = draw(st.sampled_from(["numpy", "exact", "tensor", "tensor64", "list", "float64", "strided", "fortran"]))
    if form == "exact":
        return array.astype(DTYPES[kind])
    if form == "tensor":
        return torch.from_numpy(array.astype(DTYPES[kind]))
    if form == "tensor64":
        return torch.from_numpy(array.astype(np.float64 if kind == "float" else array.dtype))
    if form == "list":
        return array.item() if array.ndim == 0 else array.tolist()
    if form == "float64" and kind != "bool":
        return array.astype(np.float64)
    if form == "strided" and array.ndim:
        return np.stack([array, array], axis=-1)[..., 0]  # a view with gaps between its items
    if form == "fortran" and array.ndim > 1:
        return np.asfortranarray(array)  # (which makes a 0-d array 1-d)
    return array


def outcome(fn, *args):
    """(result, None) or (None, exception) of ``fn(*args)``, warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(*args), None
        except Exception as e:  # noqa: BLE001 - which calls raise is what is compared
            return None, e


def committed(buffer) -> dict:
    """get_all_data with the steps past each episode's length zeroed (README: past an episode's
    length the seed returns whatever the slot held)."""
    data = buffer.get_all_data()
    lens = np.asarray(buffer.episode_lens[: len(data.get("episode_lens", []))])
    for name in buffer.fieldnames & set(data):
        for row, length in enumerate(lens):
            data[name][row, int(length) :] = 0
    return data


@st.composite
def scenarios(draw):
    fields = draw(field_specs("f", (1, 3)))
    meta = draw(field_specs("m", (0, 2)))
    max_episodes, max_timesteps = draw(st.integers(2, 3)), draw(st.integers(2, 4))
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["store_episode", "one_episode", "batched_episode", "update"]))
        length = draw(st.integers(1, max_timesteps))
        if kind == "store_episode":
            names = draw(st.sets(st.sampled_from(sorted(fields)), min_size=1))
            args = {n: as_user_value(draw, fields[n][0], (length, *fields[n][1])) for n in sorted(names)}
            args |= {n: as_user_value(draw, k, s) for n, (k, s, _) in meta.items() if draw(st.booleans())}
        elif kind == "batched_episode":
            # every field and meta field given: the seed keeps a slot's old rows and meta where a
            # batch is wider than the last commit (README: a new episode starts from the defaults)
            batch = draw(st.integers(1, max_episodes))
            rows = [{n: as_user_value(draw, k, (batch, *s)) for n, (k, s, _) in fields.items()} for _ in range(length)]
            args = (batch, rows, {n: as_user_value(draw, k, (batch, *s)) for n, (k, s, _) in meta.items()})
        elif kind == "one_episode":
            rows = [
                {n: as_user_value(draw, k, s) for n, (k, s, _) in fields.items() if draw(st.booleans())}
                for _ in range(length)
            ]
            args = (rows, {n: as_user_value(draw, k, s) for n, (k, s, _) in meta.items() if draw(st.booleans())})
        else:
            name = draw(st.sampled_from(sorted(fields) + sorted(meta)))
            slot = draw(st.integers(0, max_episodes - 1))
            kind_, shape, _ = {**fields, **meta}[name]
            args = (slot, name, kind_, shape, draw(st.data()))
        calls.append((kind, args))
    return fields, meta, max_episodes, max_timesteps, draw(st.booleans()), calls


def batches(buffer, options: dict) -> list:
    return list(buffer.dataloader(2, **options))


def batched_episode(buffer, batch_size, rows, meta):
    with buffer.batched_episode(batch_size, **meta):
        for row in rows:
            buffer.store_batch(**row)


def one_episode(buffer, rows, meta):
    returned = []
    with buffer.one_episode(**meta):
        for row in rows:
            returned.append(buffer.store(**row))
    return returned


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(scenario=scenarios())
def test_random_schemas_and_value_forms_store_and_read_as_the_seed(tmp_path_factory, scenario):
    fields, meta, max_episodes, max_timesteps, circular, calls = scenario
    root = tmp_path_factory.mktemp("forms")
    args = dict(
        max_episodes=max_episodes,
        max_timesteps=max_timesteps,
        fields={n: spec for n, (_, _, spec) in fields.items()},
        meta_fields={n: spec for n, (_, _, spec) in meta.items()},
        circular=circular,
    )
    theirs, ours = seed.ReplayBuffer(root / "seed", **args), replaybuf.ReplayBuffer(root / "ours", **args)
    try:
        for kind, call_args in calls:
            if not circular and theirs.num_episodes >= max_episodes:
                break  # README: the seed overwrites slot 0 of a full buffer before it raises
            if kind == "store_episode":
                call = lambda b, a=call_args: b.store_episode(**a)  # noqa: E731
            elif kind == "one_episode":
                call = lambda b, a=call_args: one_episode(b, *a)  # noqa: E731
            elif kind == "batched_episode":
                call = lambda b, a=call_args: batched_episode(b, *a)  # noqa: E731
            else:
                slot, name, value_kind, shape, data = call_args
                length = int(theirs.episode_lens[slot])
                if length == 0:
                    continue  # README: the seed's meta of slots it never committed may differ
                value = as_user_value(data.draw, value_kind, (length, *shape) if name in fields else shape)
                call = lambda b, s=slot, n=name, v=value: b.update(s, **{n: v})  # noqa: E731
            (seed_result, seed_error), (our_result, our_error) = outcome(call, theirs), outcome(call, ours)
            assert (seed_error is None) == (our_error is None), f"{kind}: seed {seed_error!r}, replaybuf {our_error!r}"
            if seed_error is not None:
                break
            assert_same(our_result, seed_result, f"{kind} result")
            assert_same(committed(ours), committed(theirs), f"get_all_data after {kind}")
        if len(theirs):
            for options in (dict(), dict(timestep_level=True), dict(n_steps=2, sequence_fields=tuple(fields))):
                (seed_batches, _), (our_batches, our_error) = (outcome(batches, b, options) for b in (theirs, ours))
                if seed_batches:  # README: a loader that would be empty raises here
                    assert our_error is None, f"dataloader({options}): {our_error!r}"
                    assert_same(our_batches, seed_batches, f"dataloader({options})")
    finally:
        ours.close()


# an episode of 0 steps


def test_store_episode_of_zero_steps_stores_nothing_as_the_seed(tmp_path):
    """The seed skips an empty trajectory (its advance_episode does nothing at step 0); here it
    raised, so a collection loop that meets an empty rollout stopped after the switch."""
    args = dict(max_episodes=3, max_timesteps=3, fields={"x": ("float", 2), "a": "int"}, meta_fields={"m": "int"})
    theirs, ours = seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)
    for buffer in (theirs, ours):
        buffer.store_episode(x=np.ones((2, 2)), a=[1, 2], m=3)
        buffer.store_episode(x=torch.ones(1, 2), a=[4], m=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert buffer.store_episode(x=np.zeros((0, 2)), a=torch.zeros(0, dtype=torch.int64)) is None
    assert any("0 timesteps" in str(w.message) for w in caught)  # ours says it stored nothing
    counters = [(b.num_episodes, b.episode_index, b.timestep_index, len(b)) for b in (theirs, ours)]
    assert counters[0] == counters[1] == (2, 2, 0, 2)
    assert_same(committed(ours), committed(theirs), "after an empty store_episode")
    for buffer in (theirs, ours):  # the next episode goes where it would have gone
        buffer.store_episode(x=np.full((3, 2), 2.0), a=[7, 8, 9], m=6)
    assert_same(committed(ours), committed(theirs), "after the next episode")
    # an empty episode is still checked like any other: a wrong feature shape raises in both
    for buffer in (theirs, ours):
        with pytest.raises(ValueError, match="shape"):
            buffer.store_episode(x=np.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"invalid field names \['nope'\]"):
        ours.store_episode(x=np.zeros((0, 2)), nope=1)
    # on the full buffer it changes nothing either (the seed resets slot 0's rows to the
    # defaults for the episode that never comes, README: a new episode starts from the defaults)
    before = committed(ours)
    with pytest.warns(UserWarning, match="nothing is stored"):
        ours.store_episode(a=np.zeros(0))
    assert_same(committed(ours), before, "an empty store_episode on the full buffer")
    ours.close()
    assert_same(committed(replaybuf.ReplayBuffer.from_folder(ours.folder, read_only=True)), before, "reopened")


def test_buffered_storer_still_refuses_an_episode_of_zero_steps(tmp_path):
    pytest.importorskip("h5py")
    buffer = replaybuf.ReplayBufferH5PY(tmp_path / "h5", max_episodes=3, max_timesteps=3, fields={"x": "float"})
    store = buffer.get_buffered_storer(2)
    store(x=np.ones(2))
    with pytest.raises(ValueError, match="at least one timestep, got 0; the batch is dropped"):
        store(x=np.ones(0))
    assert buffer.num_episodes == 0
    store(x=np.ones(3), force_flush=True)
    assert buffer.episode_lens.tolist() == [3, 0, 0]


# opening a folder that holds no buffer


@pytest.mark.parametrize(
    "open_missing",
    [
        lambda lib, path: lib.ReplayBuffer.from_folder(path),
        lambda lib, path: lib.ReplayBuffer.from_folder(path, read_only=True),
        lambda lib, path: lib.ConcatReplayBuffer([path]),
    ],
    ids=["from_folder", "from_folder read-only", "ConcatReplayBuffer"],
)
def test_a_missing_buffer_raises_the_seeds_value_error(tmp_path, open_missing):
    """``except ValueError`` around ``from_folder`` (the seed's 'metadata.pkl not found') keeps
    catching a missing buffer; it is a FileNotFoundError as well, and nothing is created."""
    for lib in (seed, replaybuf):
        path = tmp_path / f"missing-{lib.__name__}"
        with pytest.raises(ValueError) as raised:
            open_missing(lib, path)
        assert not path.exists()
    assert isinstance(raised.value, replaybuf.BufferNotFoundError) and isinstance(raised.value, FileNotFoundError)
    assert repr(str(path)) in str(raised.value)


def test_a_seed_folder_with_meta_names_that_are_no_identifiers_opens_and_reads_as_the_seed(tmp_path):
    """The seed takes any string as a meta field name; its folders with 'task-id', 'success rate',
    'env.id' or '1st' open here (they were refused as damaged), read and write as the seed's, and
    a new buffer takes such names."""
    meta = {"task-id": "int", "success rate": ("float", (), 0.5), "env.id": ("int", 2), "1st": "bool"}
    theirs = seed.ReplayBuffer(tmp_path / "seed", 4, 3, {"x": "float"}, meta)
    for episode in range(2):
        with theirs.one_episode(**{"task-id": episode, "1st": episode == 0}) as final:
            theirs.store(x=float(episode))
            final["success rate"] = episode / 4
    theirs.flush()
    shutil.copytree(tmp_path / "seed", tmp_path / "copy")
    ours = replaybuf.ReplayBuffer.from_folder(tmp_path / "copy")
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    for buffer in (ours, theirs):
        with buffer.one_episode(**{"env.id": [1, 2]}):
            buffer.store(x=3.0)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data after a write")
    loader = dict(batch_size=2, filter_meta={"task-id": 1})
    assert_same(list(ours.dataloader(**loader)), list(theirs.dataloader(**loader)), "dataloader")
    ours.close()
    created = replaybuf.ReplayBuffer(tmp_path / "zarr", 4, 3, {"x": "float"}, meta)
    with created.one_episode(**{"env.id": [1, 2]}):
        created.store(x=1.0)
    created.close()
    reopened = replaybuf.ReplayBuffer.from_folder(tmp_path / "zarr", read_only=True)
    assert reopened.meta_data["env.id"][0].tolist() == [1, 2] and reopened.meta_data["success rate"][0] == 0.5


@pytest.mark.parametrize("name", ["../up", "a/b", "", ".hidden", "..", "a:b", "tab\t"])
def test_a_meta_field_name_that_cannot_name_a_file_is_refused_naming_it(tmp_path, name):
    """README, Differences: a meta field name holds letters, digits, '_', '-', '.' and spaces,
    not starting with '.' (it names files, arrays and object keys); the seed takes any string
    (its '../up' writes beside its folder). Nothing is created."""
    path = tmp_path / "ours"
    with pytest.raises(ValueError, match=re.escape(f"meta field name {name!r} is refused")):
        replaybuf.ReplayBuffer(path, 2, 3, {"x": "int"}, {name: "int"})
    assert not path.exists()


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_fractional_floats_that_truncate_into_range_are_stored_as_the_seed(tmp_path, backend):
    """255.9 into a uint8 field is 255 and -0.5 is 0 (the cast truncates toward zero, as the
    seed's): they were refused as out of range, comparing the floats before truncation.
    256.0 and -1.0 stay refused."""
    if backend == "hdf5":
        pytest.importorskip("h5py")
    args = dict(max_episodes=3, max_timesteps=3, fields={"u": ("uint8", 2), "i": "int"}, meta_fields={"m": "uint8"})
    ours = replaybuf.ReplayBuffer(tmp_path / "ours", backend=backend, **args)
    theirs = seed.ReplayBuffer(tmp_path / "seed", **args)
    for buffer in (ours, theirs):
        with buffer.one_episode(m=255.99):
            buffer.store(u=[255.9, -0.5], i=2147483647.5)
            buffer.store(u=np.array([-0.99, 0.5], np.float32), i=-2147483648.9)
        buffer.store_episode(u=np.full((2, 2), 255.5), i=[1.5, -1.5], m=-0.5)
        buffer.update(0, m=np.float16(255.2))
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    assert ours.get_all_data()["u"][0].tolist() == [[255, 0], [0, 0]]
    before = ours.get_all_data()
    for value in (256.0, -1.0):
        with pytest.raises(ValueError, match=r"field 'u': values in .* do not fit dtype uint8"):
            ours.store_episode(u=[[value, 0.0]])
    assert_same(ours.get_all_data(), before, "after refused writes")


# field defaults the dtype cannot hold


@pytest.mark.parametrize(
    "spec, meta, match",
    [
        (("uint8", (), -1), False, r"field 'x': default -1 is refused: values in \[-1, -1\] do not fit dtype uint8"),
        (("uint8", 2, 300), False, "default 300 is refused: .* uint8"),
        (("int", (), 2**40), True, "default 1099511627776 is refused: .* int32"),
        (("int", (), float("nan")), False, "default nan is refused: non-finite"),
        (("bool", (), float("nan")), True, "default nan is refused: non-finite"),
        (("float", (), 1e300), False, "default 1e\\+300 is refused: .* stored as infinity"),
    ],
)
def test_a_default_the_dtype_cannot_hold_is_refused_before_anything_is_written(tmp_path, spec, meta, match):
    """It raised numpy's OverflowError (naming no field), or stored 1e300 as infinity where a
    write of 1e300 is refused; the seed fails at the first store (numpy's OverflowError)."""
    path = tmp_path / "buffer"
    fields, meta_fields = ({"y": "float"}, {"x": spec}) if meta else ({"x": spec}, None)
    with pytest.raises(ValueError, match=match):
        replaybuf.ReplayBuffer(path, 2, 3, fields, meta_fields)
    assert not path.exists()


def test_a_stored_config_with_such_a_default_still_opens(tmp_path):
    """Only a new buffer's defaults are checked: a folder the seed wrote with a default of 1e300
    for a float32 field (stored as infinity) opens and reads as the seed reads it."""
    theirs = seed.ReplayBuffer(tmp_path / "seed", 2, 3, {"x": ("float", (), 1e300), "y": "int"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy's overflow warning in the seed's fill
        theirs.store(y=1)
    theirs.advance_episode()
    theirs.flush()
    ours = replaybuf.ReplayBuffer.from_folder(tmp_path / "seed", read_only=True)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    assert ours.get_all_data()["x"].tolist() == [[float("inf")]]


@pytest.mark.parametrize("spec, meta", [(("uint8", (), -1), False), (("int", 2, float("nan")), True)])
def test_a_stored_default_the_dtype_cannot_hold_is_named_on_open(tmp_path, spec, meta):
    """The seed creates such a folder (and fails at its first store); opening it (a data field)
    or storing into it (a meta field) raised numpy's OverflowError or ValueError, naming no field."""
    fields, meta_fields = ({"y": "int"}, {"x": spec}) if meta else ({"x": spec, "y": "int"}, None)
    seed.ReplayBuffer(tmp_path / "seed", 2, 3, fields, meta_fields).flush()
    with pytest.raises(ValueError, match=r"field 'x': the stored default .* does not fit: (values in|non-finite)"):
        with replaybuf.ReplayBuffer.from_folder(tmp_path / "seed") as ours:
            ours.store_episode(y=[1])
    if meta:  # the stored meta (zeros) stays readable
        assert replaybuf.ReplayBuffer.from_folder(tmp_path / "seed", read_only=True).num_episodes == 0


@pytest.mark.parametrize("spec", [("bool", (), 2), ("int", (), 2.5), ("float", 2, float("inf")), ("float", (), -0.0)])
def test_defaults_the_seed_stores_are_stored_alike(tmp_path, spec):
    args = dict(max_episodes=2, max_timesteps=2, fields={"x": spec, "y": "int"})
    buffers = seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)
    for buffer in buffers:
        buffer.store(y=1)
        buffer.advance_episode()
    assert_same(buffers[1].get_all_data(), buffers[0].get_all_data(), "defaults")
    buffers[1].close()
    assert os.path.isdir(buffers[1].folder)


# meta_data[name][...] = ... into the feature axes, and 0-d tensors as indices

META_ARGS = dict(max_episodes=4, max_timesteps=2, fields={"a": "int"}, meta_fields={"s": ("float", 2), "k": "int"})


@pytest.fixture
def meta_pair(tmp_path):
    """The seed's buffer and ours with three episodes of distinct meta."""
    buffers = seed.ReplayBuffer(tmp_path / "seed", **META_ARGS), replaybuf.ReplayBuffer(tmp_path / "ours", **META_ARGS)
    for buffer in buffers:
        for e in range(3):
            buffer.store_episode(a=[e], s=[e, 10 * e], k=e)
    yield buffers
    buffers[1].close()


@pytest.mark.parametrize(
    "assign",
    [
        lambda m: m["s"].__setitem__((slice(None), 0), 1.5),
        lambda m: m["s"].__setitem__((Ellipsis, 1), [5, 6, 7, 8]),
        lambda m: m["s"].__setitem__(([0, 2], 1), torch.tensor([9.0, 8.0])),
        lambda m: m["s"].__setitem__((1, slice(None)), np.array([3.0, 4.0])),
        lambda m: m["s"].__setitem__((slice(0, 2), slice(None, 1)), [[7.0], [6.0]]),
        lambda m: m["k"].__setitem__(Ellipsis, 4),
    ],
    ids=["[:, 0]", "[..., 1]", "[[0, 2], 1]", "[1, :]", "[:2, :1]", "k[...]"],
)
def test_meta_data_assignment_into_the_feature_axes_matches_the_seed(meta_pair, assign):
    """``meta_data['s'][:, 0] = x`` raised 'too many indices' (only episode-axis keys were taken)."""
    theirs, ours = meta_pair
    for buffer in (theirs, ours):
        assign(buffer.meta_data)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    ours.close()
    reopened = replaybuf.ReplayBuffer.from_folder(ours.folder, read_only=True)
    assert_same(reopened.get_all_data(), theirs.get_all_data(), "reopened")


@pytest.mark.parametrize(
    "assign, match",
    [
        (lambda m: m["s"].__setitem__((slice(None), 5), 1.0), r"meta_data\['s'\].*index 5 is out of bounds"),
        (lambda m: m["s"].__setitem__((slice(None), 0), [1.0, 2.0]), r"could not broadcast .* \(meta shape \(4, 2\)\)"),
        (lambda m: m["k"].__setitem__((slice(None), 0), 1), r"meta_data\['k'\].*too many indices"),
        (lambda m: m["k"].__setitem__((Ellipsis,), 2**40), "field 'k': values in .* do not fit dtype int32"),
        (lambda m: m["s"].__setitem__((0, 0), "x"), "field 's': expected numbers"),
    ],
)
def test_meta_data_assignment_into_the_feature_axes_refuses_bad_input_and_changes_nothing(meta_pair, assign, match):
    _, ours = meta_pair
    before = ours.get_all_data()
    with pytest.raises((ValueError, TypeError), match=match):
        assign(ours.meta_data)
    assert_same(ours.get_all_data(), before, "after a refused assignment")


def test_meta_data_assignment_into_the_feature_axes_keeps_the_staged_meta(meta_pair):
    """An episode in progress keeps its staged meta in the items the key does not reach."""
    _, ours = meta_pair
    with ours.one_episode(s=[5.0, 6.0]):
        ours.store(a=1)
        ours.meta_data["s"][:, 0] = -1.0
        assert ours.meta_data["s"][3].tolist() == [0.0, 0.0]  # readers see committed episodes only
    assert ours.get_all_data()["s"].tolist() == [[-1.0, 0.0], [-1.0, 10.0], [-1.0, 20.0], [-1.0, 6.0]]


@pytest.mark.parametrize("index", [torch.tensor(1), np.array(1), np.int16(1)], ids=["tensor", "0-d array", "int16"])
def test_0d_integer_indices_write_where_the_seed_writes(meta_pair, index):
    """The seed indexes with a 0-d integer tensor; it was refused here as 'out of range'."""
    theirs, ours = meta_pair
    for buffer in (theirs, ours):
        buffer.store_datapoint(index, index - 1, "a", 7)
        buffer.store_meta_datapoint(index, "k", 9)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")


@pytest.mark.parametrize("index", [torch.tensor(True), np.True_, torch.tensor(1.0), torch.tensor([1]), 1.0])
def test_bool_float_and_1d_indices_stay_refused(meta_pair, index):
    _, ours = meta_pair
    before = ours.get_all_data()
    with pytest.raises(ValueError, match=r"store_datapoint: episode_index must be one int in \[0, 4\), got "):
        ours.store_datapoint(index, 0, "a", 7)
    with pytest.raises(ValueError, match=r"store_meta_datapoint: episode_index must be one int in \[0, 4\)"):
        ours.store_meta_datapoint(index, "k", 7)
    with pytest.raises(ValueError, match=r"store_batch_datapoint: timestep_index 2 out of range - must be in \[0, 2\)"):
        ours.store_batch_datapoint([0, 1], np.array([0, 2]), "a", [5, 6])  # one per episode, each checked
    assert_same(ours.get_all_data(), before, "after refused writes")


def test_store_batch_datapoint_takes_one_timestep_per_episode_as_the_seed(meta_pair):
    """The seed's memmap indexing takes an array of timesteps, one per episode; it raised here."""
    theirs, ours = meta_pair
    for buffer in (theirs, ours):
        buffer.store_batch_datapoint([0, 1], np.array([1, 0]), "a", [5, 6])
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    before = ours.get_all_data()
    with pytest.raises(
        ValueError, match=r"timestep_index must be one int, or one int per episode \(2\), got int64 \[3\]"
    ):
        ours.store_batch_datapoint([0, 1], np.array([0, 1, 1]), "a", [5, 6])
    with pytest.raises(ValueError, match=r"one int per episode \(2\), got float64"):
        ours.store_batch_datapoint([0, 1], np.array([0.0, 1.0]), "a", [5, 6])
    assert_same(ours.get_all_data(), before, "after refused writes")


# the seed's argument names and positions


def test_concat_takes_the_seeds_folders_keyword(meta_pair):
    """``ConcatReplayBuffer(folders=[...])``, the seed's keyword, raised a TypeError."""
    theirs, ours = meta_pair
    ours.close()
    concat_theirs = seed.ConcatReplayBuffer(folders=[theirs.folder])
    concat_ours = replaybuf.ConcatReplayBuffer(folders=[ours.folder])
    assert_same(concat_ours.get_all_data(), concat_theirs.get_all_data(), "get_all_data")
    for bad in (dict(), dict(buffers=[ours.folder], folders=[ours.folder])):
        with pytest.raises(TypeError, match="buffers \\(or folders, the seed's name\\): one of them"):
            replaybuf.ConcatReplayBuffer(**bad)


# helpers of the seed's own methods, without an underscore but undocumented: not offered here
SEED_HELPERS = {"field_kind", "field_shape", "per_group", "meta_values"}


def public_calls(cls) -> list[str]:
    return [
        n
        for n in dir(cls)
        if (not n.startswith("_") or n == "__init__") and n not in SEED_HELPERS and callable(getattr(cls, n))
    ]


SEED_CLASSES = [
    name
    for name in (
        "ReplayBuffer",
        "ReplayBufferH5PY",
        "ConcatReplayBuffer",
        "EpisodeCollector",
        "ReplayDatasetTrajectory",
        "ReplayDatasetTimestep",
        "ReplayDatasetNStep",
        "ReplayDatasetTimeWindow",
    )
    if hasattr(seed, name)  # the seed defines ReplayBufferH5PY only where h5py imports
]


@pytest.mark.parametrize("name", SEED_CLASSES)
def test_every_seed_call_takes_the_seeds_arguments_in_the_seeds_order(name):
    """Each public method of the seed's classes exists here and takes the seed's positional
    parameters in the same order and every keyword the seed names (or ``**kwargs``)."""
    import inspect

    theirs, ours = getattr(seed, name), getattr(replaybuf, name)
    problems = []
    for call in public_calls(theirs):
        try:
            seed_params = list(inspect.signature(getattr(theirs, call)).parameters.values())
        except (TypeError, ValueError):
            continue
        if ours is replaybuf.ConcatReplayBuffer and call in WRITE_METHODS:
            continue  # an instance's __getattr__ gives them, each raising (test_seed_calls.py)
        if not hasattr(ours, call):
            problems.append(f"{call}: missing")
            continue
        try:
            our_params = list(inspect.signature(getattr(ours, call)).parameters.values())
        except (TypeError, ValueError):  # a call that takes anything (the read-only write calls)
            continue
        positional = [p.name for p in seed_params if p.kind is p.POSITIONAL_OR_KEYWORD]
        ours_positional = [p.name for p in our_params if p.kind is p.POSITIONAL_OR_KEYWORD]
        aliases = {p.name for p in our_params if p.kind is p.KEYWORD_ONLY}  # the seed's name, by keyword
        same_places = len(ours_positional) >= len(positional) and all(
            ours == theirs or theirs in aliases for ours, theirs in zip(ours_positional, positional)
        )
        if not same_places and not any(p.kind is p.VAR_POSITIONAL for p in our_params):
            problems.append(f"{call}: positional {ours_positional}, the seed's {positional}")
        if not any(p.kind is p.VAR_KEYWORD for p in our_params):
            names = {p.name for p in our_params}
            missing = [p.name for p in seed_params if p.kind is not p.VAR_KEYWORD and p.name not in names]
            if missing:
                problems.append(f"{call}: no keyword {missing}")
    assert problems == [], f"{name}: {problems}"


BATCH_ARGS = dict(
    max_episodes=4, max_timesteps=3, fields={"x": ("float", 3), "y": ("int", (2, 3))}, meta_fields={"m": ("float", 3)}
)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_store_batch_broadcasts_feature_axes_of_size_one_per_episode_as_the_seed(tmp_path, backend):
    """``store_batch(x=(batch, 1))`` for a ``(3,)`` field: the seed's numpy assignment gives each
    episode its own value in every item; it was refused here as a wrong feature shape."""
    theirs = seed.ReplayBuffer(tmp_path / "seed", **BATCH_ARGS)
    ours = replaybuf.ReplayBuffer(tmp_path / "ours", backend=backend, **BATCH_ARGS)
    for buffer in (theirs, ours):
        with buffer.batched_episode(2, m=np.array([[5.0], [6.0]])):
            buffer.store_batch(x=np.array([[1.0], [2.0]]), y=np.array([[[1], [2]], [[3], [4]]]))
            buffer.store_batch(x=torch.tensor([[3.0], [4.0]]), y=np.array([[[5, 6, 7]], [[8, 9, 0]]]))
            buffer.store_meta_batch(m=np.array([[7.0], [8.0]]))
    assert_same(ours.get_all_data(), theirs.get_all_data(), "get_all_data")
    assert ours.get_all_data()["x"][:, 1].tolist() == [[3.0] * 3, [4.0] * 3]
    ours.close()


@pytest.mark.parametrize(
    "value, match",
    [
        (np.ones((2, 2)), r"got shape \(2, 2\)"),  # an axis neither 1 nor the field's
        (np.ones((2, 3, 1)), r"got shape \(2, 3, 1\)"),  # one axis too many
        (np.ones((2, 1, 1)), r"got shape \(2, 1, 1\)"),
    ],
)
def test_store_batch_refuses_feature_axes_that_do_not_broadcast_and_changes_nothing(tmp_path, value, match):
    ours = replaybuf.ReplayBuffer(tmp_path / "ours", **BATCH_ARGS)
    with ours.batched_episode(2):
        ours.store_batch(x=np.ones((2, 3)))
        with pytest.raises(ValueError, match=match):
            ours.store_batch(x=value)
        assert ours.timestep_index == 1
    assert ours.get_all_data()["episode_lens"].tolist() == [1, 1]
    ours.close()
