"""Differential tests over field specs: memmap-replay-buffer 0.2.3 and replaybuf built with the
same ``fields`` / ``meta_fields`` and driven by the same calls.

test_differential.py drives every write call on one fixed schema; here the schema varies: every
spec form the seed takes (``'int'``, ``('float', 2)``, ``('uint8', (2, 3))``, ``(kind, shape,
default)``; shapes (), (1,), an int, several axes), one to four fields, meta fields of every
kind, names the loaders' own outputs shadow (a meta field ``_lens`` or ``_mask``, fields
``f0`` and ``next_f0``), and values in the forms users pass (exact arrays, other dtypes, tensors,
lists, bool arrays into numeric fields, Python scalars). What a user sees is compared: which
calls raise, ``get_all_data`` (with a selection), ``data[...]`` / ``meta_data[...]`` reads, the
trajectory, window, timestep and n-step loaders with their options (``return_mask``,
``to_named_tuple``, ``fieldname_map``, ``filter_fields``, ``filter_meta``), the container
types, dtypes and shapes, and the seed's folder reopened by replaybuf. It runs for
``ReplayBuffer`` (zarr and memmap) and ``ReplayBufferH5PY``; the deliberate differences of
README.md ("Differences from memmap-replay-buffer") are kept out of the drawn calls or accounted
for where marked ``# difference:``.

Then the spec forms at construction (which the seed takes and which replaybuf takes, the
differences being the listed ones), and the cases this comparison found.
"""

from __future__ import annotations

import os

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replaybuf

from ._backends import require
from ._compare import assert_same
from .test_parity_hostile import outcome

KINDS = {"int": np.int32, "float": np.float32, "bool": np.bool_, "uint8": np.uint8}
SHAPES = [(), (1,), 1, 2, (2,), (2, 3)]
DEFAULTS = {"int": [-2, 3, 1.5, True], "float": [0.5, 1, -1.0, True], "bool": [True, False, 1], "uint8": [7, 255, True]}
# meta names the loaders' own outputs shadow: the batch holds the one the seed's holds
META_NAMES = ["m0", "m1", "_lens", "_mask", "n_step_lens", "next_f0", "seq_f0"]
VARIANTS = ["zarr", "memmap", "h5py"]


