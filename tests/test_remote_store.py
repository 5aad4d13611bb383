"""open_store / ProcessLocalStore against real S3 (moto) and GCS (gcp-storage-emulator) servers."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import uuid

import numpy as np
import pytest
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, ObjectStore

from replaybuf.storage._remote import ProcessLocalStore, RemoteStoreError, open_store, store_key
from tests._remote_rows import RemoteRows
from tests._servers import free_port

pytest_plugins = ["tests._servers"]  # fixtures: s3_server, gcs_server, s3_outage

SERVERS = ["s3_server", "gcs_server"]


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _write_group(store: zarr.abc.store.Store) -> dict[str, np.ndarray]:
    arrays = {
        "data/obs": np.arange(4 * 6 * 3, dtype="float32").reshape(4, 6, 3),
        "meta/episode_lens": np.array([6, 2, 0, 5], dtype="int64"),
    }
    group = zarr.open_group(store, mode="w")
    group.attrs.update({"format": "replaybuf", "version": 1, "schema": {"obs": ["float32", [3], 0.0]}})
    for name, values in arrays.items():
        array = group.create_array(name, shape=values.shape, chunks=(1,) + values.shape[1:], dtype=values.dtype)
        array[:] = values
    return arrays


@pytest.mark.parametrize("server_name", SERVERS)
def test_group_round_trips_with_arrays_and_attrs(request, server_name):
    server = request.getfixturevalue(server_name)
    url = server.url(_unique("roundtrip"))
    with server.record() as requests:
        written = _write_group(open_store(url, server.storage_options, read_only=False))
    assert len(requests.writes()) >= 2 + 4 + 4  # group + array metadata, one object per chunk

    reader = open_store(url, server.storage_options, read_only=True)
    group = zarr.open_group(reader, mode="r")
    assert group.attrs["schema"] == {"obs": ["float32", [3], 0.0]}
    assert group.attrs["version"] == 1
    for name, values in written.items():
        np.testing.assert_array_equal(group[name][:], values)
    assert isinstance(reader._store, ObjectStore if server_name == "s3_server" else FsspecStore)


@pytest.mark.parametrize("server_name", SERVERS)
def test_read_only_open_sends_no_write_request(request, server_name):
    server = request.getfixturevalue(server_name)
    url = server.url(_unique("readonly"))
    _write_group(open_store(url, server.storage_options))

    with server.record() as requests:
        group = zarr.open_group(ProcessLocalStore(url, server.storage_options, read_only=True), mode="r")
        group["data/obs"][:]
        dict(group.attrs)
        with pytest.raises(ValueError, match="read-only"):
            group["meta/episode_lens"][0] = 1
    assert requests.count("GET") >= 5
    assert requests.writes() == []


@pytest.mark.parametrize(
    ("server_name", "extra_options", "client"),
    [
        ("s3_server", {}, "ObjectStore"),
        ("s3_server", {"config_kwargs": {}}, "S3FileSystem"),  # no obstore equivalent: s3fs
        ("gcs_server", {}, "GCSFileSystem"),
    ],
)
def test_concurrent_gets_send_one_request_per_object(request, server_name, extra_options, client):
    server = request.getfixturevalue(server_name)
    name = _unique("concurrent")
    store = open_store(server.url(name), {**server.storage_options, **extra_options})
    assert client in (type(store._store).__name__, type(getattr(store._store, "fs", None)).__name__)
    keys = [f"c/{i}" for i in range(48)]
    prototype = default_buffer_prototype()

    async def put_all():
        await asyncio.gather(*(store.set(key, prototype.buffer.from_bytes(key.encode() * 10)) for key in keys))

    async def get_all(limit: int):
        slots = asyncio.Semaphore(limit)

        async def get(key):
            async with slots:
                return await store.get(key, prototype)

        return await asyncio.gather(*(get(key) for key in keys))

    sync(put_all())
    with server.record() as requests:
        values = sync(get_all(16))
    assert [value.to_bytes() for value in values] == [key.encode() * 10 for key in keys]
    # this store's requests only: the server is shared, and a lease another test's writer still
    # renews may land in the window on a loaded machine
    ours = [(method, path) for method, path in requests.requests if name in path]
    assert [method for method, _ in ours] == ["GET"] * len(keys), ours


def test_options_translate_to_obstore(s3_server):
    store = open_store(s3_server.url("x"), {**s3_server.storage_options, "anon": False, "requester_pays": True})
    obstore_store = store._store.store
    config = obstore_store.config
    assert config["endpoint"] == s3_server.endpoint_url
    assert config["access_key_id"] == s3_server.access_key
    assert config["region"] == "us-east-1"
    assert str(config["request_payer"]).lower() == "true"
    assert str(obstore_store.client_options["allow_http"]).lower() == "true"
    assert obstore_store.retry_config["max_retries"] == 4
    assert obstore_store.prefix == "x"


@pytest.mark.parametrize("by", ["option", "AWS_PROFILE"])
def test_profile_credentials_come_from_aws_files_like_s3fs(s3_server, tmp_path, monkeypatch, by):
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[replaybuf]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    options = {"endpoint_url": s3_server.endpoint_url, "region": "us-east-1"}
    if by == "option":
        options["profile"] = "replaybuf"
    else:
        monkeypatch.setenv("AWS_PROFILE", "replaybuf")

    store = open_store(s3_server.url(_unique("profile")), options)
    provider = store._store.store.credential_provider
    assert provider()["access_key_id"] == s3_server.access_key
    assert s3_server.secret_key not in repr(store)
    written = _write_group(store)
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["data/obs"][:], written["data/obs"])
    assert pickle.loads(pickle.dumps(provider)).profile == provider.profile


def test_an_http_endpoint_from_the_environment_is_reached_through_obstore(s3_server, monkeypatch):
    """A buffer whose endpoint and keys come from the environment alone (a local MinIO): obstore
    reached none (an ``http://`` endpoint needs ``AWS_ALLOW_HTTP`` there: "builder error") while
    s3fs did; obstore now reaches it too, ``AWS_ENDPOINT_URL_S3`` first as botocore does
    (``AWS_ENDPOINT_URL`` is a closed port here)."""
    from replaybuf import ReplayBuffer

    for name in ("AWS_ALLOW_HTTP", "AWS_ENDPOINT", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    location = s3_server.url(_unique("env-endpoint"))
    assert isinstance(open_store(location)._store, ObjectStore)
    with ReplayBuffer(location, 2, 3, fields={"x": "int"}) as writer:
        writer.store_episode(x=np.array([7, 8]))
    assert ReplayBuffer.from_folder(location, read_only=True, cache=False).data["x"][0, :2].tolist() == [7, 8]


def test_option_spellings_obstore_takes_open_through_s3fs_too(s3_server):
    """Top-level ``region``/``region_name`` and ``aws_*`` key names, which obstore's translation
    takes, reach s3fs (forked DataLoader workers' client) as it spells them: they raised
    "AioSession.__init__() got an unexpected keyword argument" there."""
    options = {
        "endpoint_url": s3_server.endpoint_url,
        "aws_access_key_id": s3_server.access_key,
        "aws_secret_access_key": s3_server.secret_key,
        "region": "us-east-1",
    }
    url = s3_server.url(_unique("spelled"))
    written = _write_group(open_store(url, options))
    through_s3fs = open_store(url, {**options, "config_kwargs": {}})  # as in a forked worker
    assert type(through_s3fs._store.fs).__name__ == "S3FileSystem"
    np.testing.assert_array_equal(zarr.open_group(through_s3fs, mode="r")["data/obs"][:], written["data/obs"])


def test_untranslatable_option_falls_back_to_s3fs_without_logging_secrets(s3_server, caplog):
    options = {**s3_server.storage_options, "config_kwargs": {"connect_timeout": 5}}
    with caplog.at_level(logging.DEBUG):
        store = open_store(s3_server.url(_unique("fallback")), options)
    assert type(store._store.fs).__name__ == "S3FileSystem"
    assert "config_kwargs" in caplog.text
    assert s3_server.secret_key not in caplog.text
    written = _write_group(store)
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["data/obs"][:], written["data/obs"])


def test_repr_and_store_key_hide_secrets(s3_server):
    store = ProcessLocalStore(s3_server.url("k"), s3_server.storage_options)
    shown = " ".join([repr(store), str(store), store_key(store.url, store.storage_options), repr(store._store)])
    assert s3_server.secret_key not in shown
    assert s3_server.access_key not in shown
    assert s3_server.endpoint_url in shown
    assert store_key("gs://b/x", {"token": "anon"}) == "gs://b/x [token='anon']"


def test_memory_and_local_urls(tmp_path):
    memory = open_store(f"memory://{_unique('mem')}")
    assert isinstance(memory._store, FsspecStore)
    written = _write_group(memory)
    local = open_store(tmp_path / "buf")
    assert isinstance(local, LocalStore)
    _write_group(local)
    for store in (memory, open_store(f"file://{tmp_path / 'buf'}", read_only=True)):
        np.testing.assert_array_equal(zarr.open_group(store, mode="r")["data/obs"][:], written["data/obs"])


def test_pickled_store_reopens_in_the_new_process_state(s3_server):
    url = s3_server.url(_unique("pickle"))
    _write_group(open_store(url, s3_server.storage_options))
    store = ProcessLocalStore(url, s3_server.storage_options, read_only=True)
    assert not store.is_stale
    copy = pickle.loads(pickle.dumps(store))
    assert copy.is_stale and copy == store
    assert zarr.open_group(copy, mode="r").attrs["version"] == 1
    assert not copy.is_stale
    assert copy.with_read_only(False).read_only is False


@pytest.mark.parametrize(
    ("server_name", "context", "worker_backend"),
    [
        # obstore's runtime does not survive fork: forked workers use s3fs, spawned ones keep obstore.
        ("s3_server", "fork", "S3FileSystem"),
        ("s3_server", "spawn", "obstore"),
        ("gcs_server", "fork", "GCSFileSystem"),
    ],
)
def test_dataloader_workers_open_their_own_store(request, server_name, context, worker_backend):
    server = request.getfixturevalue(server_name)
    url = server.url(_unique("loader"))
    written = _write_group(open_store(url, server.storage_options))
    dataset = RemoteRows(url, server.storage_options)
    parent_backend = dataset[0][2]

    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120
    )
    rows, pids, backends = zip(*loader, strict=True)

    np.testing.assert_array_equal(np.stack([row.numpy() for row in rows]), written["data/obs"])
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert set(backends) == {worker_backend}
    assert dataset.array.store_path.store.backend == parent_backend
    assert not dataset.array.store_path.store.is_stale


def test_stopped_server_raises_clear_error_then_recovers(s3_server, s3_outage):
    url = s3_server.url(_unique("outage"))
    written = _write_group(open_store(url, s3_server.storage_options))
    group = zarr.open_group(ProcessLocalStore(url, s3_server.storage_options), mode="r+")
    obs, lens = group["data/obs"], group["meta/episode_lens"]

    s3_outage.stop()
    with pytest.raises(RemoteStoreError, match=r"GET 'data/obs/c/0/0/0' on s3://") as failure:
        obs[0]
    assert isinstance(failure.value, OSError)
    assert s3_server.secret_key not in str(failure.value)
    with pytest.raises(RemoteStoreError, match=r"PUT 'meta/episode_lens/c/1' on s3://"):
        lens[1] = 7

    s3_outage.restart()
    np.testing.assert_array_equal(obs[:], written["data/obs"])
    np.testing.assert_array_equal(lens[:], written["meta/episode_lens"])
    lens[1] = 7
    assert zarr.open_group(open_store(url, s3_server.storage_options), mode="r")["meta/episode_lens"][1] == 7


@pytest.mark.parametrize(
    ("url", "options", "read_only", "error", "message"),
    [
        (42, None, False, TypeError, "url must be a str"),
        ("  ", None, False, ValueError, "url is empty"),
        ("s3://", None, False, ValueError, "names no bucket"),
        ("s3://Bad_Bucket/x", None, False, ValueError, "not a valid S3 bucket name"),
        ("gs://ab/x", None, False, ValueError, "not a valid GCS bucket name"),
        ("nosuchproto://b/x", None, False, ValueError, "unknown scheme 'nosuchproto'"),
        ("s3://bucket/x", ["endpoint"], False, TypeError, "storage_options must be a dict"),
        ("s3://bucket/x", {"endpoint_url": "localhost:9000"}, False, ValueError, "endpoint_url'] must be an http"),
        ("s3://bucket/x", {"anon": "yes"}, False, TypeError, r"storage_options\['anon'\]"),
        (
            "s3://bucket/x",
            {"region": "r", "client_kwargs": "x"},
            False,
            TypeError,
            r"\['client_kwargs'\] must be a dict",
        ),
        (
            "s3://bucket/x",
            {"endpoint_url": "http://127.0.0.1:1", "client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}},
            False,
            ValueError,
            r"'endpoint_url' twice with two values \(endpoint_url='http://127.0.0.1:1', "
            r"client_kwargs\['endpoint_url'\]='http://127.0.0.1:2'\)",
        ),
        (
            "s3://bucket/x",
            {"secret": "s1", "aws_secret_access_key": "s2"},
            False,
            ValueError,
            r"'aws_secret_access_key' twice with two values \(secret='\*\*\*', aws_secret_access_key='\*\*\*'\)",
        ),
        ("s3://bucket/x", None, "no", TypeError, "read_only must be True or False"),
    ],
)
def test_bad_urls_and_options_are_rejected_clearly(url, options, read_only, error, message):
    with pytest.raises(error, match=message):
        open_store(url, options, read_only=read_only)
    with pytest.raises(error, match=message):
        ProcessLocalStore(url, options, read_only=read_only)
