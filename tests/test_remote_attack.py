"""Buffers on object stores attacked as a user and an attacker would (moto on 127.0.0.1): a
server that accepts connections but never answers, reached through s3fs."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from replaybuf import ReplayBuffer, StorageError
from replaybuf.storage._remote import S3FS_CONFIG_DEFAULTS, S3FS_RETRIES, open_store

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
    options = {**s3_server.storage_options, "endpoint_url": silent_endpoint, "config_kwargs": {"read_timeout": 1}}
    with pytest.raises(StorageError, match=r"GET 'zarr.json' on s3://.*ReadTimeoutError"):
        ReplayBuffer.from_folder(url, read_only=True, storage_options=options)
