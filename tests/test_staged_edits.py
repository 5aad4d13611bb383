"""Edits of an episode in progress are logged as its steps are: a writer SIGKILLed after an
``update``, ``data[...] = ...``, ``store_datapoint`` or meta edit of its episode in progress
leaves a step log whose replay holds exactly what the user last wrote, not the values the edit
replaced. A rejected edit leaves the log as it was, an episode rolled back leaves nothing to
replay, and a damaged edit record is handled as a damaged step record is.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.schema import Schema
from replaybuf.staging import _EDIT_PART, _RECORD, EDIT, StepLog

from ._backends import make_place

FORK = multiprocessing.get_context("fork")
STEPS = 10
KWARGS = dict(
    max_episodes=4,
    max_timesteps=16,
    fields={
        "obs": {"dtype": "float32", "shape": [3], "chunks": 4},
        "r": {"dtype": "float32", "shape": [], "chunks": 4},
        "img": {"dtype": "uint8", "shape": [2, 2], "chunks": 4},
    },
    meta_fields={"uid": "int", "score": "float"},
    circular=False,
)
# obs spans are 4 steps (steps 0..7 of an episode of 10 leave RAM, 8 and 9 stay staged), r and
# img spans 12 (all staged): each edit below reaches steps of both kinds
SPAN_BYTES = 48


def step(t: int) -> dict[str, np.ndarray]:
    return {
        "obs": np.full(3, t, np.float32) + np.arange(3, dtype=np.float32) / 4,
        "r": np.float32(t),
        "img": np.full((2, 2), t, np.uint8),
    }


def edit(buffer: ReplayBuffer, how: str) -> None:
    """Edit the episode in progress (slot 0) as ``how`` says, steps that left RAM and staged ones."""
    if how == "update":  # data and meta in one call
        buffer.update(0, obs=np.full((STEPS, 3), -1, np.float32), r=np.full(3, -2, np.float32), score=2.5)
    elif how == "setitem":
        buffer.data["obs"][0, 1] = -1
        buffer.data["obs"][0, 9, 2] = -2
        buffer.data["img"][0, 2:9] = 7
    elif how == "datapoint":
        buffer.store_datapoint(0, 1, "r", -1.0)
        buffer.store_datapoint(0, 9, "img", np.full((2, 2), 9, np.uint8))
        buffer.store_batch_datapoint([0], 5, "obs", [[-5, -5, -5]])
    elif how == "meta":
        buffer.store_meta_datapoint(0, "uid", 99)
        buffer.store_meta_batch(score=4.0)
    elif how == "cut":  # steps cut back, nothing stored since: the replay ends there too
        buffer.timestep_index = 4
    elif how == "rewind":  # an edit of a step stored again after a rewind, then of its new value
        buffer.timestep_index = 6
        buffer.data["obs"][0, 5] = -3
        for t in range(6, 8):
            buffer.store(**step(100 + t))
        buffer.store_datapoint(0, 7, "r", -7.0)
    else:
        raise AssertionError(how)


def write(location: str, backend: str, how: str, flush_every_store_step: int, kill: bool) -> None:
    """Store STEPS steps into a new episode, edit it, then SIGKILL this process (``kill``) or
    end the episode."""
    from replaybuf import staging

    staging.WRITE_SPAN_BYTES = SPAN_BYTES
    buffer = ReplayBuffer(
        location, **KWARGS, backend=backend, flush_every_store_step=flush_every_store_step, overwrite=False
    )
    buffer.store_meta_batch(uid=7)
    for t in range(STEPS):
        buffer.store(**step(t))
    edit(buffer, how)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    buffer.advance_episode()
    buffer.close()


def run_child(target, *args, exitcode: int = -signal.SIGKILL) -> None:
    """Run ``target(*args)`` in a forked child (which sets its own write spans); by default it
    must have been SIGKILLed."""
    child = FORK.Process(target=target, args=args)
    child.start()
    child.join(60)
    assert child.exitcode == exitcode


def episode_in_slot(buffer: ReplayBuffer, slot: int = 0) -> dict[str, np.ndarray]:
    length = int(buffer.episode_lens[slot])
    out = {name: np.asarray(buffer.data[name][slot, :length]) for name in buffer.fieldnames}
    return out | {name: np.asarray(buffer.meta_data[name][slot]) for name in ("uid", "score", "episode_lens")}


def written(tmp_path, backend: str, how: str, flush_every_store_step: int, kill: bool) -> dict[str, np.ndarray]:
    location = str(tmp_path / f"{how}-{kill}")
    ReplayBuffer(location, **KWARGS, backend=backend).close()
    run_child(write, location, backend, how, flush_every_store_step, kill, exitcode=-signal.SIGKILL if kill else 0)
    with ReplayBuffer(location, **KWARGS, backend=backend, overwrite=False) as buffer:  # replays the log
        assert buffer.storage.log_names() == []
        return episode_in_slot(buffer)


def assert_same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name, values in expected.items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)


@pytest.mark.parametrize("how", ["update", "setitem", "datapoint", "meta", "cut", "rewind"])
@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_killed_writer_keeps_the_edits_of_its_episode_in_progress(tmp_path, backend, how):
    """The episode replayed after the kill equals the one the writer would have committed:
    before, its steps held the values the edits had replaced (steps that left RAM too)."""
    committed = written(tmp_path, backend, how, 1, kill=False)
    # the edits changed what the steps hold: a replay without them is told apart
    stored = [*range(6), 106, 107] if how == "rewind" else range(STEPS)
    unedited = {n: np.stack([step(t)[n] for t in stored]) for n in step(0)} | {"uid": 7, "score": 0.0}
    assert any(not np.array_equal(committed[n], values) for n, values in unedited.items())
    assert_same(written(tmp_path, backend, how, 1, kill=True), committed)


@pytest.mark.parametrize("flush_every_store_step", [4, 3])
def test_an_edit_is_written_at_once_with_the_steps_pending_before_it(tmp_path, flush_every_store_step):
    """With N > 1 the log is written every N steps, and at each edit (steps pending included):
    after 10 steps (log writes at 4 and 8, or 3, 6 and 9) and an edit, all 10 edited steps are
    replayed; an edit is never less durable than a step."""
    committed = written(tmp_path, "zarr", "update", flush_every_store_step, kill=False)
    assert_same(written(tmp_path, "zarr", "update", flush_every_store_step, kill=True), committed)
    assert int(committed["episode_lens"]) == STEPS


def test_nothing_is_logged_without_a_step_log(tmp_path):
    """``flush_every_store_step=0``: a killed writer loses the episode in progress, edits too."""
    location = str(tmp_path / "b")
    ReplayBuffer(location, **KWARGS).close()
    run_child(write, location, "zarr", "update", 0, True)
    with ReplayBuffer(location, **KWARGS, overwrite=False) as buffer:
        assert len(buffer) == 0 and buffer.storage.log_names() == []


def test_an_object_store_keeps_the_edit_in_a_log_segment_of_its_own(tmp_path):
    """On an object store each log write is a segment object: the edit's comes after the steps'
    and within what recovery reads of one segment (``StepLog.segment_bound``)."""
    location = make_place("memory", tmp_path).location
    buffer = ReplayBuffer(location, **KWARGS)
    buffer.store_meta_batch(uid=3)
    for t in range(STEPS):
        buffer.store(**step(t))
    buffer.update(0, obs=np.full((STEPS, 3), -1, np.float32), score=2.0)
    segments = [buffer.storage.read_blob(key) for key in buffer.storage.list_blobs("replaybuf/steplog/episode/")]
    edit_at = _RECORD.size + int.from_bytes(segments[-1][1:5], "little")  # after the meta record
    assert len(segments) == STEPS + 1 and segments[-1][:1] == b"m" and segments[-1][edit_at : edit_at + 1] == EDIT
    assert max(map(len, segments)) <= buffer._commit.step_log.segment_bound(4, 16)
    buffer.storage.release_writer()  # as a killed writer: its lease gone, its log left
    with ReplayBuffer.from_folder(location) as reopened:
        got = episode_in_slot(reopened)
    assert (got["obs"] == -1).all() and (int(got["episode_lens"]), int(got["uid"]), float(got["score"])) == (10, 3, 2)


def write_batch(location: str, kill: bool) -> None:
    """A group of 3 episodes in lockstep (slots 0..2), two of them edited, then SIGKILLed or ended."""
    from replaybuf import staging

    staging.WRITE_SPAN_BYTES = SPAN_BYTES
    buffer = ReplayBuffer(location, **KWARGS, overwrite=False)
    buffer.store_meta_batch(uid=[1, 2, 3])
    for t in range(STEPS):
        buffer.store_batch(**{n: np.stack([v + k for k in range(3)]).astype(v.dtype) for n, v in step(t).items()})
    buffer.update([2, 1], r=np.stack([np.full(STEPS, -2), np.full(STEPS, -1)]).astype(np.float32), score=[2, 1])
    buffer.store_batch_datapoint([0, 2], 9, "img", np.full((2, 2), 200, np.uint8))
    buffer.data["obs"][1:, 3] = -3
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    buffer.advance_episode(3)
    buffer.close()


def test_a_killed_writer_keeps_the_edits_of_each_episode_of_a_batched_group(tmp_path):
    """Edits name episodes of a group by slot, in any order: each reaches its own row."""
    found = {}
    for kill in (False, True):
        location = str(tmp_path / f"batch-{kill}")
        ReplayBuffer(location, **KWARGS).close()
        run_child(write_batch, location, kill, exitcode=-signal.SIGKILL if kill else 0)
        with ReplayBuffer(location, **KWARGS, overwrite=False) as buffer:
            found[kill] = [episode_in_slot(buffer, slot) for slot in range(3)]
    assert [float(e["r"][0]) for e in found[False]] == [0, -1, -2]
    assert [float(e["score"]) for e in found[False]] == [0, 1, 2]
    for got, expected in zip(found[True], found[False]):
        assert_same(got, expected)


def meta_edited_before_any_step(location: str) -> None:
    buffer = ReplayBuffer(location, **KWARGS, overwrite=False)
    buffer.store_meta_batch(uid=7)  # starts the group (and its log header, not yet written)
    buffer.store_meta_datapoint(0, "score", 1.5)
    buffer.store(**step(0))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_meta_edit_before_the_first_step_is_replayed(tmp_path):
    """Meta values edited before any step wait for the first step's log write, and are replayed:
    the log's header had been made when the group started, without them."""
    location = str(tmp_path / "b")
    ReplayBuffer(location, **KWARGS).close()
    run_child(meta_edited_before_any_step, location)
    with ReplayBuffer(location, **KWARGS, overwrite=False) as buffer:
        got = episode_in_slot(buffer)
    assert (int(got["episode_lens"]), int(got["uid"]), float(got["score"])) == (1, 7, 1.5)


