"""Buffers on object stores attacked as a user and an attacker would (moto on 127.0.0.1): a
server that accepts connections but never answers, reached through s3fs; URLs whose path the
clients read differently (a query, a fragment, '//', '.' or '..' segments)."""

from __future__ import annotations

import re
import socket
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from replaybuf import ReplayBuffer, StorageError
from replaybuf.storage._remote import S3FS_CONFIG_DEFAULTS, S3FS_RETRIES, open_store
from replaybuf.storage._zarr import ZarrStorage

pytest_plugins = ["tests._servers"]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An http:// endpoint on 127.0.0.1 that accepts every connection and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:  # closed at teardown
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for connection in accepted:
        connection.close()


def test_s3fs_gets_bounded_timeouts_and_tries_unless_given(s3_server):
    # config_kwargs has no obstore equivalent, so s3fs serves the URL (as in forked workers)
    given = {"read_timeout": 7, "retries": {"max_attempts": 9}}
    store = open_store(s3_server.url("bounded"), {**s3_server.storage_options, "config_kwargs": given})
    fs = store._store.fs
    assert type(fs).__name__ == "S3FileSystem"
    assert fs.retries == S3FS_RETRIES < 5  # s3fs's own default: 5 tries of every request
    assert fs.config_kwargs == {"connect_timeout": S3FS_CONFIG_DEFAULTS["connect_timeout"], **given}
    assert fs.max_concurrency == 1
    defaults = open_store(s3_server.url("bounded"), {**s3_server.storage_options, "config_kwargs": {}})._store.fs
    assert defaults.config_kwargs == S3FS_CONFIG_DEFAULTS


def test_s3fs_config_kwargs_that_is_no_dict_is_refused_by_name(s3_server):
    with pytest.raises(TypeError, match=r"storage_options\['config_kwargs'\] must be a dict, got str"):
        open_store(s3_server.url("bounded"), {**s3_server.storage_options, "config_kwargs": "fast"})


def test_a_server_that_never_answers_fails_an_open_through_s3fs_naming_the_key(s3_server, silent_endpoint):
    url = s3_server.url(f"silent-{uuid.uuid4().hex[:10]}")
    buffer = ReplayBuffer(url, 4, 5, fields={"x": ("float", 3)}, storage_options=s3_server.storage_options)
    buffer.store_episode(x=np.ones((3, 3), np.float32))
    buffer.close()
    options = {**s3_server.storage_options, "endpoint_url": silent_endpoint, "config_kwargs": {"read_timeout": 0.2}}
    with pytest.raises(StorageError, match=r"GET 'zarr.json' on s3://.*ReadTimeoutError"):
        ReplayBuffer.from_folder(url, read_only=True, storage_options=options)


def one_episode_buffer(url: str, options: dict, value: float) -> None:
    buffer = ReplayBuffer(url, 4, 5, fields={"x": ("float", 3)}, storage_options=options)
    buffer.store_episode(x=np.full((3, 3), value, np.float32))
    buffer.close()


@pytest.mark.parametrize(
    ("client", "tail", "found"),
    [
        ("s3fs", "run1/..", r"a '\.' or '\.\.' segment"),  # s3fs wrote keys 'run1/../...', which obstore refuses
        ("obstore", "x#run2", r"a '#' \(fragment\)"),  # obstore dropped '#run2': the buffer at x was replaced
        ("obstore", "x?run2", r"a '\?' \(query\)"),
        ("s3fs", "x//run2", r"an empty segment"),
        ("s3fs", "x/./run2", r"a '\.' or '\.\.' segment"),
    ],
)
def test_a_url_the_clients_read_differently_is_refused_and_erases_no_other_buffer(s3_server, client, tail, found):
    options = {**s3_server.storage_options, **({"config_kwargs": {}} if client == "s3fs" else {})}
    base = s3_server.url(f"paths-{uuid.uuid4().hex[:10]}")
    one_episode_buffer(base, s3_server.storage_options, 1.0)
    # a buffer inside another's prefix cannot be created: one made beside is copied in
    one_episode_buffer(f"{base}-x", s3_server.storage_options, 2.0)
    source, nested = (ZarrStorage(url, s3_server.storage_options).kv for url in (f"{base}-x", f"{base}/x"))
    keys = source.list_prefix("")
    nested.set_many(dict(zip(keys, source.get_many(keys))))
    with pytest.raises(ValueError, match=rf"url '{re.escape(base)}/{re.escape(tail)}': the path .* has {found}"):
        ReplayBuffer(f"{base}/{tail}", 4, 5, fields={"x": ("float", 3)}, storage_options=options, overwrite=True)
    for url, value in ((base, 1.0), (f"{base}/x", 2.0)):
        kept = ReplayBuffer.from_folder(url, read_only=True, storage_options=s3_server.storage_options, cache=False)
        assert kept.get_all_data()["x"][:, 0, 0].tolist() == [value]


@pytest.mark.parametrize("url", ["gs://bucket/a/../b", "gs://bucket/a#b", "s3://bucket//a", "s3://bucket/a/."])
def test_object_store_paths_are_checked_before_any_client_is_made(url):
    with pytest.raises(ValueError, match=rf"url '{re.escape(url)}': the path"):
        open_store(url, {"endpoint_url": "http://127.0.0.1:9"})