def as_shape(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


@st.composite
def specs(draw) -> tuple[str, tuple[int, ...], object]:
    """(kind, shape, spec as a user writes it)."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    form = draw(st.sampled_from(["str", "pair", "default"]))
    if form == "str":
        return kind, (), kind
    shape = draw(st.sampled_from(SHAPES))
    if form == "pair":
        return kind, as_shape(shape), (kind, shape)
    return kind, as_shape(shape), (kind, shape, draw(st.sampled_from(DEFAULTS[kind])))


@st.composite
def schemas(draw):
    fields = {f"f{i}": draw(specs()) for i in range(draw(st.integers(1, 3)))}
    if draw(st.booleans()):  # a field named like the n-step loader's next_ output of another
        fields["next_f0"] = draw(specs())
    fields = dict(draw(st.permutations(list(fields.items()))))  # declaration order varies
    names = draw(st.lists(st.sampled_from([n for n in META_NAMES if n not in fields]), max_size=2, unique=True))
    meta = {n: draw(specs()) for n in names}
    return fields, meta


def user_value(draw, kind: str, shape: tuple[int, ...]):
    """Small exact values of ``kind`` and ``shape`` in one of the forms a user passes."""
    n = int(np.prod(shape))
    if kind == "bool":
        flat = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif kind == "float":
        flat = draw(st.lists(st.sampled_from([0.0, 0.5, -2.25, 3.0, 1.0]), min_size=n, max_size=n))
    else:
        flat = draw(st.lists(st.integers(0 if kind == "uint8" else -5, 9), min_size=n, max_size=n))
    array = np.asarray(flat).reshape(shape)
    form = draw(st.sampled_from(["exact", "numpy", "tensor", "list", "float64", "int64 tensor", "bools", "scalar"]))
    if form == "exact":
        return array.astype(KINDS[kind])
    if form == "tensor":
        return torch.from_numpy(array.astype(KINDS[kind]))
    if form == "list":
        return array.tolist()
    if form == "float64" and kind != "bool":
        return array.astype(np.float64)
    if form == "int64 tensor" and kind in ("int", "uint8"):
        return torch.from_numpy(array.astype(np.int64))
    if form == "bools" and kind != "bool":
        return array != 0  # a bool array into a numeric field
    if form == "scalar" and array.ndim == 0:
        return array.item()
    return array


@st.composite
def scenarios(draw):
    fields, meta = draw(schemas())
    max_timesteps = draw(st.integers(2, 4))
    calls, episodes = [], 0
    while episodes < 3 and (not calls or draw(st.booleans())):  # never more than max_episodes=3
        kind = draw(st.sampled_from(["store_episode", "one_episode", "batched_episode"]))
        length = draw(st.integers(2, max_timesteps))
        if kind == "store_episode":
            given = draw(st.sets(st.sampled_from(sorted(fields)), min_size=1))
            args = {n: user_value(draw, fields[n][0], (length, *fields[n][1])) for n in sorted(given)}
            args |= {n: user_value(draw, k, s) for n, (k, s, _) in meta.items() if draw(st.booleans())}
            episodes += 1
        elif kind == "one_episode":
            rows = [
                {n: user_value(draw, k, s) for n, (k, s, _) in fields.items() if draw(st.booleans())}
                for _ in range(length)
            ]
            args = (rows, {n: user_value(draw, k, s) for n, (k, s, _) in meta.items() if draw(st.booleans())})
            episodes += 1
        else:  # every field given at every step (README: the seed's store_batch reads a batch-wide
            # value differently, and keeps a slot's old rows where a batch is wider than the last)
            batch = draw(st.integers(1, 3 - episodes))
            rows = [{n: user_value(draw, k, (batch, *s)) for n, (k, s, _) in fields.items()} for _ in range(length)]
            args = (batch, rows, {n: user_value(draw, k, (batch, *s)) for n, (k, s, _) in meta.items()})
            episodes += batch
        calls.append((kind, args))
    picks = draw(st.permutations(range(16)))[:4]  # the loader options compared (of loader_options)
    return fields, meta, max_timesteps, calls, picks


def apply(buffer, kind: str, args) -> None:
    if kind == "store_episode":
        buffer.store_episode(**args)
    elif kind == "one_episode":
        rows, meta = args
        with buffer.one_episode(**meta):
            for row in rows:
                buffer.store(**row)
    else:
        batch, rows, meta = args
        with buffer.batched_episode(batch, **meta):
            for row in rows:
                buffer.store_batch(**row)


def loader_options(fields: dict, meta: dict, max_timesteps: int) -> list[dict]:
    names = tuple(fields)
    first = names[0]
    options = [
        dict(),
        dict(return_mask=True),
        dict(return_mask=True, to_named_tuple=(*names, "_mask", "_lens"), fieldname_map={first: "renamed"}),
        dict(return_indices=True, fields=names[-1:]),
        dict(timestep_level=True),
        dict(timestep_level=True, return_indices=True, fieldname_map={first: "x"}),
        dict(n_steps=1),
        dict(n_steps=2, current_fields=names[:1], next_fields=names[-1:], sequence_fields=names),
        dict(n_steps=2, sequence_fields=(first,), fieldname_map={f"seq_{first}": "chunk", f"next_{first}": "later"}),
        dict(dataset_kwargs=dict(window_length=max_timesteps), window=True),  # one window: start 0
    ]
    scalar = [n for n, (kind, shape, _) in fields.items() if shape == ()]
    if scalar:
        value = True if fields[scalar[0]][0] == "bool" else 1
        options += [
            dict(timestep_level=True, filter_fields={scalar[0]: value}),
            dict(n_steps=1, filter_fields={scalar[0]: value}),
        ]
    for name, (kind, shape, _) in meta.items():
        if shape == ():
            options.append(dict(filter_meta={name: False if kind == "bool" else 0}))
    return options


def batches(buffer, options: dict) -> list:
    options = dict(options)
    if options.pop("window", False):
        of_seed = type(buffer).__module__.startswith("memmap_replay_buffer")
        cls = seed.ReplayDatasetTimeWindow if of_seed else replaybuf.ReplayDatasetTimeWindow
        dataset = cls(buffer, **options.pop("dataset_kwargs"))
        return list(buffer.dataloader(2, dataset=dataset))
    return list(buffer.dataloader(2, **options))


def reads(buffer, fields: dict, meta: dict, max_timesteps: int, picks: list[int]) -> dict:
    """What a user reads (the loaders of ``picks``), each as (result, exception)."""
    count = int(buffer.num_episodes)
    out = {
        "get_all_data()": outcome(buffer.get_all_data),
        "get_all_data(selection)": outcome(
            lambda: buffer.get_all_data(fields=tuple(fields)[:1], meta_fields=tuple(meta)[:1])
        ),
    }
    for name in fields:
        # difference: past an episode's length the seed returns whatever the slot holds (here
        # the slots were never used before, so it holds the defaults as replaybuf returns them)
        out[f"data[{name!r}][:n]"] = outcome(lambda n=name: np.asarray(buffer.data[n][:count]))
        out[f"data[{name!r}][0, 1]"] = outcome(lambda n=name: buffer.data[n][0, 1])
    for name in meta:
        out[f"meta_data[{name!r}][:n]"] = outcome(lambda n=name: np.asarray(buffer.meta_data[n][:count]))
    options = loader_options(fields, meta, max_timesteps)
    for chosen in (options[i] for i in picks if i < len(options)):
        out[f"dataloader({chosen})"] = outcome(batches, buffer, chosen)
    return out


def make(variant: str, path, args: dict):
    """(the seed's buffer, replaybuf's) for ``variant``."""
    if variant == "h5py":
        return seed.ReplayBufferH5PY(path / "seed", **args), replaybuf.ReplayBufferH5PY(path / "ours", **args)
    backend = {"backend": "memmap"} if variant == "memmap" else {}
    return seed.ReplayBuffer(path / "seed", **args), replaybuf.ReplayBuffer(path / "ours", **args, **backend)


def compare_reads(ours: dict, theirs: dict, where: str) -> None:
    for key, (result, error) in theirs.items():
        our_result, our_error = ours[key]
        if error is not None and "n_steps is not supported by ReplayBufferH5PY" in str(error):
            continue  # difference: ReplayBufferH5PY supports n-step datasets (the seed refuses them)
        if error is None and isinstance(our_error, ValueError) and len(result) == 0:
            continue  # difference: a loader that would be empty raises here
        assert (error is None) == (our_error is None), f"{where} {key}: seed {error!r}, replaybuf {our_error!r}"
        if error is None:
            assert_same(our_result, result, f"{where} {key}")


@settings(
    max_examples=int(os.environ.get("REPLAYBUF_DIFF_EXAMPLES", 12)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(scenario=scenarios(), variant=st.sampled_from(VARIANTS))
def test_varied_field_specs_store_and_read_as_the_seed(tmp_path_factory, scenario, variant):
    if variant == "h5py":
        require("h5py")
    fields, meta, max_timesteps, calls, picks = scenario
    root = tmp_path_factory.mktemp("schemas")
    args = dict(
        max_episodes=3,
        max_timesteps=max_timesteps,
        fields={n: spec for n, (_, _, spec) in fields.items()},
        meta_fields={n: spec for n, (_, _, spec) in meta.items()},
    )
    theirs, ours = make(variant, root, args)
    try:
        for kind, call_args in calls:
            (_, seed_error), (_, our_error) = (
                outcome(apply, theirs, kind, call_args),
                outcome(apply, ours, kind, call_args),
            )
            assert (seed_error is None) == (our_error is None), f"{kind}: seed {seed_error!r}, replaybuf {our_error!r}"
            if seed_error is not None:
                break
        assert (ours.num_episodes, ours.episode_index) == (theirs.num_episodes, theirs.episode_index)
        expected = reads(theirs, fields, meta, max_timesteps, picks)
        compare_reads(reads(ours, fields, meta, max_timesteps, picks), expected, variant)
        if variant != "h5py":  # the seed's folder, opened by replaybuf
            theirs.flush()
            with replaybuf.ReplayBuffer.from_folder(root / "seed", read_only=True) as reopened:
                compare_reads(
                    reads(reopened, fields, meta, max_timesteps, picks), expected, "the seed's folder reopened"
                )
    finally:
        ours.close()


# spec forms at construction


BOTH = [
    "float",
    "int",
    "bool",
    "uint8",
    ("float", ()),
    ("float", (1,)),
    ("float", 1),
    ("int", 3),
    ("uint8", (3, 8, 8)),
    ("float", (2,), 0.5),
    ("int", (), 7),
    ("int", (), 1.5),
    ("bool", (), 1),
    ("uint8", (), True),
    ("float", (), float("inf")),
    ("float", (), np.float64(0.5)),
]
NEITHER = [np.uint8, np.float32, torch.float32, "complex64", "str", "object", None, 3, ("float",), ("float", 2, 0.0, 1)]
NEITHER += [("float", (), "1"), ("float", -1)]
# difference: replaybuf takes more spec forms (README "Field specs"): any numeric numpy dtype
# name, a list shape, numpy ints as sizes and defaults, a dict spec
OURS_ONLY = ["float32", "float16", "int64", "f4", ("float", [2]), ("int", np.int64(2)), ("float", (), np.float32(0.5))]
OURS_ONLY += [["float", 2], {"dtype": "float", "shape": 2}, ("float", (), None)]
# difference: refused here, named (README: a default the dtype cannot hold, a 0 dimension)
SEED_ONLY = [("uint8", (), -1), ("float", 0), ("float", (2, 0))]


@pytest.mark.parametrize("meta", [False, True], ids=["field", "meta field"])
@pytest.mark.parametrize(
    "spec, seed_takes, ours_takes",
    [(s, True, True) for s in BOTH]
    + [(s, False, False) for s in NEITHER]
    + [(s, False, True) for s in OURS_ONLY]
    + [(s, True, False) for s in SEED_ONLY],
    ids=repr,
)
def test_spec_forms_are_taken_or_refused_as_the_seed(tmp_path, spec, seed_takes, ours_takes, meta):
    """Which specs each library takes; a refusal here is a TypeError / ValueError naming the field."""
    fields, meta_fields = ({"y": "int"}, {"x": spec}) if meta else ({"x": spec}, None)
    for lib, taken in ((seed, seed_takes), (replaybuf, ours_takes)):
        _, error = outcome(lambda lib=lib: lib.ReplayBuffer(tmp_path / lib.__name__, 2, 3, fields, meta_fields))
        assert (error is None) == taken, f"{lib.__name__}: {error!r}"
    if not ours_takes:
        assert isinstance(error, (TypeError, ValueError)) and "'x'" in str(error), repr(error)
        assert not (tmp_path / "replaybuf").exists()


@pytest.mark.parametrize("shape", [-1, (2, -3)])
def test_a_negative_shape_raises_what_the_seed_raises(tmp_path, shape):
    """The seed's numpy raises ValueError; here it was a TypeError only (except ValueError missed it)."""
    _, theirs = outcome(lambda: seed.ReplayBuffer(tmp_path / "seed", 2, 3, {"x": ("float", shape)}))
    with pytest.raises(type(theirs), match="field 'x': shape must be a positive int") as ours:
        replaybuf.ReplayBuffer(tmp_path / "ours", 2, 3, {"x": ("float", shape)})
    assert isinstance(ours.value, TypeError)  # as every malformed spec here
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("name", ["episode_lens", "_generation", "_revision", "_meta_sum"])
def test_the_buffers_own_names_are_refused_as_meta_fields_naming_them(tmp_path, name):
    """difference: the seed takes them (a meta field ``episode_lens`` becomes its lengths)."""
    seed.ReplayBuffer(tmp_path / "seed", 2, 3, {"x": "int"}, {name: "int"})
    with pytest.raises(ValueError, match=rf"field names \['{name}'\] are reserved .* name the field otherwise"):
        replaybuf.ReplayBuffer(tmp_path / "ours", 2, 3, {"x": "int"}, {name: "int"})
    assert not (tmp_path / "ours").exists()


# the cases the comparison found


@pytest.mark.parametrize("order", [("x", "next_x"), ("next_x", "x")], ids=["x first", "next_x first"])
@pytest.mark.parametrize(
    "options",
    [
        dict(n_steps=1),
        dict(n_steps=2, current_fields=("next_x",), next_fields=("x",)),
        dict(n_steps=1, to_named_tuple=("x", "next_x", "next_next_x", "n_step_lens")),
    ],
)
def test_a_field_named_next_of_another_is_returned_as_the_seed_returns_it(tmp_path, order, options):
    """With fields ``x`` and ``next_x`` an n-step batch's ``next_x`` is ``x`` n steps on, as the
    seed's (its next_ outputs are written after the current ones); here it was the stored
    ``next_x`` when ``x`` was declared first, so the batch depended on the declaration order."""
    fields = {name: "float" for name in order}
    buffers = [lib.ReplayBuffer(tmp_path / lib.__name__, 2, 3, fields) for lib in (seed, replaybuf)]
    for buffer in buffers:
        buffer.store_episode(x=np.arange(3.0), next_x=np.arange(3.0) + 10)
    theirs, ours = (list(b.dataloader(2, **options)) for b in buffers)
    assert_same(ours, theirs, f"dataloader({options})")
    buffers[1].close()


def test_a_meta_field_named_mask_is_replaced_by_the_loaders_mask_as_in_the_seed(tmp_path):
    """``return_mask=True`` raised "fieldname_map: ['_mask'] would be overwritten" for a meta field
    named ``_mask`` and no fieldname_map; the seed's batch holds its own ``_mask``, as for
    ``_lens``. A fieldname_map onto ``_mask`` is still refused."""
    args = dict(max_episodes=2, max_timesteps=3, fields={"x": "float"}, meta_fields={"_mask": "float", "_lens": "int"})
    buffers = [lib.ReplayBuffer(tmp_path / lib.__name__, **args) for lib in (seed, replaybuf)]
    for buffer in buffers:
        buffer.store_episode(x=np.arange(3.0), _mask=4.0, _lens=9)
        buffer.store_episode(x=np.arange(2.0), _mask=5.0, _lens=8)
    for options in (dict(return_mask=True), dict(return_mask=True, to_named_tuple=("x", "_mask", "_lens"))):
        theirs, ours = (list(b.dataloader(2, **options)) for b in buffers)
        assert_same(ours, theirs, f"dataloader({options})")
    with pytest.raises(ValueError, match=r"fieldname_map: 'x' and '_mask' would both be returned as '_mask'"):
        buffers[1].dataloader(2, return_mask=True, fieldname_map={"x": "_mask"})
    with pytest.raises(ValueError, match=r"fieldname_map: \['_mask'\] would be overwritten"):
        buffers[1].dataloader(2, return_mask=True, fieldname_map={"x": "_mask", "_mask": "m"})
    buffers[1].close()


@pytest.mark.parametrize(
    "spec, key, value",
    [
        (("uint8", (2, 2)), 0, [1, 2]),
        (("bool", 2), 0, [1]),
        (("float", 2), slice(None), np.array([[1.0], [2.0], [3.0]])),
        (("float", (2, 2)), [0, 2], np.array([1.0, 2.0])),
        (("float", (2, 2)), np.array([True, False, True]), torch.tensor([[1.0], [2.0]])),
        (("int", ()), 1, 4),
    ],
    ids=["row into (2, 2)", "[1] into (2,)", "(3, 1) into 3 rows", "row into 2 of (2, 2)", "mask", "scalar"],
)
def test_meta_data_assignment_broadcasts_by_numpys_rules_as_the_seed(tmp_path, spec, key, value):
    """``meta_data['m'][0] = [1, 2]`` for a (2, 2) meta field: the seed's memmap broadcasts it
    into each row; here it was refused ('got shape (2,) ... expected feature shape (2, 2)')."""
    args = dict(max_episodes=3, max_timesteps=2, fields={"x": "int"}, meta_fields={"m": spec})
    buffers = [lib.ReplayBuffer(tmp_path / lib.__name__, **args) for lib in (seed, replaybuf)]
    for buffer in buffers:
        for e in range(3):
            buffer.store_episode(x=[e])
        buffer.meta_data["m"][key] = value
    assert_same(buffers[1].get_all_data(), buffers[0].get_all_data(), "get_all_data")
    buffers[1].close()
    reopened = replaybuf.ReplayBuffer.from_folder(buffers[1].folder, read_only=True)
    assert_same(reopened.get_all_data(), buffers[0].get_all_data(), "reopened")


def test_meta_data_assignment_still_refuses_what_does_not_broadcast_and_changes_nothing(tmp_path):
    ours = replaybuf.ReplayBuffer(tmp_path, 3, 2, {"x": "int"}, {"m": ("float", 2), "k": "uint8"})
    ours.store_episode(x=[1], m=[1.0, 2.0])
    before = ours.get_all_data()
    with pytest.raises(ValueError, match=r"meta_data\['m'\]\[0\]: value of shape \(3,\) does not fit 1 episode"):
        ours.meta_data["m"][0] = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"field 'k': values in \[300, 300\] do not fit dtype uint8"):
        ours.meta_data["k"][:] = [300]
    assert_same(ours.get_all_data(), before, "after refused assignments")
    ours.close()