def log_bytes(buffer: ReplayBuffer) -> bytes:
    return buffer.storage.read_log("episode") if buffer.storage.log_names() else b""


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_rejected_edit_leaves_the_log_and_the_episode_as_they_were(tmp_path, backend):
    location = str(tmp_path / "b")
    buffer = ReplayBuffer(location, **KWARGS, backend=backend)
    for t in range(STEPS):
        buffer.store(**step(t))
    before, staged = log_bytes(buffer), np.asarray(buffer.data["obs"][0])
    assert before
    with pytest.raises(ValueError, match="does not broadcast"):
        buffer.update(0, obs=np.zeros((STEPS, 4), np.float32))
    with pytest.raises(ValueError, match="invalid field"):
        buffer.update(0, obs=np.zeros((STEPS, 3), np.float32), nope=1)
    with pytest.raises(ValueError, match="shape"):
        buffer.data["obs"][0, 1] = np.zeros(4)
    with pytest.raises(ValueError, match="do not fit dtype uint8"):
        buffer.store_datapoint(0, 1, "img", np.full((2, 2), 300))
    with pytest.raises(ValueError, match="non-finite"):
        buffer.store_meta_datapoint(0, "uid", np.nan)
    assert log_bytes(buffer) == before
    np.testing.assert_array_equal(buffer.data["obs"][0], staged)
    buffer.close()


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_an_edit_then_a_rollback_leaves_nothing_to_replay(tmp_path, backend):
    location = str(tmp_path / "b")
    ReplayBuffer(location, **KWARGS, backend=backend).close()

    def rolled_back_then_killed() -> None:
        buffer = ReplayBuffer(location, **KWARGS, backend=backend, overwrite=False)
        with pytest.raises(RuntimeError), buffer.one_episode(uid=3):
            for t in range(STEPS):
                buffer.store(**step(t))
            edit(buffer, "update")
            assert buffer.storage.log_names() == ["episode"]
            raise RuntimeError("the environment failed")
        assert buffer.storage.log_names() == []
        os.kill(os.getpid(), signal.SIGKILL)

    run_child(rolled_back_then_killed)
    with ReplayBuffer(location, **KWARGS, backend=backend, overwrite=False) as buffer:
        assert len(buffer) == 0 and buffer.num_episodes == 0


