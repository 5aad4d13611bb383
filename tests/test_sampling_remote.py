"""Loaders over a buffer on object storage (moto's S3 server on 127.0.0.1): same batches as
the local buffer, sharded frames read by range requests, fork workers reopen the store."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from replaybuf import ReplayBuffer
from replaybuf.sampling import make_dataloader
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill
from tests.test_sampling import assert_same

pytest_plugins = ["tests._servers"]  # fixture: s3_server

REMOTE_FIELDS = {**FIELDS, "image": ("uint8", (40, 40, 3))}  # >= 4 KB a step: sharded frames
CASES = [{}, {"timestep_level": True, "return_indices": True}, {"n_steps": 3, "sequence_fields": ("image",)}]


@pytest.fixture(scope="module")
def buffers(s3_server, tmp_path_factory):
    options = dict(max_episodes=8, max_timesteps=10, fields=REMOTE_FIELDS, meta_fields=META_FIELDS)
    remote = ReplayBuffer(
        s3_server.url(f"sampling-{uuid.uuid4().hex[:8]}"), storage_options=s3_server.storage_options, **options
    )
    local = ReplayBuffer(tmp_path_factory.mktemp("local") / "buffer", **options)
    fill(remote)
    fill(local)
    return (
        remote,
        ReplayBuffer.from_folder(remote.storage.location, read_only=True, storage_options=s3_server.storage_options),
        local,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c) or "trajectory")
def test_remote_batches_match_local(buffers, case):
    _, reader, local = buffers
    for cache in (None, "ram"):
        remote_batches = list(make_dataloader(reader, 4, cache=cache, **case))
        local_batches = list(make_dataloader(local, 4, **case))
        assert len(remote_batches) == len(local_batches) > 0
        for a, b in zip(remote_batches, local_batches):
            assert_same(a, b, (case, cache))


def test_remote_fork_workers(buffers):
    _, reader, local = buffers
    context = multiprocessing.get_context("fork")
    got = list(
        make_dataloader(reader, 4, timestep_level=True, num_workers=2, multiprocessing_context=context, timeout=120)
    )
    expected = list(make_dataloader(local, 4, timestep_level=True))
    for a, b in zip(got, expected):
        assert_same(a, b, "fork workers on s3")