def test_none_into_a_float_field_is_refused_naming_it_where_the_seed_stores_nan(tmp_path):
    """difference (README): the seed stores NaN; ``store(x=None)`` stores the default in both."""
    args = dict(max_episodes=2, max_timesteps=2, fields={"x": ("float", (), 0.5)}, meta_fields={"s": "float"})
    theirs, ours = seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)
    for buffer in (theirs, ours):
        with buffer.one_episode():
            buffer.store(x=None)
    assert_same(ours.get_all_data(), theirs.get_all_data(), "store(x=None)")
    with pytest.raises(TypeError, match=r"field 's': expected numbers or bools, got dtype object \(NoneType\)"):
        with ours.one_episode(s=None):
            ours.store(x=1.0)
    ours.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_data_reads_past_an_episodes_length_give_the_default_as_the_seed(tmp_path, variant):
    """``buffer.data['x'][slot]`` past the episode's length gave zeros on memmap and hdf5 (what
    they store there) where the seed's slot, zarr, ``get_all_data`` and the datasets give the
    field's default; also for a slot reused by a shorter episode, and read-only."""
    if variant == "h5py":
        require("h5py")
    args = dict(
        max_episodes=2, max_timesteps=3, fields={"x": ("float", 2, 0.5), "b": ("bool", (), True)}, circular=True
    )
    theirs, ours = make(variant, tmp_path, args)
    for buffer in (theirs, ours):
        buffer.store_episode(x=np.ones((3, 2)), b=[False] * 3)
        buffer.store_episode(x=np.ones((1, 2)))
        buffer.store_episode(x=np.full((2, 2), 2.0), b=[False] * 2)  # slot 0 again, shorter
    keys = [np.s_[:], np.s_[0], np.s_[1, 1:], np.s_[:, 2], np.s_[[0, 1], -1], np.s_[..., 0]]
    for name in ("x", "b"):
        for key in keys:
            assert_same(ours.data[name][key], theirs.data[name][key], f"data[{name!r}][{key}]")
    ours.close()
    theirs.flush()
    with replaybuf.ReplayBuffer.from_folder(ours.folder, read_only=True) as reopened:
        for key in keys:
            assert_same(reopened.data["x"][key], theirs.data["x"][key], f"read-only data['x'][{key}]")