# ---- the edit record in the log ----------------------------------------------------------------


def logged_episode(location: str, *records: bytes) -> list[bytes]:
    """Leave a killed writer's step log of 3 steps (step(0..2)) in slot 0, then ``records``."""
    buffer = ReplayBuffer(location, **KWARGS)
    log = StepLog(buffer.schema.fields, buffer.schema.meta_fields)
    steps = [log.header(np.array([0]), 0, {"uid": np.array([5])})]
    steps += [log.steps({n: v[None] for n, v in step(t).items()}) for t in range(3)]
    buffer.storage.append_log("episode", b"".join([*steps, *records]))
    buffer.storage.close()
    buffer.storage.release_writer()  # as a killed writer: its lease gone, its log left
    return steps


def step_log() -> StepLog:
    schema = Schema.build(KWARGS["fields"], KWARGS["meta_fields"], KWARGS["max_episodes"], KWARGS["max_timesteps"])
    return StepLog(schema.fields, schema.meta_fields)


def test_an_edit_record_is_replayed_where_it_stands_in_the_log(tmp_path):
    """An edit applies to the steps logged before it; a truncate after it cuts edited steps as
    it cuts any; a step logged after it is not edited."""
    log = step_log()
    location = str(tmp_path / "b")
    edit_1 = log.edit([("r", 0, 1, np.array([-1.0, -2.0], np.float32)), ("img", 0, 0, np.full((1, 2, 2), 9, np.uint8))])
    logged_episode(location, edit_1, log.truncate(2), log.steps({n: v[None] for n, v in step(8).items()}))
    with ReplayBuffer.from_folder(location) as buffer:
        got = episode_in_slot(buffer)
    assert got["r"].tolist() == [0, -1, 8]
    assert got["img"][:, 0, 0].tolist() == [9, 1, 8]
    assert int(got["uid"]) == 5


