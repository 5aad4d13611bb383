"""Hostile object stores found by an attacker's audit of buffers on S3 (moto on 127.0.0.1): a
damaged or replaced buffer is refused by name by the read cache too, and a writer process that
exits without ``close()`` gives its lease back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

from replaybuf import (
    BufferDamagedError,
    BufferLockedError,
    BufferNotFoundError,
    BufferReplacedError,
    CorruptChunkError,
    MetaChecksumError,
    ReplayBuffer,
    StorageError,
)
from replaybuf.cli import main
from replaybuf.storage import make_storage
from replaybuf.storage.lease import LEASE_KEY

pytest_plugins = ["tests._servers"]

FIELDS = {"x": ("float", 3)}
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def new_url(s3_server) -> str:
    return s3_server.url(f"hostile-{uuid.uuid4().hex[:10]}")


def filled(url: str, options: dict, first: float) -> None:
    """Two episodes whose values start at ``first``."""
    buffer = ReplayBuffer(url, 4, 5, fields=FIELDS, storage_options=options)
    for i in range(2):
        buffer.store_episode(x=np.full((3, 3), first + i, np.float32))
    buffer.close()


def reader(url: str, options: dict) -> ReplayBuffer:
    buffer = ReplayBuffer.from_folder(url, read_only=True, storage_options=options)
    assert type(buffer.storage).__name__ == "CachedStorage"  # the default for object stores
    return buffer


def test_a_cached_reader_refuses_a_lost_lengths_chunk(s3_server):
    url, options = new_url(s3_server), s3_server.storage_options
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.storage.kv.delete_many(["meta/episode_lens/c.0"])
    writer.close()
    # not an empty buffer: the episodes are committed (generations, counters), their lengths lost
    with pytest.raises(BufferDamagedError, match=r"meta/episode_lens of .*committed slots \[0, 1\] is missing"):
        reader(url, options)


def test_a_cached_reader_never_serves_rows_of_a_buffer_overwritten_or_erased_since(s3_server):
    url, options = new_url(s3_server), s3_server.storage_options
    filled(url, options, 1.0)
    old = reader(url, options)
    assert old.get_all_data()["x"][:, 0, 0].tolist() == [1.0, 2.0]  # now cached
    filled(url, options, 50.0)  # overwrite=True: a new uuid, the same slots
    # the cache's load sees another uuid; refresh() opens the new buffer of the same config
    # (``BufferReplacedError`` for another config), whose rows come from its own cache folder
    assert old.refresh().get_all_data()["x"][:, 0, 0].tolist() == [50.0, 51.0]
    assert reader(url, options).get_all_data()["x"][:, 0, 0].tolist() == [50.0, 51.0]
    stale = reader(url, options)
    stale.get_all_data()
    filled(url, options, 90.0)
    with pytest.raises(StorageError, match=r"holds another buffer .* it was overwritten"):
        stale.storage.load_state()  # the cache itself refuses to load another buffer's counters

    again = reader(url, options)
    again.refresh()  # the same buffer: refreshes as before
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.storage.kv.delete_many(writer.storage.kv.list_prefix(""))
    writer.close()
    # erased: refused (the erase reads as a replacement whose new buffer is not there yet)
    with pytest.raises(BufferReplacedError, match=r"no replaybuf buffer at"):
        again.refresh()
    with pytest.raises(BufferNotFoundError, match=r"no longer holds the buffer this reader opened"):
        again.storage.load_state()


def test_an_undecodable_meta_chunk_is_a_damaged_buffer_for_info_and_verify(s3_server, capsys):
    url, options = new_url(s3_server), s3_server.storage_options
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.storage.kv.set("meta/episode_lens/c.0", writer.storage.kv.get("meta/episode_lens/c.0")[:7])
    writer.close()
    with pytest.raises(CorruptChunkError, match=r"meta/episode_lens: slots 0\.\.3: cannot decode"):
        reader(url, options)
    for command in ("info", "verify"):  # a finding about the buffer (exit 1), not a usage error (2)
        assert main([command, url, "--storage-options", json.dumps(options)]) == 1
        assert "the buffer is damaged: meta/episode_lens" in capsys.readouterr().err


CHILD = """
import sys
import numpy as np
from replaybuf import ReplayBuffer
buffer = ReplayBuffer(sys.argv[1], 2, 3, fields={"x": "float"}, storage_options=eval(sys.argv[2]))
if sys.argv[3] == "in-episode":
    buffer.store(x=1.0)