def test_a_sequence_into_one_bool_item_is_refused_naming_the_shapes(tmp_path):
    """difference (README): the seed's memmap stores a list's truth value, True for [0, 0]."""
    theirs = seed.ReplayBuffer(tmp_path / "seed", 2, 2, {"x": "bool"}, {"m": "bool"})
    theirs.store_episode(x=[False, False], m=False)
    theirs.data["x"][0, 1] = [0, 0]
    theirs.meta_data["m"][0] = [0, 0]
    assert theirs.data["x"][0].tolist() == [False, True] and bool(theirs.meta_data["m"][0])
    ours = replaybuf.ReplayBuffer(tmp_path / "ours", 2, 2, {"x": "bool", "y": ("float", 2)}, {"m": "bool"})
    ours.store_episode(x=[False, False], m=False)
    before = ours.get_all_data()
    match = r"data\['x'\]\[\(0, 1\)\] = value of shape \(2,\): .* broadcasts to the selection's shape \(\)"
    with pytest.raises(ValueError, match=match):
        ours.data["x"][0, 1] = [0, 0]
    with pytest.raises(ValueError, match=r"data\['y'\]\[0\] = value of shape \(3, 2\): .* selection's shape \(2, 2\)"):
        ours.data["y"][0] = np.ones((3, 2))
    with pytest.raises(ValueError, match=r"meta_data\['m'\]\[0\]: value of shape \(2,\) does not fit 1 episode"):
        ours.meta_data["m"][0] = [0, 0]
    assert_same(ours.get_all_data(), before, "after refused assignments")
    ours.close()