def test_a_log_of_the_previous_release_replays_as_before(tmp_path):
    """A log as the release before edit records wrote it (header, steps, meta, truncate; these
    bytes were made by that code) replays unchanged: the format only gained a record kind."""
    previous = bytes.fromhex(
        "6852000000ccca1fa57b22736c6f7473223a205b305d2c202267656e65726174696f6e5f62617365223a20302c20226669656c"
        "6473223a205b226f6273222c202272225d2c20226d657461223a207b22756964223a205b355d7d7d73100000009eab96d10000"
        "00000000803e0000003f00000000731000000037c0c7b60000803f0000a03f0000c03f0000803f6d0c000000b949aa1a7b2275"
        "6964223a205b395d7d7404000000e8efb07701000000"
    )
    location = str(tmp_path / "b")
    ReplayBuffer(location, 4, 16, fields={"obs": ("float", 3), "r": "float"}, meta_fields={"uid": "int"}).close()
    buffer = ReplayBuffer.from_folder(location)
    buffer.storage.append_log("episode", previous)
    buffer.storage.close()
    buffer.storage.release_writer()
    with ReplayBuffer.from_folder(location) as buffer:
        assert buffer.episode_lens.tolist() == [1, 0, 0, 0]
        assert buffer.data["obs"][0, 0].tolist() == [0, 0.25, 0.5] and int(buffer.meta_data["uid"][0]) == 9