if sys.argv[3] != "plain":
    raise ValueError("the script failed")
"""


# obstore's Rust threads hand each result to the event loop (``call_soon_threadsafe``), and give
# up the GIL while writing its wake-up byte; here they keep it given up 0.3 s after writing it, so
# the loop completes the request and the interpreter finalizes (for 0.6 s at least, then says
# so) before they take it back: the process aborted, or ended before it finalized
SLOW_DELIVERY = """
import asyncio.selector_events, os, threading, time
write_to_self = asyncio.selector_events.BaseSelectorEventLoop._write_to_self
def slow_write_to_self(self):
    write_to_self(self)
    if isinstance(threading.current_thread(), threading._DummyThread):  # a thread Python did not start
        time.sleep(0.3)
asyncio.selector_events.BaseSelectorEventLoop._write_to_self = slow_write_to_self
class SlowFinalization:
    def __del__(self, sleep=time.sleep, write=os.write):  # the module's globals are gone by now
        sleep(0.6)
        write(2, b"finalized")
slow_finalization = SlowFinalization()
"""


@pytest.mark.parametrize("how", ["plain", "exception", "in-episode", "slow-delivery"])
def test_a_writer_process_exiting_without_close_gives_its_s3_lease_back(s3_server, how):
    """slow-delivery: a native thread still delivering the last request's result when the
    interpreter would finalize aborted the process (SIGABRT, -6) without the exit hook of
    ``storage._settle``, which waits for it."""
    url, options = new_url(s3_server), s3_server.storage_options
    script = SLOW_DELIVERY + CHILD if how == "slow-delivery" else CHILD
    done = subprocess.run(
        [sys.executable, "-c", script, url, repr(options), how], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == (0 if how == "plain" else 1), done.stderr
    assert how != "slow-delivery" or done.stderr.endswith("finalized"), done.stderr
    writer = ReplayBuffer.from_folder(url, storage_options=options)  # not BufferLockedError
    assert writer.storage.kv.get(LEASE_KEY) is not None
    writer.close()


def test_a_process_writing_through_zarr_alone_exits_while_a_native_thread_delivers_a_result(s3_server):
    """A ``ProcessLocalStore`` used through zarr's API alone (no replaybuf request) is guarded too."""
    url, options = new_url(s3_server), s3_server.storage_options
    script = SLOW_DELIVERY + (
        "import sys, zarr\n"
        "from replaybuf.storage._remote import ProcessLocalStore\n"
        "zarr.create_array(ProcessLocalStore(sys.argv[1], eval(sys.argv[2])), shape=(4,), dtype='f4')[:] = 1\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, url, repr(options)], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stderr.endswith("finalized"), done.stderr


@pytest.mark.parametrize(
    "expires, taken_over",
    [('"soon"', True), ("null", True), ("1e999", True), ("1e300", False)],  # 1e999: JSON's Infinity
)
def test_a_lease_object_with_a_damaged_expiry_is_judged_not_crashed_on(s3_server, expires, taken_over):
    url, options = new_url(s3_server), s3_server.storage_options
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.close()
    record = f'{{"host": "elsewhere", "pid": 1, "since": "2026-01-01T00:00:00+00:00", "expires": {expires}}}'
    writer.storage.kv.set(LEASE_KEY, record.encode())
    if taken_over:  # unreadable as a time, like an unreadable record: expired
        ReplayBuffer.from_folder(url, storage_options=options).close()
    else:
        with pytest.raises(BufferLockedError, match=r"pid 1 on host 'elsewhere'.*expires at Unix time 1e\+300"):
            ReplayBuffer.from_folder(url, storage_options=options)
        assert writer.storage.kv.get(LEASE_KEY) == record.encode()  # refused: left as it was


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_metadata_object_over_the_limit_is_refused_by_its_size(s3_server, monkeypatch, capsys, client):
    """A metadata object over ``MAX_DOCUMENT_BYTES`` (lowered here; still valid JSON) is refused
    by name and size without reading it whole (obstore: by the size of the GET's response
    headers; s3fs: a GET of the first limit + 1 bytes): opening, ``replaybuf info`` and ``verify``."""
    monkeypatch.setattr("replaybuf.storage.base.MAX_DOCUMENT_BYTES", 1 << 16)
    url = new_url(s3_server)
    options = {**s3_server.storage_options, **({"config_kwargs": {}} if client == "s3fs" else {})}
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.close()
    state = writer.storage.kv.get("replaybuf/state.json")
    writer.storage.kv.set("replaybuf/state.json", state + b" " * (70_000 - len(state)))
    message = f"{url}/replaybuf/state.json: 70,000 bytes, over the 65,536-byte limit of this metadata object"
    with pytest.raises(BufferDamagedError, match=re.escape(message)):
        ReplayBuffer.from_folder(url, read_only=True, storage_options=options)
    for command in ("info", "verify"):  # a finding about the buffer (exit 1), not a usage error (2)
        assert main([command, url, "--storage-options", json.dumps(options)]) == 1
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_step_log_segment_over_what_a_writer_appends_is_refused_by_its_size(s3_server, monkeypatch, client):
    """An object store keeps the step log as one object per append: one larger than any append
    of a writer (``StepLog.segment_bound``; small here with a lowered ``MAX_DOCUMENT_BYTES``) is
    refused by its size, unread; the steps before it are recovered and the copy set aside
    holds them, saying how many bytes it left out."""
    monkeypatch.setattr("replaybuf.storage.base.MAX_DOCUMENT_BYTES", 1 << 16)
    url = new_url(s3_server)
    options = {**s3_server.storage_options, **({"config_kwargs": {}} if client == "s3fs" else {})}
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    log = writer._commit.step_log
    first = log.header(np.array([2]), 2, {}) + b"".join(
        log.steps({"x": np.full((1, 3), t, np.float32)}) for t in range(2)
    )
    writer.storage.append_log("episode", first)
    writer.storage.append_log("episode", b"\0" * 200_000)
    writer.storage.release_writer()  # as a killed writer: its lease gone, its log left
    bound = log.segment_bound(4, 5)
    assert bound < 200_000
    with pytest.warns(UserWarning) as caught:
        buffer = ReplayBuffer.from_folder(url, storage_options=options)
    (message,) = [str(w.message) for w in caught if "step log" in str(w.message)]
    assert f"steplog/episode/0000000001: 200,000 bytes, over the {bound:,}-byte limit" in message, message
    assert "(its last 200,000 bytes, past what a valid log could hold, left out)" in message, message
    assert "2 valid step(s) before the damage are recovered" in message, message
    assert buffer.episode_lens.tolist() == [3, 3, 2, 0]
    np.testing.assert_array_equal(buffer.data["x"][2, :2], [[0, 0, 0], [1, 1, 1]])
    aside = re.search(r"copied to '([^']+)'", message)
    assert aside and buffer.storage.read_blob(aside.group(1)) == first
    buffer.close()


def test_a_frame_shard_copied_from_another_buffer_is_refused_on_s3(s3_server):
    """Buffer B's frame shard of slot 1 copied over buffer A's (same config, same slot) on S3:
    the cached reader's fill names the object and says it is another buffer's (format 6)."""
    options, urls = s3_server.storage_options, [new_url(s3_server) for _ in range(2)]
    fields = {"frame": ("uint8", (32, 32, 4))}
    for first, url in zip((1, 50), urls):
        with ReplayBuffer(url, 4, 5, fields=fields, storage_options=options) as buffer:
            for i in range(2):
                buffer.store_episode(frame=np.full((3, 32, 32, 4), first + i, np.uint8))
    a, b = (make_storage(url, storage_options=options).kv for url in urls)
    key = "data/frame/c.1.0.0.0.0"
    a.set(key, b.get(key))
    with pytest.raises(
        CorruptChunkError, match=r"data/frame: slot 1, .*holds slot 1's data of another buffer"
    ) as error:
        reader(urls[0], options).get_all_data()
    assert key in str(error.value)


def test_meta_values_copied_from_another_buffer_are_refused_on_s3(s3_server):
    """Buffer B's meta objects copied over A's on S3 (same config and lengths, other task
    values): its chunks alone fail every slot's checksum, each bound to its buffer (format 6);
    with their documents too, the open refuses the ``meta/_meta_sum`` document, which names the
    uuid B's entries are bound to. Never B's task values read as A's."""
    options, urls = s3_server.storage_options, [new_url(s3_server) for _ in range(2)]
    for first, url in zip((1, 50), urls):
        with ReplayBuffer(url, 4, 5, fields=FIELDS, meta_fields={"task": "int"}, storage_options=options) as buffer:
            for i in range(2):
                buffer.store_episode(x=np.full((3, 3), i, np.float32), task=first + i)
    a, b = (make_storage(url, storage_options=options).kv for url in urls)
    chunks = [key for key in b.list_prefix("meta/") if not key.endswith("zarr.json")]
    a.set_many({key: b.get(key) for key in chunks})
    with pytest.raises(MetaChecksumError, match=r"meta: slot 0: .*damaged or was copied in from another buffer"):
        reader(urls[0], options)
    a.set_many({key: b.get(key) for key in b.list_prefix("meta/") if key.endswith("zarr.json")})
    with pytest.raises(BufferDamagedError, match=r"meta/_meta_sum/zarr\.json in .*: .* another buffer's"):
        reader(urls[0], options)


def test_a_chunk_far_over_its_size_is_read_no_further_than_the_limit_on_s3(s3_server):
    """A chunk object replaced by a huge one (a bad upload, planted) reached memory whole on S3:
    a planted 300 MB one raised a reader's peak memory by ~920 MB. obstore's GET gives the size
    before the body, so only the first ``limit + 1`` bytes are read, and the read names the damage."""
    url, options = new_url(s3_server), s3_server.storage_options
    filled(url, options, 1.0)
    writer = ReplayBuffer.from_folder(url, storage_options=options)
    writer.close()
    kv = writer.storage.kv
    intact = kv.get("data/x/c.0.0.0")
    kv.set("data/x/c.1.0.0", b"\1" * (1 << 20))
    got = kv.get_many(["data/x/c.0.0.0", "data/x/c.1.0.0", "data/x/c.3.0.0"], limit=4096)
    assert got[0] == intact and got[1] == b"\1" * 4097 and got[2] is None, [len(d or b"") for d in got]
    with pytest.raises(CorruptChunkError, match=r"slot 1, .*more than the [\d,]+ bytes any encoding .* are stored"):
        reader(url, options).data["x"][1]


def test_a_read_only_open_of_a_missing_bucket_says_its_listing_failed(s3_server):
    """A bucket name mistyped read as an empty prefix ("no replaybuf buffer found"), as a GET
    of an absent key answers alike for both; the listing that tells them apart is named."""
    with pytest.raises(BufferNotFoundError, match=r"no-such-bucket/run'; listing it failed: .*LIST .*404 Not Found"):
        ReplayBuffer.from_folder("s3://no-such-bucket/run", read_only=True, storage_options=s3_server.storage_options)
    with pytest.raises(BufferNotFoundError, match=r"found at '[^']+'$"):  # an empty prefix: nothing to add
        ReplayBuffer.from_folder(new_url(s3_server), read_only=True, storage_options=s3_server.storage_options)