def test_filters_compare_values_of_the_fields_shape_and_dtype(tmp_path):
    """difference (README): the seed's filter matches nothing for a list (a vector meta field),
    raises for a (1,) field, and compares 259 as 3 in a uint8 field."""
    args = dict(
        max_episodes=3, max_timesteps=3, fields={"u": "uint8", "i1": ("int", (1,))}, meta_fields={"mv": ("int", 2)}
    )
    theirs, ours = seed.ReplayBuffer(tmp_path / "seed", **args), replaybuf.ReplayBuffer(tmp_path / "ours", **args)
    for buffer in (theirs, ours):
        buffer.store_episode(u=[1, 3, 3], i1=[[1], [2], [1]], mv=[1, 2])
        buffer.store_episode(u=[3], i1=[[0]], mv=[2, 2])
    assert len(theirs.dataset(filter_meta={"mv": [1, 2]})) == 0
    assert ours.dataset(filter_meta={"mv": [1, 2]}, return_indices=True)[0]["_index"].item() == 0
    with pytest.raises(ValueError, match="only supports scalar fields"):
        theirs.dataset(timestep_level=True, filter_fields={"i1": 1})
    assert len(ours.dataset(timestep_level=True, filter_fields={"i1": 1})) == 2
    assert len(theirs.dataset(timestep_level=True, filter_fields={"u": 259})) == 3
    with pytest.raises(ValueError, match=r"filter_fields \{'u': 259\} matches no timestep"):
        ours.dataset(timestep_level=True, filter_fields={"u": 259})
    ours.close()