def damaged_edits() -> list[tuple[str, bytes, str | None]]:
    """(name, record, the damage reported or None: a torn last record, recovered silently)."""
    log = step_log()
    good = log.edit([("r", 0, 1, np.array([-1.0], np.float32))])
    flipped = bytearray(good)
    flipped[-1] ^= 1

    def raw(payload: bytes) -> bytes:
        return StepLog.record(EDIT, payload)

    r_values = np.array([-1.0], np.float32).tobytes()
    return [
        ("checksum", bytes(flipped), "checksum mismatch"),
        ("torn", good[:-2], None),
        ("row", raw(_EDIT_PART.pack(1, 1, 0, 1) + r_values), "an edit of row 1, the log's group has 1 episode"),
        ("steps", raw(_EDIT_PART.pack(1, 0, 2, 2) + r_values * 2), "an edit of steps 2 to 3, the log holds 3 steps"),
        ("field", raw(_EDIT_PART.pack(3, 0, 0, 1) + r_values), "an edit of field number 3, the log has 3 fields"),
        ("short", raw(_EDIT_PART.pack(1, 0, 0, 2) + r_values), "an edit of 'r' holding 4 bytes, expected 8"),
        (  # a valid part (r of step 1) is not applied when a later one is damaged
            "second part",
            raw(_EDIT_PART.pack(1, 0, 1, 1) + r_values + _EDIT_PART.pack(1, 2, 0, 1) + r_values),
            "an edit of row 2, the log's group has 1 episode",
        ),
        ("empty", raw(b""), "an edit record of 0 bytes, expected 14 to 102 after 3 steps"),
        (  # refused by its size, before its payload is read
            "huge",
            _RECORD.pack(EDIT, 1 << 30, 0) + bytes(64),
            "an edit record of 1,073,741,824 bytes, expected 14 to 102 after 3 steps",
        ),
    ]


@pytest.mark.parametrize("name, record, damage", damaged_edits(), ids=[d[0] for d in damaged_edits()])
def test_a_damaged_edit_record_is_handled_as_a_damaged_step_record(tmp_path, name, record, damage):
    """Damage (a bad checksum, a size no writer gives, parts that do not fit the log) sets the
    log aside with a warning and recovers the steps before it, none of the record applied; a
    torn last record is a kill's residue: the steps are recovered without it, silently."""
    location = str(tmp_path / "b")
    logged_episode(location, record)
    if damage is None:
        buffer = ReplayBuffer.from_folder(location)
    else:
        with pytest.warns(UserWarning, match=r"step log .* is damaged \((.*)\); it was copied to") as caught:
            buffer = ReplayBuffer.from_folder(location)
        (message,) = [str(w.message) for w in caught if "step log" in str(w.message)]
        assert damage in message, message
        assert "3 valid step(s) before the damage are recovered" in message
    with buffer:
        got = episode_in_slot(buffer)
        assert buffer.storage.log_names() == []
    assert got["r"].tolist() == [0, 1, 2] and int(got["uid"]) == 5
